"""What the scheduler decides for one step — the typed contract between `Scheduler`
(`engine/scheduler.py`) and the parts that run the step (`step_io.py`, `kv_transfer.py`,
`output_processor.py`, `async_steps.py`) — and its configuration.

A `ScheduledChunk` computes positions [start, start + num_tokens) of one request. With
speculative decoding (`drafts`, kvrelay/spec_decode/) a decode chunk also carries the draft
tokens the drafter proposed for it, as many as the budget, its max_tokens and
max_model_len leave room for, with blocks for their slots (no preemption for drafts:
without blocks it is a plain decode). Its chunk computes [last token, d1 … dK];
`Scheduler.update` keeps the accepted drafts as computed (their KV is right) and releases
the blocks past the request's tokens. The slots of rejected drafts hold stale KV at
positions >= num_computed_tokens, which attention never reads (it stops at the context
length) and the next chunk there overwrites; prefix-cache hashes only ever cover
computed, hence accepted, tokens.

    positions   p    p+1  p+2  p+3      the chunk: start p, the last token t and 3 drafts
    computes    t    d1   d2   d3       (the row at q predicts the token at q + 1)
    drawn       d1   d2   x             d1, d2 accepted; x ≠ d3: the target's own token
    after       t    d1   d2   x        computed through p+2; the next chunk starts at p+3
                                        with x, over the stale K/V of d3
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from kvrelay.engine.request import Request


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_batched_tokens: int = 8192
    max_num_seqs: int = 256
    max_model_len: int = 8192
    # False: a waiting prompt is split only when it could not fit whole in a step
    chunked_prefill: bool = True

    def __post_init__(self) -> None:
        for name in ("max_num_batched_tokens", "max_num_seqs", "max_model_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")


@dataclass
class ScheduledChunk:
    request: Request
    start: int                  # first token position computed this step
    num_tokens: int             # tokens computed this step
    # async scheduling: a decode of the token the step in flight samples (not known yet)
    pending: bool = False
    # speculative decoding: draft tokens after the last known one, verified by this step
    # (counted in num_tokens: the chunk computes 1 + len(drafts) positions)
    drafts: list[int] = field(default_factory=list)

    @property
    def completes(self) -> bool:
        """Whether this chunk reaches the last known token (so a token is sampled)."""
        return self.pending or self.start + self.num_tokens - len(self.drafts) \
            == self.request.num_tokens

    @property
    def is_decode(self) -> bool:
        """One known token (and its drafts, if any): attended as decodes, one row each."""
        return self.num_tokens - len(self.drafts) == 1


# (request, most drafts it may get) -> draft tokens (kvrelay/spec_decode/ngram.py)
Drafter = Callable[[Request, int], list[int]]


def chunk_order(chunk: ScheduledChunk) -> int:
    """Decodes 0, chunks continuing a prefix 1, prompt chunks from position 0 2."""
    return 0 if chunk.is_decode else 1 if chunk.start else 2


@dataclass
class KVLoad:
    """Decode side: pull the prompt's KV for tokens [hit_tokens, prompt_len - 1)."""
    request: Request
    hit_tokens: int


@dataclass
class SchedulerOutput:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)
    loads: list[KVLoad] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)

    @property
    def is_empty(self) -> bool:
        return not self.chunks
