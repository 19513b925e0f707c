"""A step's way in and out of the model: the scheduler's chunks → `StepInput`, the
forward (a failure attributed to the request that caused it), and the logits rows →
prompt logprobs and sampled tokens.

Row layout of the logits (`StepInput.logits_rows`), chunk by chunk in schedule order:

    chunk i: [prompt-logprob rows of i (if asked)] [its sampling row (if it completes)]

A chunk scores prompt token p + 1 from the logits at position p, for p in
[start, start + n) with p + 1 < prompt length; a chunk that reaches the end of what
is known samples from its last row.

A speculative chunk (a decode with K draft tokens, kvrelay/spec_decode/) enters the model
as K + 1 decode rows — the paged decode kernels' one-query-per-row path, each row's
context one position longer than the previous one's, all sharing the request's block
table (every row's K/V is written before any row attends) — and all K + 1 are sampling
rows, verified by `engine/spec_verify.py`:

    chunk start p, tokens t d1 d2:  rows (token, position, context)  (t, p, p+1)
                                                                      (d1, p+1, p+2)
                                                                      (d2, p+2, p+3)
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from kvrelay.engine.request import Logprob, Request
from kvrelay.engine.runner import StepInput
from kvrelay.engine.sampler import Sampler, top_logprobs
from kvrelay.engine.scheduler_output import ScheduledChunk, SchedulerOutput
from kvrelay.engine.spec_verify import verify
from kvrelay.kv_cache.manager import KVCacheManager

logger = logging.getLogger(__name__)

FailFn = Callable[[Request, BaseException, str], None]


@dataclass
class StepPlan:
    """A scheduled step not yet run."""
    out: SchedulerOutput
    step: StepInput | None           # None: nothing to compute here this step
    failed: list[Request]
    kv_work: object = None
    sampling: list[Request] | None = None  # the requests it samples (`prepare_sampling`)

    @property
    def num_tokens(self) -> int:
        return len(self.step.token_ids) if self.step is not None else 0


def step_input(out: SchedulerOutput, kv: KVCacheManager, num_groups: int) -> StepInput:
    token_ids: list[int] = []
    q_lens: list[int] = []
    starts: list[int] = []
    rows: list[int] = []
    tables: list[list[list[int]]] = [[] for _ in range(num_groups)]
    for chunk in out.chunks:
        req = chunk.request
        if chunk.drafts:
            _speculative_rows(chunk, kv, token_ids, q_lens, starts, tables)
            rows.extend(range(len(token_ids) - chunk.num_tokens, len(token_ids)))
            continue
        ids = req.all_token_ids[chunk.start:chunk.start + chunk.num_tokens]
        # a pending chunk's token is still being sampled: 0 until `fill_pending`
        token_ids.extend(ids if len(ids) == chunk.num_tokens else [0] * chunk.num_tokens)
        q_lens.append(chunk.num_tokens)
        starts.append(chunk.start)
        for g, ids in enumerate(kv.block_ids(req.request_id)):
            tables[g].append(ids)
        end = len(token_ids)
        n_prompt = prompt_logprob_rows(chunk)
        rows.extend(range(end - chunk.num_tokens, end - chunk.num_tokens + n_prompt))
        if chunk.completes:
            rows.append(end - 1)
    num_decodes = sum(c.num_tokens if c.drafts else 1 for c in out.chunks if c.is_decode)
    return StepInput(token_ids, q_lens, starts, tables, rows, num_decodes)


def _speculative_rows(chunk: ScheduledChunk, kv: KVCacheManager, token_ids: list[int],
                      q_lens: list[int], starts: list[int],
                      tables: list[list[list[int]]]) -> None:
    """A speculative chunk as 1 + K decode rows (module docstring), appended in place."""
    req, n = chunk.request, chunk.num_tokens
    token_ids.append(req.all_token_ids[chunk.start])
    token_ids.extend(chunk.drafts)
    q_lens.extend([1] * n)
    starts.extend(range(chunk.start, chunk.start + n))
    for g, ids in enumerate(kv.block_ids(req.request_id)):
        tables[g].extend([ids] * n)


def fill_pending(out: SchedulerOutput, step: StepInput, sampled: dict[str, list[int]]) -> None:
    """Async scheduling: put the tokens the previous step sampled into this step's
    pending chunks (a request that got none — failed, aborted — keeps token 0: its
    row is computed and dropped)."""
    at = 0
    for chunk in out.chunks:
        if chunk.pending:
            tokens = sampled.get(chunk.request.request_id)
            if tokens:
                step.token_ids[at] = tokens[-1]
        at += chunk.num_tokens


def forward(executor: Any, out: SchedulerOutput, step: StepInput, kv: KVCacheManager,
            fail: FailFn) -> torch.Tensor:
    """The model forward, with a failure attributed to the requests that cause it.

    With TP worker ranks or experts across replicas (`executor.can_rerun` false) a
    failed forward is fatal: the ranks' collectives cannot be replayed for a subset
    of the batch. In this process (TP=1) each chunk is re-run alone; a chunk that
    fails alone fails its request, the others keep their logits (concatenated in
    chunk order, the row layout `sample` expects). Re-running is safe: a
    forward writes K/V only to the slots of its own new tokens, which no other
    request shares and the prefix cache does not hold yet, and rewriting them gives
    the same values. When every chunk of a multi-chunk step fails alone too, the
    fault is not a request's: fatal.
    """
    if not executor.can_rerun:
        return executor.execute(step)
    try:
        return executor.execute(step)
    except Exception as error:                      # attributed per chunk below
        if len(out.chunks) > 1:
            logger.warning("a forward of %d chunks failed (%s: %s); re-running each alone",
                           len(out.chunks), type(error).__name__, error)
        alone: list[tuple[ScheduledChunk, torch.Tensor | None, Exception | None]] = []
        for chunk in out.chunks:
            try:
                chunk_step = step_input(SchedulerOutput([chunk]), kv, executor.runner.num_groups)
                alone.append((chunk, executor.execute(chunk_step), None))
            except Exception as e:  # noqa: BLE001 -- this chunk's own failure
                alone.append((chunk, None, e))
        if len(alone) > 1 and all(err is not None for _, _, err in alone):
            raise                                    # every chunk fails alone: not attributable
        kept, parts = [], []
        for chunk, logits, err in alone:
            if err is not None:
                fail(chunk.request, err, "the model forward")
            elif logits is not None:
                kept.append(chunk)
                parts.append(logits)
        out.chunks = kept
        return torch.cat(parts) if parts else torch.empty(0)


def greedy_only(plan: StepPlan, sampler: Sampler) -> bool:
    """Whether every logits row of the planned step is the sampling row of a plain greedy
    request (`Sampler.plain_greedy`: no logprobs, processors, bans or grammar) and nothing
    else: no prompt-logprob rows, no draft rows, no row of a request not sampled. Such a step
    needs only each row's argmax (`StepInput.greedy`)."""
    assert plan.step is not None and plan.sampling is not None
    return (len(plan.step.logits_rows) == len(plan.sampling)
            and all(sampler.plain_greedy(r) for r in plan.sampling))


def sampling_requests(out: SchedulerOutput) -> list[Request]:
    """The requests that sample this step, in `sample`'s row order: those whose chunk
    completes, unless they finished since it was planned (async scheduling)."""
    return [c.request for c in out.chunks if c.completes and not c.request.status.finished]


@dataclass
class Draw:
    """A computed step's tokens, not yet applied to its requests (`apply`): drawing
    touches no request state but the seeded generators, so it may run on the forward
    thread (async scheduling) while the engine reads the requests."""
    # request id → its new tokens: one, or a speculative chunk's accepted drafts + one
    tokens: dict[str, list[int]] = field(default_factory=dict)
    logprobs: list[tuple[Request, dict[int, Logprob]]] = field(default_factory=list)
    prompt: list[tuple[Request, int, list[dict[int, Logprob]]]] = field(default_factory=list)
    errors: list[tuple[Request, Exception, str]] = field(default_factory=list)


def draw(out: SchedulerOutput, logits: torch.Tensor, sampler: Sampler,
         requests: list[Request] | None = None) -> Draw:
    """Tokens for the chunks that complete, and the prompt logprobs asked for; a request
    whose prompt logprobs or sampling fails is listed in `errors` and gets no token
    (`Sampler.isolated`). `requests`: those the sampler was prepared for
    (`sampling_requests` at the time); the rows of the others are skipped."""
    sampling = {id(r) for r in (sampling_requests(out) if requests is None else requests)}
    d = Draw()
    row, sample_rows, reqs, drafts = 0, [], [], []
    for chunk in out.chunks:
        req = chunk.request
        n = prompt_logprob_rows(chunk)
        if n:
            try:
                d.prompt.append((req, chunk.start, prompt_logprobs(req, chunk.start,
                                                                   logits[row:row + n])))
            except Exception as e:  # noqa: BLE001 -- this request's failure only
                d.errors.append((req, e, "computing prompt logprobs"))
            row += n
        if chunk.completes:
            if id(req) in sampling:
                sample_rows.append(row)
                reqs.append(req)
                drafts.append(chunk.drafts)
            row += 1 + len(chunk.drafts)
    if not reqs:
        return d
    if logits.dtype == torch.int64:       # a greedy step's token ids (StepInput.greedy)
        ids = logits.tolist()
        for req, row in zip(reqs, sample_rows):
            d.tokens[req.request_id] = [ids[row]]
        return d
    if any(drafts):
        return _draw_verified(d, logits, sampler, reqs, sample_rows, drafts)
    # a decode-only step samples every row: no copy (64 rows of a 201k vocabulary are 51 MB
    # of fresh memory, page faults included, per step)
    rows = logits if len(sample_rows) == logits.shape[0] else logits[sample_rows]
    with torch.inference_mode():          # the forward's logits are inference tensors
        result, errors = sampler.isolated(rows, reqs)
    d.errors += [(reqs[i], err, "sampling") for i, err in errors.items()]
    for i, (req, token, lp) in enumerate(zip(reqs, result.token_ids, result.logprobs)):
        if i in errors:
            continue
        if lp is not None:
            d.logprobs.append((req, lp))
        d.tokens[req.request_id] = [token]
    return d


def _draw_verified(d: Draw, logits: torch.Tensor, sampler: Sampler, reqs: list[Request],
                   rows: list[int], drafts: list[list[int]]) -> Draw:
    """`draw`'s tokens for a step with speculative chunks: each request's accepted drafts
    and the target's own token (`engine/spec_verify.py`), with a logprob entry per token."""
    with torch.inference_mode():
        v = verify(sampler, logits, reqs, rows, drafts)
    d.errors += [(reqs[i], err, "sampling") for i, err in v.errors.items()]
    for i, req in enumerate(reqs):
        if i in v.errors:
            continue
        d.logprobs += [(req, lp) for lp in v.logprobs[i] if lp is not None]
        d.tokens[req.request_id] = v.tokens[i]
    return d


def apply(d: Draw, fail: FailFn) -> dict[str, list[int]]:
    """A drawn step onto its requests: prompt and sampled logprobs recorded, failures
    failed; returns the sampled tokens by request id (`Scheduler.update` appends them)."""
    for req, start, entries in d.prompt:
        if start == 0:
            req.prompt_logprobs = [None]             # the first token has no logprob
        req.prompt_logprobs.extend(entries)
    for req, err, where in d.errors:
        fail(req, err, where)
    for req, lp in d.logprobs:
        req.output_logprobs.append(lp)
    return dict(d.tokens)


def sample(out: SchedulerOutput, logits: torch.Tensor, sampler: Sampler, fail: FailFn,
           requests: list[Request] | None = None) -> dict[str, list[int]]:
    """`draw` and `apply` in one: the synchronous step."""
    return apply(draw(out, logits, sampler, requests), fail)


def prompt_logprobs(req: Request, start: int, logits: torch.Tensor) -> list[dict[int, Logprob]]:
    """The prompt logprobs of positions [start, start + rows): each scores the next prompt
    token, with the request's top-N."""
    logp = torch.log_softmax(logits, dim=-1)
    return [top_logprobs(logp[j], req.prompt_token_ids[start + j + 1],
                         req.params.prompt_logprobs or 0) for j in range(logits.shape[0])]


def prompt_logprob_rows(chunk: ScheduledChunk) -> int:
    """Rows of this chunk whose logits score the next *prompt* token: positions
    p in [start, start + n) with p + 1 < prompt length."""
    req = chunk.request
    if req.params.prompt_logprobs is None:
        return 0
    return max(min(chunk.start + chunk.num_tokens, req.num_prompt_tokens - 1) - chunk.start, 0)
