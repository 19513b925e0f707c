"""Continuous batching with chunked prefill, prefix caching and preemption.

Owner of: the waiting and running queues and each request's status and
`num_computed_tokens`. The KV-cache manager owns the blocks.

One step (`schedule`), vLLM v1's unified rule — every request simply has
`num_computed_tokens` catching up with `num_tokens`:

  1. Running requests, oldest first, each get min(missing tokens, budget) tokens
     (one for a decode; a chunk for an unfinished prefill). When the pool has no
     blocks for one, the *newest* running request is preempted (blocks freed, back
     to the front of the waiting queue, recomputed later) until it fits.
  2. If nothing was preempted, waiting requests are admitted in order while the
     token budget and `max_num_seqs` allow; each starts from its prefix-cache hit.
     With `chunked_prefill` off (the offline `LLM`'s default) a prompt that does not
     fit in what is left of the budget waits for the next step instead of starting
     with a partial chunk, unless it could not fit whole in any step: every prompt
     chunk then starts at position 0, which attention computes over the chunk's own
     keys (the fresh-prefill kernel) instead of gathering a cached prefix.

`update` then advances the computed counts, registers full blocks in the prefix
cache, appends sampled tokens, checks stop conditions and frees finished requests.

Async scheduling (`schedule(ahead=...)`, engine/async_steps.py): step N+1 is planned
while step N is still computing, so its requests are seen as they will be once N
lands — computed through N's chunks, with one more (not yet known) token where N
samples one. Such a `pending` chunk is a decode whose input token the engine fills in
when N's token is sampled. A request whose N token certainly ends it (max_tokens,
max_model_len) is left out; one that N may end (EOS, stop ids, stop strings, a
grammar) is planned anyway and its N+1 token dropped. Nothing in flight is preempted:
a request without room waits for a plan made after its step has landed.

Speculative decoding (`drafter`): a running decode also gets draft tokens
(`engine/scheduler_output.py` draws a speculative chunk).
"""
from __future__ import annotations

import logging
from collections import deque

from kvrelay.engine.request import Request, Status
from kvrelay.engine.scheduler_output import (
    Drafter,
    KVLoad,
    ScheduledChunk,
    SchedulerConfig,
    SchedulerOutput,
    chunk_order,
)
from kvrelay.engine.stop_rules import check_stop, draft_room, ends_with_next_token
from kvrelay.kv_cache.manager import KVCacheManager

logger = logging.getLogger(__name__)


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager,
                 drafter: Drafter | None = None) -> None:
        self.config, self.kv, self.drafter = config, kv, drafter
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.loading: dict[str, Request] = {}        # decode: pulling remote KV
        self.held: dict[str, Request] = {}           # prefill: finished, blocks kept for a decode
        self._arrivals = 0
        self.num_preemptions = 0

    # -- admission / abort --------------------------------------------------------------
    def add(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"duplicate request id {request.request_id!r}")
        if request.num_prompt_tokens == 0:
            raise ValueError("the prompt is empty")
        if request.num_prompt_tokens >= self.config.max_model_len:
            raise ValueError(
                f"the prompt has {request.num_prompt_tokens} tokens; with max_model_len "
                f"{self.config.max_model_len} at most {self.config.max_model_len - 1} prompt "
                "tokens leave room for one generated token")
        request.arrival = self._arrivals
        self._arrivals += 1
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def abort(self, request_id: str) -> Request | None:
        """Finish the request now and free its blocks; unknown ids are ignored."""
        request = self.requests.get(request_id)
        if request is None:
            return None
        self._finish(request, Status.FINISHED_ABORTED)
        return request

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.loading)

    # -- one step -------------------------------------------------------------------------
    def schedule(self, ahead: SchedulerOutput | None = None) -> SchedulerOutput:
        """The next step; `ahead`: the step still computing (async scheduling), whose
        chunks count as done (module docstring)."""
        if ahead is not None:
            return self._schedule_ahead({c.request.request_id: c for c in ahead.chunks})
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            chunk = self._speculative(req, n, budget)
            if chunk is not None:
                out.chunks.append(chunk)
                budget -= chunk.num_tokens
                i += 1
            elif self._allocate_or_preempt(req, n, out):
                out.chunks.append(ScheduledChunk(req, req.num_computed_tokens, n))
                budget -= n
                i += 1
        if not out.preempted:
            budget = self._admit_waiting(out, budget)
        return self._ordered(out)

    def _schedule_ahead(self, ahead: dict[str, ScheduledChunk]) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        short = False                                 # a running request found no blocks
        for req in self.running:
            if budget <= 0:
                break
            prev = ahead.get(req.request_id)
            computed, tokens, pending = req.num_computed_tokens, req.num_tokens, False
            if prev is not None:
                computed = prev.start + prev.num_tokens
                if prev.completes:
                    if ends_with_next_token(req, self.config.max_model_len):
                        continue                      # its token in flight is its last
                    tokens, pending = tokens + 1, True
            n = min(tokens - computed, budget)
            if n <= 0:
                continue
            if not self.kv.allocate(req.request_id, computed, computed + n):
                short = True                          # no preemption while steps fly
                continue
            out.chunks.append(ScheduledChunk(req, computed, n, pending))
            budget -= n
        if not short:
            self._admit_waiting(out, budget)
        return self._ordered(out)

    def _speculative(self, req: Request, n: int, budget: int) -> ScheduledChunk | None:
        """A decode with the drafter's tokens, when it proposes any and their slots get
        blocks; None otherwise (the caller schedules a plain chunk)."""
        if self.drafter is None or n != 1:
            return None
        room = min(budget - 1, draft_room(req, self.config.max_model_len))
        drafts = self.drafter(req, room) if room > 0 else []
        start = req.num_computed_tokens
        if not drafts or not self.kv.allocate(req.request_id, start, start + 1 + len(drafts)):
            return None
        return ScheduledChunk(req, start, 1 + len(drafts), drafts=drafts)

    @staticmethod
    def _ordered(out: SchedulerOutput) -> SchedulerOutput:
        # decodes (one new token) first: the runner attends them as one batch; then the
        # chunks that continue a prefix, then those from position 0, which attention
        # computes over their own keys when they close the step (layers/attention.py)
        out.chunks.sort(key=chunk_order)
        return out

    def _allocate_or_preempt(self, req: Request, n: int, out: SchedulerOutput) -> bool:
        while not self.kv.allocate(req.request_id, req.num_computed_tokens,
                                   req.num_computed_tokens + n):
            victim = self.running.pop()                  # the newest running request
            self._preempt(victim)
            out.preempted.append(victim.request_id)
            if victim is req:
                return False
        return True

    def _admit_waiting(self, out: SchedulerOutput, budget: int) -> int:
        for req in list(self.waiting):
            if budget <= 0 or self._num_active >= self.config.max_num_seqs:
                break
            if req.waits_for_sibling:
                continue
            if req.remote_prefill:
                if not self._admit_remote(req, out):
                    break
                continue
            tokens = req.all_token_ids
            hit = None
            if req.params.prompt_logprobs is None:  # prompt logprobs need every position computed
                hit = self.kv.find_prefix_hit(req.request_id, tokens)
            start = hit.num_tokens if hit else 0
            if req.num_tokens - start > budget and self._waits_for_whole_step(req, start):
                break
            n = min(req.num_tokens - start, budget)
            if not self.kv.allocate(req.request_id, start, start + n, hit):
                break
            self.waiting.remove(req)
            req.status = Status.RUNNING
            req.num_computed_tokens = start
            if req.num_preemptions == 0:
                req.num_cached_tokens = start
            self.running.append(req)
            out.chunks.append(ScheduledChunk(req, start, n))
            budget -= n
        return budget

    def _waits_for_whole_step(self, req: Request, start: int) -> bool:
        """Without chunked prefill: whether `req` (not fitting in this step's budget)
        waits for a later step that can take its prompt whole. The running requests take
        at least one token each of that step first; a prompt longer than what remains is
        chunked anyway (it would never fit)."""
        if self.config.chunked_prefill:
            return False
        return req.num_tokens - start <= self.config.max_num_batched_tokens - len(self.running)

    @property
    def _num_active(self) -> int:
        return len(self.running) + len(self.loading)

    def _admit_remote(self, req: Request, out: SchedulerOutput) -> bool:
        """Decode side: allocate the whole prompt (its own prefix hits first) and ask the
        connector to pull the rest; the last prompt token is recomputed afterwards."""
        P = req.num_prompt_tokens
        hit = self.kv.find_prefix_hit(req.request_id, req.all_token_ids)
        if not self.kv.allocate(req.request_id, P - 1, P, hit):
            return False
        self.waiting.remove(req)
        req.status = Status.WAITING_FOR_REMOTE_KV
        req.num_computed_tokens = hit.num_tokens
        req.num_cached_tokens = hit.num_tokens
        self.loading[req.request_id] = req
        out.loads.append(KVLoad(req, hit.num_tokens))
        return True

    def finish_load(self, request_id: str, error: str | None, recompute: bool) -> None:
        """A remote KV load ended: the request runs from its last prompt token, or (on
        failure) recomputes its prompt locally or fails, per the failure policy."""
        req = self.loading.pop(request_id, None)
        if req is None:
            return                                      # aborted meanwhile
        if error is None:
            req.num_computed_tokens = req.num_prompt_tokens - 1
            self.kv.cache_blocks(req.request_id, req.all_token_ids, req.num_computed_tokens)
            req.status = Status.RUNNING
            self.running.append(req)
            return
        if recompute:
            logger.warning("KV load for %s failed (%s); recomputing the prompt locally", request_id,
                           error)
            self.kv.free(request_id)
            req.kv_transfer = None
            req.num_computed_tokens = 0
            req.status = Status.WAITING
            self.waiting.appendleft(req)
            return
        logger.warning("KV load for %s failed (%s); the request fails (policy \"fail\")",
                       request_id, error)
        req.error = f"KV transfer from the prefill server failed: {error}"
        self._finish(req, Status.FINISHED_ABORTED)

    def release_held(self, request_id: str) -> bool:
        """Prefill side: free the blocks kept for a remote decode (read done, explicit
        free, or lease expired). Returns whether anything was held."""
        if self.held.pop(request_id, None) is None:
            return False
        self.kv.free(request_id)
        return True

    def _preempt(self, req: Request) -> None:
        self.kv.free(req.request_id)
        if req.remote_prefill:
            req.kv_transfer = None                       # its pulled KV is gone: recompute locally
        req.status = Status.WAITING
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)
        logger.debug("preempted %s (recomputed later)", req.request_id)

    # -- after the step -------------------------------------------------------------------
    def update(self, out: SchedulerOutput, sampled: dict[str, list[int]]) -> list[Request]:
        """Advance the scheduled requests; `sampled[req_id]` holds the tokens sampled for
        each request whose chunk completed (one, or a speculative chunk's accepted drafts
        and the target's token). Returns the requests that finished."""
        finished = []
        for chunk in out.chunks:
            req = chunk.request
            if req.status is not Status.RUNNING:
                continue                                 # aborted during the step
            tokens = sampled.get(req.request_id, []) if chunk.completes else []
            status = self._advance(req, chunk, tokens)
            if status is not None:
                self._finish(req, status)
                finished.append(req)
        return finished

    def _advance(self, req: Request, chunk: ScheduledChunk, tokens: list[int]) -> Status | None:
        """The chunk's computed positions and its new tokens onto `req`, one token at a
        time: the first that stops it ends it and the tokens after it are dropped (with
        their logprobs). Returns the status it stopped with, if any. Full blocks are
        cached before a finished request frees them, so its prefix stays reusable."""
        accepted = len(tokens) - 1 if chunk.drafts and tokens else 0
        computed = req.num_computed_tokens + chunk.num_tokens - len(chunk.drafts) + accepted
        status = None
        for token in tokens:
            req.append_token(token)
            status = check_stop(req, token, self.config.max_model_len)
            if status is not None:
                break
        del req.output_logprobs[len(req.output_token_ids):]
        # a stop inside the accepted drafts leaves fewer tokens than were computed
        req.num_computed_tokens = min(computed, req.num_tokens)
        self.kv.cache_blocks(req.request_id, req.all_token_ids, req.num_computed_tokens)
        if chunk.drafts and status is None:
            self.kv.shrink(req.request_id, req.num_tokens)   # the rejected drafts' blocks
        return status

    def finish_stopped(self, req: Request, stop_reason: str, keep: int | None = None) -> None:
        """Finish a request on a stop string (detected on detokenised text). `keep`: its
        output tokens through the one that completed the stop. A step that appended
        several (speculative decoding) drops those after it; if one of them had finished
        the request (length, EOS), it finishes on the stop string instead."""
        if req.status is Status.FINISHED_ABORTED:
            return
        if keep is not None:
            req.truncate_output(keep)
        req.stop_reason = stop_reason
        if req.status.finished:
            req.status = Status.FINISHED_STOPPED         # its blocks were released then
            return
        self._finish(req, Status.FINISHED_STOPPED)

    def _finish(self, req: Request, status: Status) -> None:
        req.status = status
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self.loading.pop(req.request_id, None)
        self.requests.pop(req.request_id, None)
        if req.remote_decode and status is not Status.FINISHED_ABORTED:
            self.held[req.request_id] = req              # the decode server will read these blocks
            return
        self.kv.free(req.request_id)
