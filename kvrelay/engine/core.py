"""The engine: scheduler → runner → sampler, one step at a time (in-process).

Owner of: the model runner, the scheduler (which owns the KV-cache manager), the
tokenizer, and the fan-out of `n > 1` requests into child sequences.

    add_request ─▶ Scheduler.waiting
    step():  Scheduler.schedule() ─▶ StepInput ─▶ ModelRunner.execute() ─▶ logits
             Sampler ─▶ tokens ─▶ Scheduler.update() ─▶ stop strings ─▶ RequestOutput

Failure isolation: one request must not take the engine down. `add_request`
validates everything against the model (vocabulary, lengths, logprobs) and adds all
of a request's sequences or none. Inside a step, the phases that depend on one
request's own parameters — the forward when it runs in this process, sampling
(logits processors, logit_bias, top-k, logprobs), prompt logprobs, detokenising and
stop strings, output assembly — attribute a failure to the request that caused it
(`_fail_request`: its sequences are aborted, its blocks freed, its client gets an
error output with status 500) and the step goes on for the others. Scheduling and
KV-cache bookkeeping are shared state: an exception there, or a KV pool that fails
its integrity check after a request was failed, still ends the engine.
"""
from __future__ import annotations

import json
import logging
import os
import uuid
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from kvrelay import envs
from kvrelay.config import EngineArgs, NeuronConfig
from kvrelay.engine.detokenizer import PROMPT_CONTEXT, IncrementalDetokenizer
from kvrelay.engine.outputs import CompletionOutput, RequestOutput
from kvrelay.engine.request import Request, Status
from kvrelay.engine.runner import ModelRunner, StepInput, kv_bytes_per_block
from kvrelay.engine.sampler import Sampler, top_logprobs
from kvrelay.engine.scheduler import ScheduledChunk, Scheduler, SchedulerConfig, SchedulerOutput
from kvrelay.disagg.connector import HoldRefused, KVConnector
from kvrelay.disagg.params import KVTransferConfig, KVTransferParams
from kvrelay.distributed.executor import MultiprocExecutor, RankSpec, free_port
from kvrelay.kv_cache.manager import KVCacheGroup, KVCacheManager
from kvrelay.kv_cache.spec import KVCacheSpec
from kvrelay.model.config import load_config
from kvrelay.model.loader import load_model, resolve_model_path
from kvrelay.model.parallel import cpu_slices, validate_layout
from kvrelay.model.tokenizer import CheckpointTokenizer, load_tokenizer
from kvrelay.sampling_params import (
    SamplingParams,
    SamplingParamsError,
    check_token_ids,
    validate_for_model,
)
from kvrelay.structured.manager import StructuredOutputs

logger = logging.getLogger(__name__)

DEFAULT_CPU_KV_BYTES = 1 << 30
TORCH_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


@dataclass
class _Parent:
    """An n > 1 request: the children share the prompt (and its cached KV blocks)."""
    request_id: str
    prompt: str | None
    children: list[Request]
    detok: dict[str, IncrementalDetokenizer] = field(default_factory=dict)
    sent: dict[str, int] = field(default_factory=dict)     # tokens already reported per child


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA device is available")
    return torch.device(device)


class LLMEngine:
    def __init__(self, args: EngineArgs) -> None:
        self.args = args
        self.neuron = NeuronConfig.from_additional_config(args.additional_config)
        self.device = resolve_device(args.device)
        self.model_dir = _model_dir(args)
        self.tokenizer: CheckpointTokenizer | None = _maybe_tokenizer(self.model_dir)
        dtype = self._dtype()
        quant = self.neuron.quantization or args.quantization or "auto"
        self.executor: MultiprocExecutor | None = None
        self.expert_world = self._expert_world()          # experts span all DP replicas
        self.num_dummy_steps = 0
        self._pin_cpus()
        if args.tensor_parallel_size > 1:
            self.executor = MultiprocExecutor(self._rank_spec(dtype, quant))
            loaded = self.executor.loaded
        else:
            ctx = self._replica_context()
            loaded = load_model(self.model_dir, dtype=dtype, quantization=quant,
                                hf_overrides=args.hf_overrides, device=self.device,
                                hybrid_kv_cache=not args.disable_hybrid_kv_cache_manager,
                                max_positions=args.max_model_len, ctx=ctx)
            if ctx is not None:
                from kvrelay.model.layers.ep_dispatch import report_expert_layout
                report_expert_layout(loaded.model, ctx)
        self.model, self.model_config = loaded.model, loaded.config
        self.max_model_len = args.max_model_len or self.model_config.max_position_embeddings
        max_batched = args.max_num_batched_tokens or 8192
        self.neuron.check_buckets(max_batched, args.max_num_seqs)
        num_blocks = self._num_blocks()
        self.kv = KVCacheManager(num_blocks, args.block_size, self._kv_groups(),
                                 enable_prefix_caching=args.enable_prefix_caching,
                                 hash_seed=f"{self.model_dir.name}:{args.block_size}")
        if self.executor is not None:
            self.runner = self.executor.start_runner(num_blocks)
        else:
            self.runner = ModelRunner(self.model, num_blocks, args.block_size, self.device)
        self.scheduler = Scheduler(SchedulerConfig(max_batched, args.max_num_seqs, self.max_model_len), self.kv)
        self.kv_transfer = KVTransferConfig.from_json(args.kv_transfer_config)
        self.connector: KVConnector | None = None
        self.sampler = Sampler(all_greedy=self.neuron.all_greedy)
        self.eos_token_ids = self._eos_ids()
        self.structured = StructuredOutputs(self.tokenizer, self.model_config.vocab_size,
                                            self.eos_token_ids)
        self.processor_factories = [_load_object(name) for name in args.logits_processors]
        self.parents: dict[str, _Parent] = {}
        self.child_parent: dict[str, _Parent] = {}
        self._failures: list[RequestOutput] = []        # requests failed during this step
        self.num_steps = 0
        self._warmup()
        if self.kv_transfer is not None:
            self._start_connector()
        if self.neuron.num_batched_tokens_buckets or self.neuron.num_seqs_buckets:
            logger.info("neuron_config buckets validated; not needed on %s (eager, no captured "
                        "graphs): steps are not padded", self.device.type)

    # -- setup helpers --------------------------------------------------------------------
    def _dtype(self) -> torch.dtype:
        if self.args.dtype != "auto":
            return TORCH_DTYPES[self.args.dtype]
        raw = json.loads((self.model_dir / "config.json").read_text())
        name = str(raw.get("torch_dtype") or raw.get("dtype") or "bfloat16")
        return TORCH_DTYPES.get(name, torch.bfloat16)

    def _kv_groups(self) -> list[KVCacheGroup]:
        groups = self.model.layer_groups
        out = []
        for g in range(max(groups) + 1):
            layers = [i for i, x in enumerate(groups) if x == g]
            windows = {self.model_config.window_of(i) for i in layers}
            # a group mixing full and sliding layers (hybrid manager off) keeps every block
            window = windows.pop() if len(windows) == 1 else None
            out.append(KVCacheGroup(window=window, num_layers=len(layers)))
        return out

    def _num_blocks(self) -> int:
        a = self.args
        per_block = kv_bytes_per_block(self.model, a.block_size)
        if a.num_gpu_blocks_override:
            num_blocks = a.num_gpu_blocks_override
        elif a.kv_cache_memory_bytes:
            num_blocks = a.kv_cache_memory_bytes // per_block
        else:
            # the default budget, but no more than every sequence at full length could use
            most = a.max_num_seqs * -(-self.max_model_len // a.block_size) + 1
            num_blocks = min(DEFAULT_CPU_KV_BYTES // per_block, most)
        needed = -(-self.max_model_len // a.block_size) + 1
        if num_blocks < needed:
            raise ValueError(
                f"the KV cache holds {num_blocks} blocks of {a.block_size} tokens but one "
                f"sequence of max_model_len {self.max_model_len} needs {needed}; raise "
                f"--kv-cache-memory-bytes (now {num_blocks * per_block} bytes) or lower --max-model-len")
        return num_blocks

    def _eos_ids(self) -> tuple[int, ...]:
        if self.tokenizer and self.tokenizer.eos_token_ids:
            return self.tokenizer.eos_token_ids
        return self.model_config.eos_token_id

    def _start_connector(self) -> None:
        """Every TP rank registers its KV shard with its own transport (the executor
        starts ranks 1..N-1's); the side channel listens here, on rank 0's process."""
        engine_id = self.kv_transfer.engine_id or f"kvrelay-{uuid.uuid4().hex[:12]}"
        self.connector = KVConnector(self.kv_transfer, engine_id, self.kv_cache_spec(),
                                     self.runner.kv_tensors, tp_size=self.args.tensor_parallel_size,
                                     link=self.executor, port_offset=getattr(self.args, "data_parallel_rank", 0))
        logger.info("KV transfer: role %s, engine id %s, transport %s", self.kv_transfer.kv_role,
                    engine_id, self.connector.transport.name)

    def _pin_cpus(self) -> None:
        """TP=1 on CPU: run on the device slice (NEURON_VISIBLE_DEVICES / per DP replica)."""
        visible = self.args.visible_devices or envs.VISIBLE_DEVICES.raw()
        if visible and self.device.type == "cpu" and self.args.tensor_parallel_size == 1:
            cores = envs.parse_id_list(visible)
            os.sched_setaffinity(0, cores)
            torch.set_num_threads(len(cores))
            logger.info("pinned to CPU cores %s", cores)

    def _expert_world(self):
        """EP across DP replicas: where this replica's ranks meet the others' (None otherwise)."""
        a = self.args
        if not a.experts_across_replicas:
            return None
        from kvrelay.distributed.collectives import ExpertWorld
        if a.data_parallel_master_port is None:
            raise ValueError("expert parallelism across replicas needs the expert world's port "
                             "(set by the data-parallel launcher)")
        cfg = load_config(self.model_dir, a.hf_overrides)
        validate_layout(cfg.num_attention_heads, cfg.num_key_value_heads, cfg.num_local_experts,
                        a.tensor_parallel_size, a.tensor_parallel_size * a.data_parallel_size,
                        a.data_parallel_size)
        timeout = envs.EXECUTE_MODEL_TIMEOUT_S.as_float() or 600.0
        return ExpertWorld(a.data_parallel_address, a.data_parallel_master_port, a.data_parallel_rank,
                           a.data_parallel_size, a.tensor_parallel_size,
                           max(timeout, envs.ENGINE_READY_TIMEOUT_S.as_float() or 0.0))

    def _replica_context(self):
        """TP=1 with experts across replicas: this process is one rank of the expert group."""
        if self.expert_world is None:
            return None
        from kvrelay.distributed.collectives import GlooExpertGroup
        from kvrelay.model.parallel import NoCollectives, ParallelContext
        w = self.expert_world
        return ParallelContext.across_replicas(0, 1, w.dp_rank, w.dp_size, NoCollectives(),
                                               GlooExpertGroup(w, 0))

    def _rank_spec(self, dtype: torch.dtype, quant: str | None) -> RankSpec:
        a = self.args
        cfg = load_config(self.model_dir, a.hf_overrides)
        ep = self.neuron.ep_degree or (a.tensor_parallel_size if a.enable_expert_parallel else 1)
        if self.expert_world is None:
            validate_layout(cfg.num_attention_heads, cfg.num_key_value_heads, cfg.num_local_experts,
                            a.tensor_parallel_size, ep)
        visible = a.visible_devices or envs.VISIBLE_DEVICES.raw()
        cores = envs.parse_id_list(visible) if visible else sorted(os.sched_getaffinity(0))
        return RankSpec(str(self.model_dir), dtype, quant, a.hf_overrides,
                        not a.disable_hybrid_kv_cache_manager,
                        a.max_model_len or cfg.max_position_embeddings, a.tensor_parallel_size, ep,
                        a.block_size, f"tcp://127.0.0.1:{free_port()}",
                        cpu_slices(cores, a.tensor_parallel_size), expert_world=self.expert_world)

    def _execute(self, step: StepInput) -> torch.Tensor:
        return self.executor.execute(step) if self.executor else self.runner.execute(step)

    def shutdown(self) -> None:
        self.sampler.masks.close()
        if self.connector is not None:
            self.connector.close()
            self.connector = None
        if self.executor is not None:
            self.executor.shutdown()
            self.executor = None

    def _warmup(self) -> None:
        limit = envs.COMPILATION_TIMEOUT_S.as_float()
        if self.expert_world is not None:
            seconds = self._warmup_in_lockstep()
        else:
            seconds = self.executor.warmup() if self.executor else self.runner.warmup()
        if limit is not None and seconds > limit:
            raise TimeoutError(f"warm-up took {seconds:.0f}s, over the {limit:.0f}s allowed; "
                               f"raise {envs.COMPILATION_TIMEOUT_S.shown}")
        logger.info("warm-up done in %.2fs", seconds)

    # -- requests -------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                    kv_transfer_params: dict | None = None) -> None:
        if request_id in self.parents:
            raise ValueError(f"duplicate request id {request_id!r}")
        text, ids = (prompt, self._encode(prompt)) if isinstance(prompt, str) else (None, list(prompt))
        self._check_params(params, ids)
        transfer = self._check_transfer(KVTransferParams.from_dict(kv_transfer_params))
        grammar = self.structured.matcher(params)       # ValueError: a bad schema / regex
        made = [p for p in (f(params, ids) for f in self.processor_factories) if p is not None]
        if made:
            params = replace(params, logits_processors=list(params.logits_processors) + made)
        children = []
        for i in range(params.n):
            child_params = params if params.n == 1 else replace(
                params, n=1, seed=None if params.seed is None else params.seed + i)
            child_id = request_id if params.n == 1 else f"{i}_{request_id}"
            children.append(Request(child_id, ids, child_params, self.eos_token_ids,
                                    fork_of=children[0] if children else None,
                                    kv_transfer=transfer if not children else None,
                                    grammar=grammar.fork() if grammar else None))
        for child in children:
            # a finished prefill request holding blocks for a decode still owns its id
            if self._id_in_use(child.request_id):
                raise ValueError(f"duplicate request id {child.request_id!r} (still running or "
                                 f"holding KV blocks)")
        parent = _Parent(request_id, text, children)
        try:
            for child in children:
                self.scheduler.add(child)
                self.child_parent[child.request_id] = parent
        except BaseException:                            # all of the request's sequences or none
            for child in children:
                if self.child_parent.pop(child.request_id, None) is not None:
                    self.scheduler.abort(child.request_id)
            raise
        self.parents[request_id] = parent

    def _id_in_use(self, request_id: str) -> bool:
        s = self.scheduler
        return request_id in s.requests or request_id in s.held or request_id in self.child_parent

    def _check_transfer(self, p: KVTransferParams | None) -> KVTransferParams | None:
        if p is None or not (p.do_remote_decode or p.do_remote_prefill):
            return None
        cfg = self.kv_transfer
        if p.do_remote_decode and not (cfg and cfg.is_producer):
            raise ValueError("kv_transfer_params.do_remote_decode needs a server started with "
                             "--kv-transfer-config kv_role kv_producer or kv_both")
        if p.do_remote_prefill and not (cfg and cfg.is_consumer):
            raise ValueError("kv_transfer_params.do_remote_prefill needs a server started with "
                             "--kv-transfer-config kv_role kv_consumer or kv_both")
        if p.do_remote_prefill and len(p.remote_block_ids) != len(self.kv.groups):
            raise ValueError(f"kv_transfer_params.remote_block_ids has {len(p.remote_block_ids)} lists; this "
                             f"server has {len(self.kv.groups)} KV-cache groups (hybrid KV cache manager "
                             f"settings must match)")
        return p

    def free_remote(self, request_id: str, capability: str | None) -> bool:
        """Prefill side: an explicit free from the proxy (client gone, decode failed). Only
        with the capability the request was held with: a wrong or missing one, or an id
        not held, frees nothing and gets the same False (the caller learns no more)."""
        if self.connector is None or not self.connector.holds(request_id, capability):
            return False
        self.connector.released(request_id)
        return self.scheduler.release_held(request_id)

    def _encode(self, text: str) -> list[int]:
        if self.tokenizer is None:
            raise ValueError("this checkpoint has no tokenizer.json; pass token ids")
        return self.tokenizer.encode(text)

    def _check_params(self, params: SamplingParams, ids: list[int]) -> None:
        """Everything about a request that could fail later in a step, checked now."""
        if not ids:
            raise SamplingParamsError("the prompt is empty", "prompt")
        vocab = self.model_config.vocab_size
        check_token_ids(ids, vocab, "prompt")
        validate_for_model(params, vocab, self.args.max_logprobs)
        if len(ids) >= self.max_model_len:
            raise SamplingParamsError(f"the prompt has {len(ids)} tokens; max_model_len is "
                                      f"{self.max_model_len}", "prompt")
        if params.max_tokens is not None and len(ids) + params.max_tokens > self.max_model_len:
            raise SamplingParamsError(f"prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) "
                                      f"exceeds max_model_len {self.max_model_len}", "max_tokens")

    def abort_request(self, request_id: str) -> None:
        parent = self.parents.pop(request_id, None)
        for child in parent.children if parent else []:
            self.scheduler.abort(child.request_id)
            self.child_parent.pop(child.request_id, None)
            if self.connector is not None:
                self.connector.cancel(child.request_id, child.kv_transfer)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished

    @property
    def transfer_busy(self) -> bool:
        """KV loads in flight or blocks held for decode servers (needs periodic polling)."""
        return self.connector is not None and self.connector.busy

    # -- the step ---------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        failed = self._poll_transfers()
        out = self.scheduler.schedule()
        failed += self._start_loads(out)
        kv_work = self.connector.take_work() if self.connector is not None else None
        if out.is_empty:
            if kv_work is not None and self.executor is not None:
                self.executor.send_kv(kv_work)
            return self._failed_outputs(failed)
        step = self._step_input(out)
        step.kv_work = kv_work            # ranks ≥ 1 start their KV reads before computing
        self.sampler.prepare(_sampling_requests(out))    # grammar masks fill during the forward
        logits = self._forward(out, step)
        sampled = self._sample(out, logits)
        self.scheduler.update(out, sampled)
        self.num_steps += 1
        return self._outputs(out) + self._failed_outputs(failed) + self._take_failures()

    def _forward(self, out: SchedulerOutput, step: StepInput) -> torch.Tensor:
        """The model forward, with a failure attributed to the requests that cause it.

        With TP worker ranks or experts across replicas a failed forward is fatal: the
        ranks' collectives cannot be replayed for a subset of the batch. In this process
        (TP=1) each chunk is re-run alone; a chunk that fails alone fails its request,
        the others keep their logits (concatenated in chunk order, the row layout
        `_sample` expects). Re-running is safe: a forward writes K/V only to the slots of
        its own new tokens, which no other request shares and the prefix cache does not
        hold yet, and rewriting them gives the same values. When every chunk of a
        multi-chunk step fails alone too, the fault is not a request's: fatal.
        """
        if self.executor is not None or self.expert_world is not None:
            return self._execute(step)
        try:
            return self._execute(step)
        except Exception as error:                      # attributed per chunk below
            if len(out.chunks) > 1:
                logger.warning("a forward of %d chunks failed (%s: %s); re-running each alone",
                               len(out.chunks), type(error).__name__, error)
            alone = []
            for chunk in out.chunks:
                try:
                    alone.append((chunk, self._execute(self._step_input(SchedulerOutput([chunk]))), None))
                except Exception as e:  # noqa: BLE001 -- this chunk's own failure
                    alone.append((chunk, None, e))
            if len(alone) > 1 and all(e is not None for _, _, e in alone):
                raise                                    # every chunk fails alone: not attributable
            kept, parts = [], []
            for chunk, logits, e in alone:
                if e is not None:
                    self._fail_request(chunk.request, e, "the model forward")
                else:
                    kept.append(chunk)
                    parts.append(logits)
            out.chunks = kept
            return torch.cat(parts) if parts else torch.empty(0)

    def _fail_request(self, req: Request, error: BaseException, where: str) -> None:
        """Fail the client request `req` belongs to (all of its n sequences): abort them,
        free their blocks, and queue an error output; the engine keeps serving the rest."""
        parent = self.child_parent.get(req.request_id)
        logger.error("request %s failed in %s: %s: %s", req.request_id, where,
                     type(error).__name__, error, exc_info=error)
        if parent is None:
            self.scheduler.abort(req.request_id)
            return
        self.abort_request(parent.request_id)
        for child in parent.children:
            if child.request_id in self.scheduler.held:  # finished prefill: its held blocks
                if self.connector is not None:
                    self.connector.released(child.request_id)
                self.scheduler.release_held(child.request_id)
        self._forget(parent)
        self._failures.append(_error_output(parent, f"the request failed in {where}: "
                                                    f"{type(error).__name__}: {error}"))

    def _take_failures(self) -> list[RequestOutput]:
        """This step's failed requests' outputs. Failing them freed blocks mid-step: the
        KV pool must still be consistent, otherwise the failure was not theirs alone."""
        failures, self._failures = self._failures, []
        if failures:
            self.kv.check_integrity()
        return failures

    def _poll_transfers(self) -> list[Request]:
        """Finished KV loads (decode) and read-done notices / lease expiries (prefill)."""
        if self.connector is None:
            return []
        failed = []
        for request_id, error in self.connector.poll_loads():
            req = self.scheduler.loading.get(request_id)
            self.scheduler.finish_load(request_id, error, self.kv_transfer.kv_load_failure_policy == "recompute")
            if req is not None and req.error:
                failed.append(req)
        for request_id in self.connector.read_done() + self.connector.expired():
            self.connector.released(request_id)
            self.scheduler.release_held(request_id)
        return failed

    def _start_loads(self, out: SchedulerOutput) -> list[Request]:
        failed = []
        for load in out.loads:
            req = load.request
            try:
                self.connector.start_load(req.request_id, req.kv_transfer, self.kv.block_ids(req.request_id),
                                          self.kv.groups, load.hit_tokens, req.num_prompt_tokens,
                                          self.args.block_size)
            except Exception as e:  # handshake/transport errors fail (or recompute) this request only
                logger.error("KV load for %s failed to start: %s", req.request_id, e)
                self.connector.stats.failed += 1
                self.scheduler.finish_load(req.request_id, str(e),
                                           self.kv_transfer.kv_load_failure_policy == "recompute")
                if req.error:
                    failed.append(req)
        return failed

    # -- lockstep steps: experts across data-parallel replicas (engine/lockstep.py) ----------
    def plan_step(self) -> StepPlan:
        """The first half of `step()`: schedule; the token count goes to the other replicas."""
        failed = self._poll_transfers()
        out = self.scheduler.schedule()
        failed += self._start_loads(out)
        kv_work = self.connector.take_work() if self.connector is not None else None
        return StepPlan(out, None if out.is_empty else self._step_input(out), failed, kv_work)

    def run_planned(self, plan: StepPlan, dp_token_counts: tuple[int, ...]) -> list[RequestOutput]:
        """The second half: when any replica has tokens every replica runs a forward —
        this one a dummy token (output discarded) if it has none — so the MoE
        collectives line up."""
        if max(dp_token_counts) == 0:
            if plan.kv_work is not None and self.executor is not None:
                self.executor.send_kv(plan.kv_work)
            return self._failed_outputs(plan.failed)
        step = plan.step or self._dummy_step()
        step.dp_token_counts = tuple(dp_token_counts)
        step.kv_work = plan.kv_work
        self.sampler.prepare(_sampling_requests(plan.out))
        logits = self._execute(step)
        if plan.step is None:
            self.num_dummy_steps += 1
            return self._failed_outputs(plan.failed)
        sampled = self._sample(plan.out, logits)
        self.scheduler.update(plan.out, sampled)
        self.num_steps += 1
        return self._outputs(plan.out) + self._failed_outputs(plan.failed) + self._take_failures()

    def _dummy_step(self) -> StepInput:
        """One padding token written to the null block (as warm-up does)."""
        tables = [[[0]] for _ in range(self.runner.num_groups)]
        return StepInput([0], [1], [0], tables, [0], num_decodes=1)

    def _warmup_in_lockstep(self) -> float:
        """Every replica warms up with the same two forwards at the same time."""
        import time
        t0 = time.perf_counter()
        n, dp = min(self.args.block_size, 8), self.args.data_parallel_size
        tables = [[[0]] for _ in range(self.runner.num_groups)]
        for step in (StepInput([0] * n, [n], [0], tables, [n - 1]),
                     StepInput([0], [1], [n - 1], tables, [0], num_decodes=1)):
            step.dp_token_counts = (len(step.token_ids),) * dp
            self._execute(step)
        return time.perf_counter() - t0

    def _failed_outputs(self, failed: list[Request]) -> list[RequestOutput]:
        outputs = []
        for req in failed:
            parent = self.child_parent.get(req.request_id)
            if parent is not None:
                out = self._request_output(parent)
                out.error = req.error
                outputs.append(out)
                if out.finished:
                    self._forget(parent)
        return outputs

    def _step_input(self, out: SchedulerOutput) -> StepInput:
        token_ids, q_lens, starts, rows = [], [], [], []
        tables: list[list[list[int]]] = [[] for _ in range(self.runner.num_groups)]
        for chunk in out.chunks:
            req = chunk.request
            token_ids.extend(req.all_token_ids[chunk.start:chunk.start + chunk.num_tokens])
            q_lens.append(chunk.num_tokens)
            starts.append(chunk.start)
            for g, ids in enumerate(self.kv.block_ids(req.request_id)):
                tables[g].append(ids)
            end = len(token_ids)
            n_prompt = _prompt_logprob_rows(chunk)
            rows.extend(range(end - chunk.num_tokens, end - chunk.num_tokens + n_prompt))
            if chunk.completes:
                rows.append(end - 1)
        num_decodes = sum(1 for c in out.chunks if c.num_tokens == 1)
        return StepInput(token_ids, q_lens, starts, tables, rows, num_decodes)

    def _sample(self, out: SchedulerOutput, logits: torch.Tensor) -> dict[str, list[int]]:
        """Tokens for the chunks that complete; a request whose prompt logprobs or
        sampling fails is failed alone (`Sampler.isolated`) and gets no token."""
        row, sample_rows, reqs = 0, [], []
        for chunk in out.chunks:
            req = chunk.request
            n = _prompt_logprob_rows(chunk)
            if n:
                try:
                    self._prompt_logprobs(req, chunk.start, logits[row:row + n])
                except Exception as e:  # noqa: BLE001 -- this request's failure only
                    self._fail_request(req, e, "computing prompt logprobs")
                row += n
            if chunk.completes:
                sample_rows.append(row)
                reqs.append(req)
                row += 1
        if not reqs:
            return {}
        result, errors = self.sampler.isolated(logits[sample_rows], reqs)
        for i, e in errors.items():
            self._fail_request(reqs[i], e, "sampling")
        sampled = {}
        for i, (req, token, lp) in enumerate(zip(reqs, result.token_ids, result.logprobs)):
            if i in errors:
                continue
            if lp is not None:
                req.output_logprobs.append(lp)
            sampled[req.request_id] = [token]
        return sampled

    def _prompt_logprobs(self, req: Request, start: int, logits: torch.Tensor) -> None:
        if start == 0:
            req.prompt_logprobs = [None]                 # the first token has no logprob
        logp = torch.log_softmax(logits, dim=-1)
        for j in range(logits.shape[0]):
            nxt = req.prompt_token_ids[start + j + 1]
            req.prompt_logprobs.append(top_logprobs(logp[j], nxt, req.params.prompt_logprobs or 0))

    # -- outputs ----------------------------------------------------------------------------
    def _outputs(self, out: SchedulerOutput) -> list[RequestOutput]:
        touched: dict[str, _Parent] = {}
        for chunk in out.chunks:
            parent = self.child_parent.get(chunk.request.request_id)
            if parent is not None:
                try:
                    self._detokenize(parent, chunk.request)
                except Exception as e:  # noqa: BLE001 -- e.g. a stop string; this request only
                    self._fail_request(chunk.request, e, "detokenizing")
                    continue
                touched[parent.request_id] = parent
        for request_id in out.preempted:                 # outputs of preempted requests stay put
            parent = self.child_parent.get(request_id)
            if parent is not None:
                touched.setdefault(parent.request_id, parent)
        results = []
        for parent in touched.values():
            if self.parents.get(parent.request_id) is not parent:
                continue                                 # failed after it was touched
            try:
                result = self._request_output(parent)
            except Exception as e:  # noqa: BLE001 -- this request's failure only
                self._fail_request(parent.children[0], e, "building its output")
                continue
            results.append(result)
            if result.finished:
                self._forget(parent)
        return results

    def _detokenize(self, parent: _Parent, req: Request) -> None:
        if self.tokenizer is None:
            return
        detok = parent.detok.get(req.request_id)
        if detok is None:
            detok = parent.detok[req.request_id] = IncrementalDetokenizer(
                self.tokenizer, req.prompt_token_ids, req.params.stop,
                req.params.include_stop_str_in_output, req.params.skip_special_tokens)
        new = req.output_token_ids[len(detok.ids) - min(len(req.prompt_token_ids), PROMPT_CONTEXT):]
        stop = detok.add(new)
        if stop is not None and req.status is Status.RUNNING:
            self.scheduler.finish_stopped(req, stop)

    def _request_output(self, parent: _Parent) -> RequestOutput:
        outputs = []
        for i, child in enumerate(parent.children):
            reason = child.status.value if child.status.finished else None
            detok = parent.detok.get(child.request_id)
            sent = parent.sent.get(child.request_id, 0)
            logprobs = child.output_logprobs if child.params.logprobs is not None else None
            outputs.append(CompletionOutput(
                i, detok.text if detok else "", list(child.output_token_ids), reason, child.stop_reason,
                logprobs, delta_text=detok.take(reason is not None) if detok else "",
                delta_token_ids=child.output_token_ids[sent:],
                delta_logprobs=logprobs[sent:] if logprobs is not None else None))
            parent.sent[child.request_id] = len(child.output_token_ids)
        first = parent.children[0]
        out = RequestOutput(
            parent.request_id, parent.prompt, list(first.prompt_token_ids), outputs,
            first.prompt_logprobs if first.params.prompt_logprobs is not None else None,
            first.num_cached_tokens, all(o.finished for o in outputs))
        if out.finished and first.remote_decode and first.request_id in self.scheduler.held:
            block_ids = self.kv.block_ids(first.request_id)
            try:
                out.kv_transfer_params = {"do_remote_prefill": True, "do_remote_decode": False,
                                          "remote_block_ids": block_ids,
                                          **self.connector.hold(first.request_id, block_ids)}
            except HoldRefused as e:        # over the hold share: free now, the request fails
                self.scheduler.release_held(first.request_id)
                out.error, out.error_status = str(e), 503     # busy, not broken: retry later
        return out

    def _forget(self, parent: _Parent) -> None:
        self.parents.pop(parent.request_id, None)
        for child in parent.children:
            self.child_parent.pop(child.request_id, None)

    def kv_cache_spec(self) -> KVCacheSpec:
        import hashlib
        c = self.model_config
        fingerprint = hashlib.sha256(json.dumps(c.raw, sort_keys=True, default=str).encode()).hexdigest()[:16]
        return KVCacheSpec(f"{self.model_dir.name}:{fingerprint}", str(self.model.dtype).removeprefix("torch."),
                           self.args.block_size, c.num_hidden_layers, c.num_key_value_heads, c.head_dim,
                           hybrid=len(self.kv.groups) > 1, sliding_window=c.sliding_window)

    # -- introspection ----------------------------------------------------------------------
    def assert_no_leaks(self) -> None:
        self.kv.assert_no_leaks()


@dataclass
class StepPlan:
    """A scheduled step not yet run (lockstep stepping)."""
    out: SchedulerOutput
    step: StepInput | None           # None: nothing to compute here this step
    failed: list[Request]
    kv_work: object = None

    @property
    def num_tokens(self) -> int:
        return len(self.step.token_ids) if self.step is not None else 0


def _error_output(parent: _Parent, message: str) -> RequestOutput:
    """The final output of a request failed inside the engine (HTTP 500 for its client)."""
    first = parent.children[0]
    outputs = [CompletionOutput(i, "", [], "abort") for i in range(len(parent.children))]
    return RequestOutput(parent.request_id, parent.prompt, list(first.prompt_token_ids), outputs,
                         finished=True, error=message, error_status=500)


def _load_object(name: str):
    """"package.module:attr" → the object (for --logits-processors)."""
    import importlib
    module, _, attr = name.partition(":")
    if not attr:
        raise ValueError(f"--logits-processors: {name!r} is not of the form module:attr")
    try:
        return getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"--logits-processors: cannot load {name!r} ({e})") from None


def _sampling_requests(out: SchedulerOutput) -> list[Request]:
    """The requests that sample this step, in `_sample`'s row order."""
    return [c.request for c in out.chunks if c.completes]


def _prompt_logprob_rows(chunk: ScheduledChunk) -> int:
    """Rows of this chunk whose logits score the next *prompt* token: positions
    p in [start, start + n) with p + 1 < prompt length."""
    req = chunk.request
    if req.params.prompt_logprobs is None:
        return 0
    return max(min(chunk.start + chunk.num_tokens, req.num_prompt_tokens - 1) - chunk.start, 0)


def _model_dir(args: EngineArgs) -> Path:
    if args.model is None:
        from kvrelay.model.embedded import embedded_model_dir
        return embedded_model_dir()
    return resolve_model_path(args.model, args.download_dir)


def _maybe_tokenizer(model_dir: Path) -> CheckpointTokenizer | None:
    return load_tokenizer(model_dir) if (model_dir / "tokenizer.json").is_file() else None

