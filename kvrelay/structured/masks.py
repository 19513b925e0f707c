"""Per step: the allowed-token masks of the sequences that sample under a grammar.

    engine step:  schedule ─▶ TokenMasks.start(sampling requests) ─▶ forward ─▶ Sampler
                                 └─ worker thread: llguidance fills the bitmasks ─┘ (apply)

Owner of: the bitmask buffer and the worker thread. A step whose sampling requests have
no grammar does nothing here: no buffer, no thread hop, no logits pass.

The bitmask is llguidance's layout, int32 [rows, ceil(V / 32)], bit i of word j allowing
token 32 j + i. It becomes a float bias (0 or -inf) through a byte → 8 bits unpack and a
table lookup, added to the row in place: one pass over the row, cheaper than masked_fill.
"""
from __future__ import annotations

import logging
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:
    from kvrelay.engine.request import Request
    from kvrelay.structured.backend import GrammarMatcher

logger = logging.getLogger(__name__)

_BIAS = np.array([-np.inf, 0.0], dtype=np.float32)       # bit 0 → banned, bit 1 → kept


def _constrained(requests: list[Request]) -> list[tuple[int, GrammarMatcher]]:
    return [(i, r.grammar) for i, r in enumerate(requests)
            if r.grammar is not None and r.grammar.failed is None]


class TokenMasks:
    def __init__(self, overlap: bool = True) -> None:
        self.overlap = overlap           # fill in a thread during the forward (else in apply)
        self._pool: ThreadPoolExecutor | None = None
        self._pending: tuple[tuple[int, ...], Future[np.ndarray]] | None = None

    def start(self, requests: list[Request]) -> None:
        """Before the forward: begin filling the masks of `requests` (the step's sampling
        rows, in the sampler's order) that have a grammar."""
        self._pending = None
        rows = _constrained(requests)
        if not rows or not self.overlap:
            return
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="grammar-masks")
        key = tuple(id(r) for r in requests)
        self._pending = (key, self._pool.submit(_fill, rows, len(requests)))

    def apply(self, logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        """logits [N, V] of `requests` → the same tensor with disallowed tokens at -inf
        (the caller owns `logits`; rows without a grammar are untouched)."""
        pending, self._pending = self._pending, None
        rows = _constrained(requests)
        if not rows:
            return logits
        if pending is not None and pending[0] == tuple(id(r) for r in requests):
            bitmask = pending[1].result()
        else:
            bitmask = _fill(rows, len(requests))
        vocab = logits.shape[-1]
        bits = np.unpackbits(bitmask.view(np.uint8), axis=1, count=vocab, bitorder="little")
        for i, _ in rows:
            if not bits[i].any():       # a matcher with no way forward: leave the row free
                logger.error("structured output: no allowed token for %s", requests[i].request_id)
                continue
            logits[i].add_(torch.from_numpy(_BIAS[bits[i]]))
        return logits

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None


def _fill(rows: list[tuple[int, GrammarMatcher]], batch: int) -> np.ndarray:
    """int32 [batch, words]; only the rows of `rows` are written (the rest stay zero)."""
    backend = rows[0][1].backend
    words = (backend.vocab_size + 31) // 32
    bitmask = np.zeros((batch, words), dtype=np.int32)
    backend.fill([(m, i) for i, m in rows], bitmask.ctypes.data, batch)
    return bitmask
