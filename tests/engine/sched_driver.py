"""Drive a `Scheduler` without a model: a fake forward that keeps its "KV" in block slots.

`FakeForward` writes every computed token into the slot its position maps to through
the request's block table (group 0), and derives the next token from what the slots
of positions [0, end) hold. A scheduler or KV manager that reuses a block whose
contents were not recomputed, skips tokens or frees the wrong request's blocks
therefore changes the generated tokens, which `reference` computes directly.
"""
from __future__ import annotations

from kvrelay.engine.request import Request
from kvrelay.engine.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from kvrelay.kv_cache.manager import KVCacheGroup, KVCacheManager
from kvrelay.sampling_params import SamplingParams

VOCAB = 97
BLOCK = 4


def next_token(tokens: list[int]) -> int:
    """A position-sensitive function of the whole context (the fake model)."""
    return sum((i + 1) * t for i, t in enumerate(tokens)) % VOCAB


def reference(prompt: list[int], max_tokens: int) -> list[int]:
    tokens = list(prompt)
    for _ in range(max_tokens):
        tokens.append(next_token(tokens))
    return tokens[len(prompt):]


def make_scheduler(num_blocks: int, *, budget: int = 64, max_num_seqs: int = 16,
                   max_model_len: int = 128, prefix_caching: bool = True,
                   chunked_prefill: bool = True) -> Scheduler:
    kv = KVCacheManager(num_blocks, BLOCK, [KVCacheGroup(window=None, num_layers=1)],
                        enable_prefix_caching=prefix_caching)
    return Scheduler(SchedulerConfig(budget, max_num_seqs, max_model_len, chunked_prefill), kv)


def request(request_id: str, prompt: list[int], max_tokens: int = 4, **kwargs) -> Request:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return Request(request_id, list(prompt), params, **kwargs)


class FakeForward:
    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler
        self.slots: dict[int, int] = {}

    def _slot(self, req: Request, pos: int) -> int:
        table = self.scheduler.kv.block_ids(req.request_id)[0]
        return table[pos // BLOCK] * BLOCK + pos % BLOCK

    def __call__(self, out: SchedulerOutput) -> dict[str, list[int]]:
        sampled = {}
        for chunk in out.chunks:
            req = chunk.request
            end = chunk.start + chunk.num_tokens
            for pos in range(chunk.start, end):
                self.slots[self._slot(req, pos)] = req.all_token_ids[pos]
            if chunk.completes:
                seen = [self.slots.get(self._slot(req, p), -1) for p in range(end)]
                sampled[req.request_id] = [next_token(seen)]
        return sampled


def step(scheduler: Scheduler, forward: FakeForward) -> tuple[SchedulerOutput, list[Request]]:
    """One schedule → fake forward → update; checks the pool's invariants after it."""
    out = scheduler.schedule()
    assert out.num_batched_tokens <= scheduler.config.max_num_batched_tokens
    finished = scheduler.update(out, forward(out))
    scheduler.kv.check_integrity()
    return out, finished


def run_to_completion(scheduler: Scheduler, forward: FakeForward,
                      max_steps: int = 500) -> list[SchedulerOutput]:
    outs = []
    while scheduler.has_unfinished:
        assert len(outs) < max_steps, "the scheduler made no progress"
        outs.append(step(scheduler, forward)[0])
    return outs


def chunks_of(out: SchedulerOutput) -> list[tuple[str, int, int]]:
    """(request id, start, number of tokens) of every chunk, in the step's order."""
    return [(c.request.request_id, c.start, c.num_tokens) for c in out.chunks]
