"""What a harmony conversation may cost openai-harmony's tokenizer, checked before it runs.

openai-harmony (0.0.8) tokenises the conversation in Rust holding the GIL, and its
byte-pair merge is quadratic in the length of one pre-token ("piece" of o200k's pattern:
a run of letters, of symbols, of whitespace): ~1e-9 s per squared byte here. 100,000
letters "a" took 9.9 s, 100,000 CJK characters without punctuation 63 s, and a ~1 MB run
overflowed its stack (a Rust panic). While it runs no other thread runs: a worker thread
does not help, so the conversation's pieces are bounded instead.

    long_runs: the text split on whitespace (C speed, in windows of WINDOW characters):
               words of at least RUN_CHARS characters, and the work of whitespace runs
    piece_work: those words' o200k pieces, from the checkpoint's own o200k tokenizer
               (`tokenizers`, without the GIL: its word ids are the pieces), Σ bytes²

Over PIECE_WORK (2^28 squared bytes, ~0.27 s of harmony's tokenizer) is a 400 naming
`messages`. Ordinary text has no word of 64 characters and costs one split; URLs, code,
CJK text (no spaces) go through the o200k tokenizer once. A piece of ~16 KiB alone uses
the whole budget: no prose has one; a 16 KiB run of one letter, or of CJK characters
without punctuation, is refused.
"""
from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from typing import Any

from kvrelay.server.prompt_tokens import utf8_len
from kvrelay.server.protocol import OpenAIError

RUN_CHARS = 64
PIECE_WORK = 2**28
WINDOW = 2**20
_SPACE_RUN = re.compile(rf"\s{{{RUN_CHARS},}}")


def _windows(text: str) -> Iterator[str]:
    """`text` in windows of WINDOW characters (each split is GIL-held C work; a word or run
    cut at a window's edge counts as two, under-counting its work at most twice)."""
    for start in range(0, len(text), WINDOW):
        yield text[start:start + WINDOW]


def long_runs(texts: Iterable[str]) -> tuple[list[str], int]:
    """The words of at least RUN_CHARS characters, and the work (Σ bytes²) of the runs of
    whitespace of at least that length (a whitespace run is one or two pieces)."""
    words: list[str] = []
    work = 0
    for text in texts:
        if len(text) < RUN_CHARS:
            continue
        for window in _windows(text):
            work += sum(utf8_len(m.group()) ** 2 for m in _SPACE_RUN.finditer(window))
            words.extend(w for w in window.split() if len(w) >= RUN_CHARS)
    return words, work


def piece_work(hf: Any, words: list[str]) -> int:
    """Σ over the o200k pieces of `words` of their bytes², from the HF tokenizer's word
    ids (a word id per pre-token); without one, each word counts as one piece."""
    work = 0
    for word in words:
        if hf is None:
            work += utf8_len(word) ** 2
            continue
        encoding = hf.encode_batch([word], add_special_tokens=False)[0]
        spans: dict[int, list[int]] = {}
        for piece, (start, end) in zip(encoding.word_ids, encoding.offsets):
            span = spans.setdefault(-1 if piece is None else piece, [start, end])
            span[0], span[1] = min(span[0], start), max(span[1], end)
        work += sum(utf8_len(word[a:b]) ** 2 for a, b in spans.values())
    return work


def check_piece_work(hf: Any, words: list[str], work: int) -> None:
    """400 when the long `words` and whitespace runs (`long_runs`) would cost
    openai-harmony's tokenizer more than PIECE_WORK."""
    if words and work <= PIECE_WORK:
        work += piece_work(hf, words)
    if work > PIECE_WORK:
        raise OpenAIError(
            "messages: the text holds runs of letters, symbols or whitespace so long that the "
            "harmony renderer's tokenizer, quadratic in a run's length, would stall the "
            f"server (one run of {int(PIECE_WORK ** 0.5)} bytes, or {PIECE_WORK // 2**20} of "
            "1 KiB, already would); break them up", param="messages")
