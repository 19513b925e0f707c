"""What the engine-core loops need of an engine (`CoreEngine`), and the `EngineStats`
they report after each step, read from the engine's owners (scheduler, KV cache, KV
connector, speculative decoding)."""
from __future__ import annotations

from typing import Any, Protocol

from kvrelay.engine.messages import EngineStats
from kvrelay.engine.outputs import RequestOutput


class CoreEngine(Protocol):
    """What the core loop (`core_proc.py`) and `lockstep.py` need of `LLMEngine`."""

    kv: Any
    scheduler: Any
    num_steps: int
    num_dummy_steps: int
    last_step_idle: bool           # the last step ran no forward (every request waits)

    @property
    def connector(self) -> Any: ...
    @property
    def expert_world(self) -> Any: ...
    @property
    def transfer_busy(self) -> bool: ...

    def has_unfinished_requests(self) -> bool: ...
    def add_request(self, request_id: str, prompt: Any, params: Any,
                    kv_transfer_params: dict | None = None) -> Any: ...
    def abort_request(self, request_id: str) -> None: ...
    def free_remote(self, request_id: str, capability: str) -> bool: ...
    def step(self) -> list[RequestOutput]: ...
    def plan_step(self) -> Any: ...
    def run_planned(self, plan: Any, counts: tuple[int, ...]) -> list[RequestOutput]: ...
    def shutdown(self) -> None: ...


def engine_stats(engine: CoreEngine) -> EngineStats:
    kv, sched = engine.kv, engine.scheduler
    return EngineStats(
        num_requests_running=len(sched.running),
        num_requests_waiting=len(sched.waiting),
        kv_cache_usage_perc=kv.pool.usage,
        blocks_free=kv.pool.num_free,
        blocks_used=kv.pool.num_used,
        blocks_total=kv.pool.num_blocks - 1,
        prefix_cache_queries=kv.stats.queries,
        prefix_cache_hits=kv.stats.hits,
        num_preemptions=sched.num_preemptions,
        num_steps=engine.num_steps,
        dp_dummy_steps=engine.num_dummy_steps,
        **transfer_stats(engine),
        **spec_decode_stats(engine),
    )


def spec_decode_stats(engine: CoreEngine) -> dict[str, Any]:
    """The `spec_decode_*` fields of `EngineStats` (none without --speculative-config;
    `LLMEngine.spec_stats`, which stand-in engines need not have)."""
    s = getattr(engine, "spec_stats", None)
    if s is None:
        return {}
    return {"spec_decode_num_drafts": s.num_drafts,
            "spec_decode_num_draft_tokens": s.num_draft_tokens,
            "spec_decode_num_accepted_tokens": s.num_accepted_tokens,
            "spec_decode_accepted_per_pos": tuple(s.accepted_per_pos)}


def transfer_stats(engine: CoreEngine) -> dict[str, Any]:
    """The `kv_*` fields of `EngineStats` (none without a KV connector)."""
    c = engine.connector
    if c is None:
        return {}
    held = sum(engine.kv.num_blocks_held(r) for r in engine.scheduler.held)
    s = c.stats
    return {"kv_transfers": s.transfers, "kv_transfer_failures": s.failed,
            "kv_transfer_bytes": s.bytes, "kv_transfer_seconds": s.seconds,
            "kv_handshakes": s.handshakes, "kv_handshake_errors": s.handshake_errors,
            "kv_transport_fallbacks": s.transport_fallbacks,
            "kv_blocks_held_for_remote": held,
            "kv_requests_held_for_remote": len(engine.scheduler.held),
            "kv_leases_expired": s.leases_expired, "kv_read_done_notices": s.read_done_notices,
            "kv_loads_in_flight": len(c.loads)}
