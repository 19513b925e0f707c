"""`kvrelay validate`, what a good answer is: the OpenAI shapes of completion and chat
bodies and of a stream (`ShapeError` says what is wrong), the plausibility of an answer's
text, and the KV-transfer counters read from /metrics. It sends no request itself:
validate_checks.py does, and hands `read_stream` the streamed ones."""
from __future__ import annotations

import json
from typing import Any

import httpx

from kvrelay.model.embedded import CACHE_SUBDIR, EMBEDDED_MODEL_NAME

# The tutorial's prompt without its trailing space: a BPE model has seen " Paris" after "is",
# so a small one answers it greedily (the embedded model: " Paris."; with the space it
# continues "21st-century Paris.").
TUTORIAL_PROMPT = "The capital of France is"
CHAT_MESSAGE = "What is the capital of France? Answer in one word."
# the stem of the embedded model's cache directory (CACHE_SUBDIR's last part, less its version)
EMBEDDED_DIR_STEM = CACHE_SUBDIR.rsplit("/", 1)[-1].rsplit("-v", 1)[0]
# greedy answers validate knows: model → {prompt or chat message: a word the answer contains}
KNOWN_ANSWERS = {EMBEDDED_MODEL_NAME: {TUTORIAL_PROMPT: "Paris", CHAT_MESSAGE: "Paris"}}
MIN_PRINTABLE = 0.9
FINISH_REASONS = ("length", "stop")


class ShapeError(ValueError):
    """A response that is not the OpenAI shape the tutorial expects."""


# ---------------------------------------------------------------------------- response shapes

def check_completion(body: Any) -> tuple[str, str, dict[str, int]]:
    """(text, finish_reason, usage) of a /v1/completions JSON body, or ShapeError saying why not."""
    choice = _first_choice(body)
    text = choice.get("text")
    if not isinstance(text, str) or not text:
        raise ShapeError(f"choices[0].text is empty ({text!r})")
    return text, _finish_reason(choice), _usage(body)


def check_chat(body: Any) -> tuple[str, str, dict[str, int]]:
    """(content or reasoning, finish_reason, usage) of a /v1/chat/completions JSON body."""
    message = _first_choice(body).get("message")
    if not isinstance(message, dict):
        raise ShapeError("choices[0].message is missing")
    text = _message_text(message)
    if not text:
        raise ShapeError("choices[0].message has no content (nor reasoning)")
    return text, _finish_reason(_first_choice(body)), _usage(body)


def _first_choice(body: Any) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise ShapeError("the body is not a JSON object")
    if "error" in body:
        raise ShapeError(f"error object: {body['error']}")
    choices = body.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        raise ShapeError("choices is missing or empty")
    return choices[0]


def _message_text(message: dict[str, Any]) -> str:
    """Content, else the harmony analysis channel (a short max_tokens may end inside it)."""
    for key in ("content", "reasoning_content", "reasoning"):
        value = message.get(key)
        if isinstance(value, str) and value:
            return value
    return ""


def _finish_reason(choice: dict[str, Any]) -> str:
    reason = choice.get("finish_reason")
    if reason not in FINISH_REASONS:
        raise ShapeError(f"choices[0].finish_reason is {reason!r}, expected length or stop")
    return reason


def _usage(body: dict[str, Any]) -> dict[str, int]:
    usage = body.get("usage")
    if not isinstance(usage, dict):
        raise ShapeError("usage is missing")
    for key in ("prompt_tokens", "completion_tokens"):
        value = usage.get(key)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ShapeError(f"usage.{key} is {value!r}, expected a positive integer")
    total = usage.get("total_tokens")
    if total is not None and total != usage["prompt_tokens"] + usage["completion_tokens"]:
        raise ShapeError(f"usage.total_tokens {total} != prompt_tokens + completion_tokens")
    return usage


# ---------------------------------------------------------------------------- plausibility

def implausible(text: str) -> str | None:
    """Why `text` does not look like a language model's answer (None: it does): blank, mostly
    unprintable, or no letters at all (only digits, punctuation or symbols)."""
    if not text.strip():
        return "the answer is blank"
    printable = sum((c.isprintable() and c != "\ufffd") or c in "\n\r\t" for c in text)
    if printable < MIN_PRINTABLE * len(text):
        return (f"only {100 * printable / len(text):.0f}% of the answer's characters are "
                f"printable (at least {100 * MIN_PRINTABLE:.0f}% expected)")
    if not any(c.isalpha() for c in text):
        return "the answer has no letters, only digits, punctuation or symbols"
    return None


def known_model(entries: list[dict[str, Any]], model: str | None) -> str | None:
    """The KNOWN_ANSWERS model that `model` is, from its /v1/models entry: its id or its
    `root` (kvrelay gives the checkpoint directory it loaded; vLLM the model as given)."""
    entry = next((e for e in entries if e.get("id") == model), {"id": model})
    for value in (entry.get("id"), entry.get("root")):
        if not isinstance(value, str):
            continue
        if value in KNOWN_ANSWERS:
            return value
        if value.rstrip("/").rsplit("/", 1)[-1].startswith(EMBEDDED_DIR_STEM):
            return EMBEDDED_MODEL_NAME
    return None


def plausibility(text: str, expect: str | None, why: str) -> tuple[bool, str]:
    """(ok, what was checked or why it failed) for an answer; `expect` a word it must contain
    (`why`: where that expectation comes from), else the weaker `implausible` check."""
    if expect is not None:
        if expect.casefold() in text.casefold():
            return True, f"contains {expect!r}"
        return False, f"the answer does not contain {expect!r} ({why}): {short(text, 60)}"
    problem = implausible(text)
    if problem:
        return False, (f"implausible answer: {problem} (no expected word for this model, so "
                       f"the plausibility check; --expect WORD makes it exact): {short(text, 60)}")
    return True, "plausible text"


def short(text: str, n: int = 40) -> str:
    return repr(text if len(text) <= n else text[:n] + "…")


def http_error(resp: httpx.Response) -> str:
    return f"HTTP {resp.status_code}: {resp.text[:200].strip()}"


# ---------------------------------------------------------------------------- metrics

def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text → {sample name: value summed over labels}."""
    from prometheus_client.parser import text_string_to_metric_families
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            values[sample.name] = values.get(sample.name, 0.0) + sample.value
    return values


TRANSFERS = "kvrelay:kv_transfers_total"
FAILURES = "kvrelay:kv_transfer_failures_total"
HANDSHAKE_ERRORS = "kvrelay:kv_handshake_errors_total"
TRANSFER_BYTES = "kvrelay:kv_transfer_bytes_total"
FALLBACK = "kvrelay:kv_transport_fallback"


async def read_stream(client: httpx.AsyncClient, path: str, body: dict[str, Any],
                      chat: bool) -> int:
    """Read an SSE response to [DONE]; returns the usage chunk's completion_tokens."""
    reason, usage, text, done = None, None, "", False
    async with client.stream("POST", path, json=body) as resp:
        if resp.status_code != 200:
            await resp.aread()
            raise ShapeError(http_error(resp))
        async for line in resp.aiter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                done = True
                break
            event = json.loads(data)
            if "error" in event:
                raise ShapeError(f"error event in the stream: {event['error']}")
            usage = event.get("usage") or usage
            for choice in event.get("choices") or []:
                piece = choice.get("delta", {}) if chat else choice
                text += _message_text(piece) if chat else (piece.get("text") or "")
                reason = choice.get("finish_reason") or reason
    if not done:
        raise ShapeError("the stream ended without data: [DONE]")
    if reason not in FINISH_REASONS:
        raise ShapeError(f"stream finish_reason {reason!r}, expected length or stop")
    if not text:
        raise ShapeError("the stream carried no text")
    if not isinstance(usage, dict):
        raise ShapeError("no usage chunk (stream_options.include_usage)")
    return _usage({"usage": usage})["completion_tokens"]
