"""The engine: scheduler → runner → sampler, one step at a time (in-process).

Owner of: the wiring of one engine and the order of a step. Each concern has its
own owner, built here from the `EngineConfig`:

    executor.py          where the model runs (UniprocExecutor / MultiprocExecutor)
    scheduler.py         requests, queues, preemption (owns the KV-cache manager)
    step_io.py           chunks → StepInput; logits → prompt logprobs, sampled tokens
    sampler.py           tokens from logits rows
    output_processor.py  client requests: n > 1 fan-out, detokenising, deltas, outputs
    kv_transfer.py       disaggregation: the KV connector and its checks
    kv_events/           --kv-events-config: the prefix cache's changes, published once
                         per step (a thread in this process; never blocks the step)
    spec_decode/         --speculative-config: drafts (n-gram, or draft_proposer.py's draft
                         model) added to decodes, verified in the sampling (spec_verify)

    add_request ─▶ fan_out ─▶ Scheduler.waiting
    step() = run_planned(plan_step()):
        plan_step:    KV polls ─▶ Scheduler.schedule() ─▶ KV loads ─▶ StepInput
        run_planned:  executor.execute() ─▶ logits ─▶ sample ─▶ Scheduler.update()
                      ─▶ OutputProcessor.outputs() ─▶ RequestOutput
    (with --async-scheduling, async_steps.py runs the same parts pipelined: the next
    step is planned while this one computes on a forward thread)
    (with experts across data-parallel replicas, engine/lockstep.py calls the two
    halves itself, exchanging token counts in between)

Failure isolation (one request must not take the engine down): `failures.py`.
"""
from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from kvrelay.config import EngineArgs, EngineConfig
from kvrelay.engine import step_io
from kvrelay.engine.async_steps import AsyncSteps
from kvrelay.engine.draft_proposer import describe_proposer, make_proposer
from kvrelay.engine.executor import dummy_step, kv_groups, make_executor, resolve_device, warmup
from kvrelay.engine.failures import RequestFailures
from kvrelay.engine.intake import check_request, load_processor_factory
from kvrelay.engine.kv_transfer import KVTransferGlue
from kvrelay.engine.output_processor import OutputProcessor, ParentRequest, fan_out
from kvrelay.engine.outputs import RequestOutput
from kvrelay.engine.request import Request
from kvrelay.engine.runner import StepInput, kv_bytes_per_block
from kvrelay.engine.sampler import Sampler
from kvrelay.engine.scheduler import Scheduler, SchedulerConfig
from kvrelay.engine.step_io import StepPlan
from kvrelay.kv_cache.manager import KVCacheManager
from kvrelay.kv_cache.spec import KVCacheSpec
from kvrelay.kv_events.publisher import make_publisher
from kvrelay.kv_events.wire import GroupSpec
from kvrelay.model.tokenizer import CheckpointTokenizer, load_tokenizer
from kvrelay.sampling_params import SamplingParams
from kvrelay.spec_decode.stats import SpecDecodeStats
from kvrelay.structured.manager import StructuredOutputs

logger = logging.getLogger(__name__)


class LLMEngine:
    def __init__(self, args: EngineArgs | EngineConfig) -> None:
        config = args if isinstance(args, EngineConfig) else EngineConfig.from_args(args)
        self.config, self.args = config, config.args
        self.device = resolve_device(self.args.device)
        self.model_dir = config.model_dir
        self.tokenizer: CheckpointTokenizer | None = _maybe_tokenizer(self.model_dir)
        self.executor = make_executor(config, self.device)
        self.model, self.model_config = self.executor.model, self.executor.config
        self.max_model_len = config.max_model_len
        num_blocks = config.num_blocks(kv_bytes_per_block(self.model, self.args.block_size))
        groups = kv_groups(self.model)
        # --kv-events-config: bound (or connected) now, so a busy port fails the start-up
        self.kv_events = make_publisher(config.kv_events, self.args.block_size,
                                        [GroupSpec.of_window(g.window) for g in groups],
                                        self.args.data_parallel_rank)
        self.kv = KVCacheManager(num_blocks, self.args.block_size, groups,
                                 enable_prefix_caching=self.args.enable_prefix_caching,
                                 hash_seed=f"{self.model_dir.name}:{self.args.block_size}",
                                 enable_kv_cache_events=self.kv_events is not None)
        self.runner = self.executor.start_runner(num_blocks)
        spec = config.speculative
        # --speculative-config: the scheduler asks the proposer for each decode's drafts;
        # a draft model's are made for all decodes at once before each schedule (plan_step)
        self.draft, self.proposer = make_proposer(config, self.device)
        self.spec_stats = (SpecDecodeStats(accepted_per_pos=[0] * spec.num_speculative_tokens)
                           if spec is not None else None)
        self.scheduler = Scheduler(SchedulerConfig(config.max_num_batched_tokens,
                                                   self.args.max_num_seqs, self.max_model_len),
                                   self.kv, self.proposer.propose if self.proposer else None)
        self.transfer = KVTransferGlue(config.kv_transfer, self.scheduler, self.kv,
                                       self.args.block_size)
        self.sampler = Sampler(all_greedy=config.neuron.all_greedy)
        self.eos_token_ids = ((self.tokenizer.eos_token_ids if self.tokenizer else ())
                              or self.model_config.eos_token_id)
        self.structured = StructuredOutputs(self.tokenizer, self.model_config.vocab_size,
                                            self.eos_token_ids)
        self.processor_factories = [load_processor_factory(name)
                                    for name in self.args.logits_processors]
        self.output = OutputProcessor(self.tokenizer, self.scheduler, self._fail_request,
                                      self.transfer.hold)
        self.failures = RequestFailures(self.output, self.scheduler, self.transfer, self.kv,
                                        self.abort_request)
        self.num_steps = self.num_dummy_steps = 0
        # the last step ran no forward: every unfinished request waits (for its remote KV,
        # a grammar, blocks): the core loop then waits a little instead of spinning
        self.last_step_idle = False
        warmup(self.executor, self.runner.num_groups, config)
        self.transfer.start(self.kv_cache_spec(), self.runner.kv_tensors,
                            self.args.tensor_parallel_size, self.executor.link,
                            self.args.data_parallel_rank)
        # --async-scheduling: the next step is planned while this one computes
        self.pipeline = AsyncSteps(self) if self.args.async_scheduling else None
        self._log_inputs()
        # --seed: unseeded sampling draws from torch's global generator (as vLLM seeds it),
        # so a server started with the same seed answers the same requests alike
        torch.manual_seed(self.args.seed)

    # -- what the engine-core process and tests read ------------------------------------------
    @property
    def expert_world(self) -> Any:
        """Experts across data-parallel replicas: steps run in lockstep (None otherwise)."""
        return self.executor.expert_world

    @property
    def connector(self) -> Any:
        return self.transfer.connector

    @property
    def parents(self) -> dict[str, ParentRequest]:
        return self.output.parents

    @property
    def child_parent(self) -> dict[str, ParentRequest]:
        return self.output.child_parent

    # -- setup helpers --------------------------------------------------------------------
    def _log_inputs(self) -> None:
        neuron = self.config.neuron
        if self.pipeline is not None:
            logger.info("async scheduling: each step is planned while the previous one "
                        "computes (on a CPU it measured no faster: docs/serving.md)")
        if neuron.num_batched_tokens_buckets or neuron.num_seqs_buckets:
            logger.info("neuron_config buckets validated; not needed on %s (eager, no captured "
                        "graphs): steps are not padded", self.device.type)
        for note in self.config.ignored_inputs(self.device.type):
            logger.warning("%s", note)
        if self.config.speculative is not None:
            logger.info("%s", describe_proposer(self.config.speculative, self.draft))
        if self.kv_events is not None and not self.args.enable_prefix_caching:
            logger.warning("--kv-events-config: prefix caching is off "
                           "(--no-enable-prefix-caching), so no block is ever cached and no "
                           "KV cache event is published")

    def kv_cache_spec(self) -> KVCacheSpec:
        c = self.model_config
        raw = json.dumps(c.raw, sort_keys=True, default=str).encode()
        fingerprint = hashlib.sha256(raw).hexdigest()[:16]
        return KVCacheSpec(f"{self.model_dir.name}:{fingerprint}",
                           str(self.model.dtype).removeprefix("torch."), self.args.block_size,
                           c.num_hidden_layers, c.num_key_value_heads, c.head_dim,
                           hybrid=len(self.kv.groups) > 1, sliding_window=c.sliding_window,
                           numerics=self.model.plan.numerics(str(self.model.dtype)))

    def shutdown(self) -> None:
        if self.pipeline is not None:
            self.pipeline.shutdown()
        self.sampler.masks.close()
        self.transfer.close()
        if self.kv_events is not None:
            self.publish_kv_events()
            self.kv_events.shutdown()
        self.executor.shutdown()

    # -- KV cache events --------------------------------------------------------------------
    def publish_kv_events(self) -> None:
        """Hand the prefix cache's changes since the last call to the publisher (one batch;
        none when nothing changed). Called after every step and after a reset."""
        if self.kv_events is not None:
            events = self.kv.take_events()
            if events:
                self.kv_events.publish(events)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix (vLLM's reset_prefix_cache): False, changing nothing,
        while any request holds KV blocks. Subscribers get AllBlocksCleared."""
        reset = self.kv.reset_prefix_cache()
        self.publish_kv_events()
        return reset

    # -- requests -------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                    kv_transfer_params: dict | None = None) -> None:
        if request_id in self.parents:
            raise ValueError(f"duplicate request id {request_id!r}")
        text, ids = ((prompt, self._encode(prompt)) if isinstance(prompt, str)
                     else (None, list(prompt)))
        check_request(params, ids, self.model_config.vocab_size, self.args.max_logprobs,
                      self.max_model_len)
        transfer = self.transfer.check(kv_transfer_params, ids)
        grammar = self.structured.matcher(params)       # ValueError: a bad schema / regex
        made = [p for p in (f(params, ids) for f in self.processor_factories) if p is not None]
        if made:
            params = replace(params, logits_processors=list(params.logits_processors) + made)
        children = fan_out(request_id, ids, params, self.eos_token_ids, transfer, grammar)
        for child in children:
            # a finished prefill request holding blocks for a decode still owns its id
            if self._id_in_use(child.request_id):
                raise ValueError(f"duplicate request id {child.request_id!r} (still running or "
                                 f"holding KV blocks)")
        self.output.admit(ParentRequest(request_id, text, children))

    def _id_in_use(self, request_id: str) -> bool:
        s = self.scheduler
        return request_id in s.requests or request_id in s.held or request_id in self.child_parent

    def free_remote(self, request_id: str, capability: str | None) -> bool:
        """Prefill side: an explicit free from the proxy (`KVTransferGlue.free_remote`)."""
        return self.transfer.free_remote(request_id, capability)

    def _encode(self, text: str) -> list[int]:
        if self.tokenizer is None:
            raise ValueError("this checkpoint has no tokenizer.json; pass token ids")
        return self.tokenizer.encode(text)

    def abort_request(self, request_id: str) -> None:
        parent = self.output.pop(request_id)
        for child in parent.children if parent else []:
            self.scheduler.abort(child.request_id)
            self.transfer.cancel(child)
        if self.draft is not None:
            self.draft.release_finished()

    def has_unfinished_requests(self) -> bool:
        """Requests to run, or (async scheduling) a step whose outputs are still to come."""
        return self.scheduler.has_unfinished or (self.pipeline is not None and self.pipeline.busy)

    @property
    def transfer_busy(self) -> bool:
        """KV loads in flight or blocks held for decode servers (needs periodic polling)."""
        return self.transfer.busy

    # -- the step ---------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        if self.pipeline is not None:
            outputs = self.pipeline.step()  # outputs of the step that landed (async_steps.py)
            self.publish_kv_events()
            return outputs
        return self.run_planned(self.plan_step())

    def plan_step(self, ahead: StepPlan | None = None) -> StepPlan:
        """The first half of a step: KV polls, schedule, KV loads, the model's input.
        `ahead`: the step still computing (async scheduling, `Scheduler.schedule`)."""
        failed = self.transfer.poll()
        if self.draft is not None and ahead is None:
            self.draft.prepare(self.scheduler.running)    # every decode's drafts, batched
        out = self.scheduler.schedule(ahead.out if ahead is not None else None)
        failed += self.transfer.start_loads(out)
        step = None if out.is_empty else step_io.step_input(out, self.kv, self.runner.num_groups)
        return StepPlan(out, step, failed, self.transfer.take_work())

    def prepare_sampling(self, plan: StepPlan) -> None:
        """Before (or while) a step computes: which requests it samples, and their grammar
        masks started (they fill during the forward)."""
        plan.sampling = step_io.sampling_requests(plan.out)
        self.sampler.prepare(plan.sampling)

    def run_planned(self, plan: StepPlan,
                    dp_token_counts: tuple[int, ...] | None = None) -> list[RequestOutput]:
        """The second half: forward, sample, update, outputs. In lockstep
        (`dp_token_counts`: every replica's tokens this step) every replica runs a forward
        when any has tokens — this one a dummy token (output discarded) if it has none —
        so the MoE collectives line up."""
        self.last_step_idle = plan.step is None and not plan.failed
        if plan.step is None and not (dp_token_counts and max(dp_token_counts)):
            if plan.kv_work is not None:
                self.executor.send_kv(plan.kv_work)      # no step follows to carry it
            self.publish_kv_events()                      # a finished KV load cached blocks
            return self.output.failed_outputs(plan.failed)
        step = plan.step or dummy_step(self.runner.num_groups)
        step.dp_token_counts = tuple(dp_token_counts) if dp_token_counts else None
        step.kv_work = plan.kv_work       # ranks ≥ 1 start their KV reads before computing
        self.prepare_sampling(plan)
        step.greedy = plan.step is not None and step_io.greedy_only(plan, self.sampler)
        logits = self.forward(plan, step)
        if plan.step is None:
            self.num_dummy_steps += 1
            self.publish_kv_events()
            return self.output.failed_outputs(plan.failed)
        outputs = self.finish_step(plan, self.sample(plan, logits))
        self.publish_kv_events()                          # the step's evictions and new blocks
        return outputs

    def forward(self, plan: StepPlan, step: StepInput) -> torch.Tensor:
        """The model forward of a step, failures attributed (`step_io.forward`)."""
        return step_io.forward(self.executor, plan.out, step, self.kv, self._fail_request)

    def sample(self, plan: StepPlan, logits: torch.Tensor) -> dict[str, list[int]]:
        """The tokens of a computed step, by request id."""
        return step_io.sample(plan.out, logits, self.sampler, self._fail_request, plan.sampling)

    def finish_step(self, plan: StepPlan, sampled: dict[str, list[int]]) -> list[RequestOutput]:
        """After sampling: the scheduler advances, and the outputs of the step."""
        self.update_step(plan, sampled)
        outputs = self.step_outputs(plan)
        if self.draft is not None:
            self.draft.release_finished()       # stop strings finish requests in step_outputs
        return outputs

    def update_step(self, plan: StepPlan, sampled: dict[str, list[int]]) -> None:
        self._count_drafts(plan, sampled)
        finished = self.scheduler.update(plan.out, sampled)
        self.num_steps += 1
        self.failures.fail_broken_grammars(finished)

    def _count_drafts(self, plan: StepPlan, sampled: dict[str, list[int]]) -> None:
        """The spec_decode metrics: each verified draft and how much of it was accepted
        (as verified: a stop inside the accepted tokens does not lower the count)."""
        if self.spec_stats is None:
            return
        for chunk in plan.out.chunks:
            tokens = sampled.get(chunk.request.request_id)
            if chunk.drafts and tokens:
                self.spec_stats.record(len(chunk.drafts), len(tokens) - 1)

    def step_outputs(self, plan: StepPlan) -> list[RequestOutput]:
        """Detokenizing (stop strings end requests here) and the step's outputs."""
        return (self.output.outputs(plan.out) + self.output.failed_outputs(plan.failed)
                + self.failures.take())

    def _fail_request(self, req: Request, error: BaseException, where: str,
                      message: str | None = None) -> None:
        """Fail the client request `req` belongs to (`RequestFailures.fail`)."""
        self.failures.fail(req, error, where, message)

    # -- introspection ----------------------------------------------------------------------
    def assert_no_leaks(self) -> None:
        self.kv.assert_no_leaks()
        if self.draft is not None:
            self.draft.assert_no_leaks()


def _maybe_tokenizer(model_dir: Path) -> CheckpointTokenizer | None:
    return load_tokenizer(model_dir) if (model_dir / "tokenizer.json").is_file() else None
