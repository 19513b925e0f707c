"""Draft-model proposals (`--speculative-config '{"model": PATH, ...}'`, vLLM's
"draft_model" method): a small model sharing the target's tokenizer guesses each decode's
next K tokens, which the target verifies in one forward (engine/spec_verify.py).

The draft proposes greedily — its argmax, never a sample. A greedy draft is a point mass
(it proposes d with probability 1), the case spec_verify.py's rejection rule ("draw x ~ p,
accept iff x == d") is exact for: sampled requests keep the target's law, with no draft
probabilities needed, and greedy ones get the target's own tokens.

The draft keeps its own KV cache: its own runner (weights, KV tensors) and its own
KV-cache manager (blocks per request, no prefix caching), sized by the target's rule
(`EngineConfig.num_blocks`). Per request it knows how many of the request's tokens its
cache holds (`known`); everything from there to the end is fed again. One step
(`prepare`, before the scheduler asks for each decode's drafts), for all the step's
decodes together, K forwards of the draft:

    request tokens   0 … known-1 │ known … L-1        L: the request's tokens (t = token L-1)
    forward 1        catch-up chunk [known, L)  → argmax of its last row: d1
    forward j ≤ K    one row each: d(j-1) at position L + j - 2        → d(j)

    cache after      positions [0, L) real; L … L+K-2 hold d1 … d(K-1) (fed, unconfirmed)

The catch-up chunks of a step share the target's token budget (`max_num_batched_tokens`),
so a long prompt is caught up over several steps, as the target's own chunked prefill
(that request gets no drafts until its catch-up ends).

Rollback is bookkeeping, not a write: next step the fed drafts the target accepted (the
request's tokens at L, L+1, … equal to them) count as known; the others' slots are simply
written again by the next catch-up chunk (attention reads no slot past a row's context).
The first catch-up of a request is its whole prompt (after a prefix-cache hit or a remote
prefill too: the draft's cache is its own); later ones are the last step's target token and
any accepted draft whose K/V the draft had not written (dK).

Requests that do not speculate are those the n-gram proposer skips (a grammar, a prefill
server's remote decode), and any whose draft blocks do not fit (no drafts this step). A
failed draft forward costs the step its drafts, never a request.
"""
from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from kvrelay.config import EngineConfig
from kvrelay.engine.executor import TORCH_DTYPES, kv_groups, warmup_steps
from kvrelay.engine.request import Request, Status
from kvrelay.engine.runner import ModelRunner, StepInput, kv_bytes_per_block
from kvrelay.engine.sampler import greedy_tokens
from kvrelay.engine.stop_rules import draft_room
from kvrelay.kv_cache.manager import KVCacheManager
from kvrelay.model.loader import load_model
from kvrelay.spec_decode.config import SpeculativeConfig
from kvrelay.spec_decode.ngram import NgramProposer

logger = logging.getLogger(__name__)


@dataclass
class DraftJob:
    """One request's share of a step: `take` catch-up tokens, then `k` drafts (0: still
    catching up after this step)."""
    state: DraftState
    take: int
    k: int

    def order(self, rows: int) -> int:
        """The target's chunk order (engine/scheduler_output.chunk_order): decode rows
        first (a catch-up of at most `rows` tokens), then chunks continuing a prefix, those
        from position 0 last (attention computes them over their own keys when they close
        the step)."""
        return 0 if self.take <= rows else 1 if self.state.known else 2


@dataclass
class DraftState:
    """One request as the draft sees it."""
    request: Request
    known: int = 0                                  # tokens [0, known) in the draft's cache
    fed: list[int] = field(default_factory=list)    # drafts fed at known, known + 1, …

    def confirm(self) -> None:
        """The fed drafts the request now has (accepted) become known."""
        tokens = self.request.all_token_ids
        n = 0
        while n < len(self.fed) and self.known + n < len(tokens) \
                and tokens[self.known + n] == self.fed[n]:
            n += 1
        self.known += n
        self.fed = []


class DraftProposer:
    """Drafts for the scheduler. Owner of: the draft model's runner, its KV-cache manager
    and each request's `DraftState` (freed when the request finishes: `release_finished`)."""

    def __init__(self, config: SpeculativeConfig, runner: ModelRunner, kv: KVCacheManager,
                 max_model_len: int, max_num_batched_tokens: int) -> None:
        self.config, self.runner, self.kv = config, runner, kv
        self.max_model_len, self.max_num_batched_tokens = max_model_len, max_num_batched_tokens
        self.states: dict[str, DraftState] = {}
        self._drafts: dict[str, list[int]] = {}     # this step's, by request id

    @classmethod
    def load(cls, config: EngineConfig, device: torch.device) -> DraftProposer:
        """The draft checkpoint loaded with the target's dtype on the target's device, its
        runner and KV cache built, and warmed up as the target is."""
        spec, a = config.speculative, config.args
        assert spec is not None and spec.model is not None
        loaded = load_model(spec.model, dtype=TORCH_DTYPES[config.dtype], device=device,
                            hybrid_kv_cache=not a.disable_hybrid_kv_cache_manager,
                            max_positions=config.max_model_len, progress=False)
        model = loaded.model
        num_blocks = config.num_blocks(kv_bytes_per_block(model, a.block_size))
        runner = ModelRunner(model, num_blocks, a.block_size, device)
        kv = KVCacheManager(num_blocks, a.block_size, kv_groups(model),
                            enable_prefix_caching=False)
        for step in warmup_steps(runner.num_groups, a.block_size):
            runner.execute(step)
        return cls(spec, runner, kv, config.max_model_len, config.max_num_batched_tokens)

    # -- the scheduler's side -----------------------------------------------------------
    def propose(self, req: Request, room: int) -> list[int]:
        """At most `room` of the drafts `prepare` made for `req` this step."""
        return self._drafts.get(req.request_id, [])[:max(room, 0)]

    def prepare(self, running: Sequence[Request]) -> None:
        """This step's drafts for every running decode, in K batched forwards (module
        docstring)."""
        self.release_finished()
        self._drafts = {}
        jobs = self._jobs(running)
        if not jobs:
            return
        try:
            drafts = self._run(jobs)
        except Exception as e:  # noqa: BLE001 -- drafts are optional; the step goes on without
            logger.warning("a draft forward failed (%s: %s); this step runs without drafts",
                           type(e).__name__, e)
            for job in jobs:
                job.state.fed = []
            return
        self._drafts = {j.state.request.request_id: d for j, d in zip(jobs, drafts) if d}

    def _jobs(self, running: Sequence[Request]) -> list[DraftJob]:
        """The step's catch-ups (within the token budget) and drafts, blocks allocated:
        positions [known, known + take + k - 1) — the catch-up and the drafts fed back."""
        jobs, budget = [], self.max_num_batched_tokens
        for req in running:
            k = self._want(req)
            if k <= 0 or budget <= 0:
                continue
            state = self._state(req)
            missing = req.num_tokens - state.known
            take = min(missing, budget)
            k = k if take == missing else 0
            if self.kv.allocate(req.request_id, state.known, state.known + take + max(k - 1, 0)):
                jobs.append(DraftJob(state, take, k))
                budget -= take
        return jobs

    def _want(self, req: Request) -> int:
        """How many drafts `req` gets this step (0: none — not a decode, or it does not
        speculate)."""
        if (req.status is not Status.RUNNING or req.grammar is not None or req.remote_decode
                or req.num_tokens - req.num_computed_tokens != 1):
            return 0
        return min(self.config.num_speculative_tokens, draft_room(req, self.max_model_len))

    def _state(self, req: Request) -> DraftState:
        state = self.states.get(req.request_id)
        if state is None or state.request is not req:
            self.kv.free(req.request_id)
            state = self.states[req.request_id] = DraftState(req)
        state.confirm()
        # the request's last token is always fed again (its row gives d1); never more is
        # known unless its tokens were cut (not while it runs)
        state.known = min(state.known, req.num_tokens - 1)
        return state

    # -- the forwards -------------------------------------------------------------------
    def _run(self, jobs: list[DraftJob]) -> list[list[int]]:
        """K forwards: the catch-up chunks, then one row per request still drafting."""
        firsts = self._catch_up(jobs)
        drafts: list[list[int]] = [[t] if job.k else [] for job, t in zip(jobs, firsts)]
        for j in range(1, max(job.k for job in jobs)):
            live = [i for i, job in enumerate(jobs) if job.k > j]
            tokens = self._decode([jobs[i].state for i in live], [drafts[i][-1] for i in live])
            for i, t in zip(live, tokens):
                jobs[i].state.fed.append(drafts[i][-1])
                drafts[i].append(t)
        return drafts

    def _catch_up(self, jobs: list[DraftJob]) -> list[int]:
        """Each job's catch-up, tokens [known, known + take), in the target's chunk order;
        the greedy token after each (d1 where the catch-up is complete).

        A short catch-up (at most K + 1 tokens: what a step leaves after the prompt) enters
        as decode rows, one per token, sharing the request's block table — the target's
        layout for a speculative chunk (engine/step_io.py): the paged decode path, every
        row's K/V written before any row attends. A step of catch-ups that short is then a
        decode-only step (the runner's fast path; as a chunk, measured ~6x slower):

            known p, tokens a b:   rows (token, position, context)   (a, p, p+1)
                                                                      (b, p+1, p+2)
        """
        short = self.config.num_speculative_tokens + 1
        order = sorted(range(len(jobs)), key=lambda i: jobs[i].order(short))
        step = StepInput([], [], [], [[] for _ in range(self.runner.num_groups)], [], greedy=True)
        for i in order:
            state, take = jobs[i].state, jobs[i].take
            ids = state.request.all_token_ids[state.known:state.known + take]
            tables = self.kv.block_ids(state.request.request_id)
            split = take <= short
            n_rows = take if split else 1
            step.token_ids.extend(ids)
            step.query_lens.extend([1] * take if split else [take])
            step.starts.extend(range(state.known, state.known + take) if split else [state.known])
            for g, ids_g in enumerate(tables):
                step.block_tables[g].extend([ids_g] * n_rows)
            step.logits_rows.append(len(step.token_ids) - 1)
            step.num_decodes += take if split else 0
        picked = self._greedy(step)
        out = [0] * len(jobs)
        for at, i in enumerate(order):
            out[i] = picked[at]
            jobs[i].state.known += jobs[i].take
        return out

    def _decode(self, states: list[DraftState], tokens: list[int]) -> list[int]:
        """One decode row per request: `tokens[i]` at its next unwritten position."""
        starts = [s.known + len(s.fed) for s in states]
        step = StepInput(tokens, [1] * len(states), starts, self._tables(states),
                         list(range(len(states))), len(states), greedy=True)
        return self._greedy(step)

    def _tables(self, states: list[DraftState]) -> list[list[list[int]]]:
        """[group][request] → the request's draft block ids."""
        tables: list[list[list[int]]] = [[] for _ in range(self.runner.num_groups)]
        for s in states:
            for g, ids in enumerate(self.kv.block_ids(s.request.request_id)):
                tables[g].append(ids)
        return tables

    def _greedy(self, step: StepInput) -> list[int]:
        out = self.runner.execute(step)      # ids [rows] where the LM head gives them, else logits
        return out.tolist() if out.dim() == 1 else greedy_tokens(out)

    # -- requests ending ----------------------------------------------------------------
    def release_finished(self) -> None:
        """Free the draft blocks of every request that finished (stopped, aborted, failed)."""
        for rid in [rid for rid, s in self.states.items() if s.request.status.finished]:
            del self.states[rid]
            self._drafts.pop(rid, None)
            self.kv.free(rid)

    def assert_no_leaks(self) -> None:
        """Idle: no draft state and no draft block is held."""
        if self.states:
            raise AssertionError(f"draft states leaked: {sorted(self.states)}")
        self.kv.assert_no_leaks()


def make_proposer(config: EngineConfig, device: torch.device,
                  ) -> tuple[DraftProposer | None, DraftProposer | NgramProposer | None]:
    """(the draft model's proposer or None, the proposer the scheduler asks) for
    `config.speculative`: a draft model, n-gram lookups, or nothing."""
    spec = config.speculative
    if spec is None:
        return None, None
    if spec.method == "draft_model":
        draft = DraftProposer.load(config, device)
        return draft, draft
    return None, NgramProposer(spec)


def describe_proposer(spec: SpeculativeConfig, draft: DraftProposer | None) -> str:
    """The start-up log line naming how drafts are made."""
    if draft is not None:
        return (f"speculative decoding: greedy drafts of up to {spec.num_speculative_tokens} "
                f"tokens from the draft model {spec.model} (its own KV cache: "
                f"{draft.kv.pool.num_blocks} blocks)")
    return (f"speculative decoding: n-gram drafts of up to {spec.num_speculative_tokens} tokens "
            f"(lookup {spec.prompt_lookup_min}..{spec.prompt_lookup_max} tokens)")
