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

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from kvrelay import http_body, rawjson
from kvrelay.http_body import MAX_JSON_CONTAINERS, MAX_JSON_STRINGS  # noqa: F401 -- named here
from kvrelay.server.prompt_tokens import NO_FACTS, TokenizerFacts
from kvrelay.server.protocol import OpenAIError
from kvrelay.server.response_store import (
    METADATA_MAX_KEY_CHARS,
    METADATA_MAX_PAIRS,
    METADATA_MAX_VALUE_CHARS,
    check_metadata_pairs,
)

MAX_MESSAGES = 4096
MAX_TOOLS = 128
MAX_TOKEN_IDS = 4 * 2**20
MAX_OTHER_NUMBERS = 262_144



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
    request may (`http_body.check_raw_shape`, with this server's number cap)."""
    try:
        http_body.check_raw_shape(raw, limits.max_numbers)
    except http_body.BodyError as e:
        if e.param == "prompt":
            raise OpenAIError(
                f"the body holds more than {limits.max_numbers} numbers: at most "
                f"{limits.max_prompts} prompts (--max-seqs-per-request) of fewer than "
                f"{limits.max_model_len} token ids (--max-model-len), {MAX_TOKEN_IDS} ids in "
                f"all, and {MAX_OTHER_NUMBERS} other numbers", param="prompt") from None
        raise OpenAIError(e.message, param=e.param) from None


# Bytes of `metadata` no acceptable value can exceed: 16 pairs of a 64- and a 512-character
# string, every character a 6-byte escape, and the JSON punctuation around them.
METADATA_MAX_RAW_BYTES = (METADATA_MAX_PAIRS * (METADATA_MAX_KEY_CHARS + METADATA_MAX_VALUE_CHARS)
                          * 6 + METADATA_MAX_PAIRS * 8 + 2)


RAW_CHECK_BYTES = 64 * 1024      # smaller bodies are parsed at once: nothing to save
_NOT_PLAIN = re.compile(rb"[\\\x80-\xff]")     # an escape or a non-ASCII byte


def check_raw_fields(path: str, raw: bytes, limits: RequestLimits) -> None:
    """400 for a field whose bytes alone prove it unacceptable, before the parse builds it
    (a 31 MB prompt or a 25 MB `metadata` would be held twice, as text and as its value,
    only to be refused):
    - `metadata` (Responses) longer than any acceptable one can be (METADATA_MAX_RAW_BYTES);
    - a completion's `prompt` string, plain ASCII without escapes (its text is then its bytes
      exactly), that proves at least --max-model-len tokens: the check of `check_text_bytes`,
      same decision and message, on the bytes."""
    if len(raw) <= RAW_CHECK_BYTES or path not in ("/v1/responses", "/v1/completions"):
        return
    try:
        fields = rawjson.split_fields(raw)
    except (ValueError, RecursionError):            # not a JSON object: the parse says why
        return
    metadata = fields.get("metadata") if path == "/v1/responses" else None
    if metadata is not None and len(metadata) > METADATA_MAX_RAW_BYTES:
        _check_raw_metadata(rawjson.node(metadata))
    prompt = fields.get("prompt") if path == "/v1/completions" else None
    if prompt is None or len(prompt) <= RAW_CHECK_BYTES:
        return
    view = memoryview(prompt)
    if view[0] != ord('"') or _NOT_PLAIN.search(view) is not None:
        return
    facts = limits.facts
    step = RAW_CHECK_BYTES
    skipped = sum(bytes(view[i:i + step]).count(c.encode())      # a window at a time
                  for i in range(1, view.nbytes - 1, step) for c in facts.untokenized)
    covered = view.nbytes - 2 - skipped
    _refuse_proven_length(covered, limits.max_model_len, facts, "prompt", "prompt")


def _check_raw_metadata(metadata: Any) -> None:
    """`check_metadata`'s refusal, same message, of `metadata` not parsed: its members'
    values measured a window at a time. (Bytes past METADATA_MAX_RAW_BYTES can only be
    whitespace when nothing is refused: the parse then goes on.)"""
    if not rawjson.is_object(metadata):
        raise OpenAIError("metadata must be an object of string keys and values",
                          param="metadata")
    members = rawjson.members(metadata)
    check_metadata_pairs(len(members), (
        (key, rawjson.is_string(value),
         sum(map(len, rawjson.string_windows(value))) if rawjson.is_string(value) else 0)
        for key, value in ((key, members[key]) for key in members)))


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
    _refuse_proven_length(sum(facts.covered_bytes(t) for t in texts), max_model_len, facts,
                          param, what)


def _refuse_proven_length(covered: float, max_model_len: int, facts: TokenizerFacts,
                          param: str, what: str) -> None:
    if not facts.longest_token_bytes or not max_model_len:
        return
    at_least = facts.min_tokens(covered)
    if at_least >= max_model_len:
        raise OpenAIError(
            f"This model's maximum context length is {max_model_len} tokens. However, your "
            f"{what} has at least {at_least} tokens ({int(covered)} bytes of text; no token "
            f"of this model covers more than {facts.longest_token_bytes}).", param=param)
