"""What one request may hold, checked before anything costly sees it.

Two stages, both before pydantic, the tokenizer, a chat renderer or a grammar compiler:

- `scan_body(raw)`, on the raw bytes before the JSON parse: how many JSON containers,
  strings and numbers the body holds (C-speed counts; brackets, quotes and digits inside
  strings are told apart only when the plain counts are over a cap). The parse itself
  then costs at most what the caps allow (a 32 MiB body of `[]` took 12.7 s and 800 MB to
  parse; of small token ids, 1-3 s holding the GIL).
- `check_shape(path, value)`, on the parsed body: prompts per batch, token ids per prompt,
  a prompt string whose byte length alone proves it longer than the context, messages,
  tools and Responses input items.

Every refusal is a 400 whose `param` names the field (`OpenAIError`).

The caps (each far above any request the server could serve):

- `MAX_MESSAGES` 4,096 messages (chat) or input items (Responses): longer than any context.
- `MAX_TOOLS` 128 tools: OpenAI's own limit.
- prompts in a batch: `--max-seqs-per-request` (256; `server/admission.py` bounds
  prompts × n too).
- token ids per prompt: fewer than `--max-model-len` (the prompt must leave room).
- numbers in a body: min(prompts × max-model-len, `MAX_TOKEN_IDS` = 4 Mi) +
  `MAX_OTHER_NUMBERS` (256 Ki): bounds the parse (4 Mi small ids parse in ~0.3 s).
- `MAX_JSON_CONTAINERS` 65,536 arrays and objects: tool schemas, messages and batches need
  thousands.
- `MAX_JSON_STRINGS` 262,144 strings: a whole vocabulary of `logit_bias` keys fits.
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from kvrelay.server.prompt_tokens import NO_FACTS, TokenizerFacts
from kvrelay.server.protocol import OpenAIError

MAX_MESSAGES = 4096
MAX_TOOLS = 128
MAX_TOKEN_IDS = 4 * 2**20
MAX_OTHER_NUMBERS = 262_144
MAX_JSON_CONTAINERS = 65_536
MAX_JSON_STRINGS = 262_144

# every digit becomes "0", every other byte a space: a number literal starts at " 0"
_DIGITS = bytes(0x30 if 0x30 <= c <= 0x39 else 0x20 for c in range(256))


@dataclass(frozen=True)
class RequestLimits:
    """The per-server values the checks need."""
    max_model_len: int
    max_prompts: int                          # --max-seqs-per-request
    facts: TokenizerFacts = field(default=NO_FACTS)   # the bytes-per-token bound, if any

    @property
    def max_numbers(self) -> int:
        """Numbers a body may hold: every prompt's token ids, and the other fields'."""
        ids = min(self.max_prompts * max(self.max_model_len - 1, 0), MAX_TOKEN_IDS)
        return ids + MAX_OTHER_NUMBERS


# -- before the parse ------------------------------------------------------------------------
def scan_body(raw: bytes, limits: RequestLimits) -> None:
    """400 when the raw JSON body holds more containers, strings or numbers than any
    request may. Counts inside strings are separated out only when a plain count is over
    its cap (a long text full of brackets or digits is fine)."""
    quotes = raw.count(b'"')
    if quotes > 2 * MAX_JSON_STRINGS:
        quotes = _unescaped(raw).count(b'"')          # \" inside strings is no delimiter
        if quotes > 2 * MAX_JSON_STRINGS:
            raise OpenAIError(f"the body holds more than {MAX_JSON_STRINGS} JSON strings")
    containers = raw.count(b"[") + raw.count(b"{")
    digits = raw.translate(_DIGITS)
    numbers = digits.count(b" 0") + digits.startswith(b"0")
    if containers <= MAX_JSON_CONTAINERS and numbers <= limits.max_numbers:
        return
    containers, numbers = _outside_strings(_unescaped(raw), digits)
    if containers > MAX_JSON_CONTAINERS:
        raise OpenAIError(f"the body holds more than {MAX_JSON_CONTAINERS} JSON arrays and "
                          "objects")
    if numbers > limits.max_numbers:
        raise OpenAIError(
            f"the body holds more than {limits.max_numbers} numbers: at most "
            f"{limits.max_prompts} prompts (--max-seqs-per-request) of fewer than "
            f"{limits.max_model_len} token ids (--max-model-len), {MAX_TOKEN_IDS} ids in all, "
            f"and {MAX_OTHER_NUMBERS} other numbers", param="prompt")


def _unescaped(raw: bytes) -> bytes:
    """`raw` without its escaped backslashes and quotes: every `"` left delimits a string.
    (Escapes pair up left to right, as `replace` finds them; no copy when there are none.)"""
    return raw.replace(b"\\\\", b"").replace(b'\\"', b"")


def _outside_strings(clean: bytes, digits: bytes) -> tuple[int, int]:
    """Containers and number literals outside strings. `clean` has no escaped quotes;
    `digits` is the translated raw body (its offsets differ from `clean`'s when escapes
    were removed, so numbers are counted on `clean` translated)."""
    if len(clean) != len(digits):
        digits = clean.translate(_DIGITS)
    containers = numbers = 0
    start = 0
    while True:
        quote = clean.find(b'"', start)
        end = len(clean) if quote < 0 else quote
        containers += clean.count(b"[", start, end) + clean.count(b"{", start, end)
        numbers += digits.count(b" 0", start, end) + (digits[start:start + 1] == b"0")
        if quote < 0:
            return containers, numbers
        close = clean.find(b'"', quote + 1)
        if close < 0:                           # malformed: the parse will say where
            return containers, numbers
        start = close + 1


# -- after the parse, before pydantic --------------------------------------------------------
def check_shape(path: str, body: Any, limits: RequestLimits) -> None:
    """The per-endpoint caps on a parsed body; fields of the wrong type are left to
    pydantic, which names them."""
    if not isinstance(body, Mapping):
        return
    if path == "/v1/completions":
        _check_prompt(body.get("prompt"), limits)
    elif path == "/v1/chat/completions":
        _check_count(body.get("messages"), MAX_MESSAGES, "messages", "messages")
        _check_count(body.get("tools"), MAX_TOOLS, "tools", "tools")
    elif path == "/v1/responses":
        _check_count(body.get("input"), MAX_MESSAGES, "input items", "input")
        _check_count(body.get("tools"), MAX_TOOLS, "tools", "tools")


def _check_count(value: Any, cap: int, what: str, param: str) -> None:
    if isinstance(value, list) and len(value) > cap:
        raise OpenAIError(f"{param}: {len(value)} {what}; at most {cap} are accepted",
                          param=param)


def _check_prompt(prompt: Any, limits: RequestLimits) -> None:
    if isinstance(prompt, str):
        check_text_bytes(prompt, limits, "prompt")
        return
    if not isinstance(prompt, list) or not prompt:
        return
    if isinstance(prompt[0], int):
        check_id_count(len(prompt), limits.max_model_len)
        return
    if len(prompt) > limits.max_prompts:
        raise OpenAIError(f"prompt: {len(prompt)} prompts in one request; this server takes at "
                          f"most {limits.max_prompts} (--max-seqs-per-request)", param="prompt")
    for item in prompt:
        if isinstance(item, list):
            check_id_count(len(item), limits.max_model_len)
        elif isinstance(item, str):
            check_text_bytes(item, limits, "prompt")


def check_id_count(n: int, max_model_len: int) -> None:
    """A token-id prompt of `n` ids must leave room for one new token."""
    if n >= max_model_len:
        raise OpenAIError(
            f"This model's maximum context length is {max_model_len} tokens. However, your "
            f"prompt has {n} tokens, leaving no room for a completion.", param="prompt")


def check_text_bytes(text: str, limits: RequestLimits, param: str) -> None:
    """400 when the text's byte length alone proves more tokens than the context holds."""
    check_min_tokens([text], limits.max_model_len, limits.facts, param)


def check_min_tokens(texts: Iterable[str], max_model_len: int, facts: TokenizerFacts,
                     param: str, what: str = "prompt") -> None:
    """400 when the bytes of `texts` together prove at least `max_model_len` tokens: no
    token covers more than `facts.longest_token_bytes` of them (no bound known: no check)."""
    if not facts.longest_token_bytes or not max_model_len:
        return
    covered = sum(facts.covered_bytes(t) for t in texts)
    at_least = facts.min_tokens(covered)
    if at_least >= max_model_len:
        raise OpenAIError(
            f"This model's maximum context length is {max_model_len} tokens. However, your "
            f"{what} has at least {at_least} tokens ({int(covered)} bytes of text; no token "
            f"of this model covers more than {facts.longest_token_bytes}).", param=param)
