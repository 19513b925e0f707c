"""The decode's KV loads: which blocks to pull, and one load's progress over the ranks.

Block maths (block size B, prompt length P, decode prefix hit of h tokens): decode
needs the KV of tokens [0, P-1) (it recomputes token P-1). Of group g it reads the
logical blocks [max(h/B, first_g), (P-2)//B] where first_g = 0 for full attention and
(P-1-W+1)//B for a sliding window W; the prefill keeps exactly those (it only
releases blocks below the window of its own last chunk).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from kvrelay.disagg.worker import LoadEvent


def needed_blocks(window: int | None, hit_tokens: int, prompt_len: int, block_size: int) -> range:
    """Logical blocks decode must pull for tokens [hit, P-1) (see the module docstring)."""
    if prompt_len <= 1:
        return range(0)
    first = 0 if window is None else max(prompt_len - 1 - window + 1, 0) // block_size
    last = (prompt_len - 2) // block_size
    return range(max(hit_tokens // block_size, first), last + 1)


@dataclass
class Load:
    """One request's KV load, as its ranks report (the connector owns the loads)."""
    request_id: str
    started: float
    waiting: set[int]                  # ranks whose read has not finished
    nbytes: int = 0
    error: str | None = None
    # rank → (read started, read took, report seen), seconds relative to `started`
    ranks: dict[int, tuple[float, float, float]] = field(default_factory=dict)

    def record(self, event: LoadEvent, now: float) -> None:
        """A rank's read finished (or failed); a rank heard from already is ignored."""
        if event.rank not in self.waiting:
            return                                        # cancelled or failed meanwhile
        self.waiting.discard(event.rank)
        self.nbytes += event.nbytes
        self.ranks[event.rank] = (event.started - self.started, event.seconds,
                                  now - self.started)
        if event.error is not None and self.error is None:
            self.error = event.error
