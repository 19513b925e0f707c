"""The engine-core loop of a replica whose MoE layers span every data-parallel replica
(`--data-parallel-size N --enable-expert-parallel`: EP = TP × DP).

Attention stays per replica (own scheduler, own KV cache); the MoE layers gather the
tokens of all replicas, so every replica must run a forward in the same steps. One
round per step:

    drain the pipe ─▶ plan_step() (schedule) ─▶ all-gather [tokens, wave, busy]
        ─▶ run_planned(): a forward if any replica has tokens (dummy token if this one has none)

Waking up without spinning. Idle replicas sleep on their pipe. The API side sends
every replica `Wake(w)` right after it adds a request anywhere (w counts up), so an
add is always followed by a wake on every pipe. A round is *live* — another round
follows at once — while any replica has tokens, or some replica has not yet received
the newest wake (lo < hi: it is on its way, and that replica may carry the new
request). When no replica has tokens and all have seen the same wave, all stop
together, and each sleeps until a wave newer than that one arrives. Replicas with
unfinished-but-unschedulable work or KV transfers in flight keep the group polling
every 10 ms (as the single-replica loop does).

Every replica runs exactly the same sequence of rounds, because each decision is
made from the same all-gathered rows.
"""
from __future__ import annotations

import logging
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvrelay.engine.codec import MessagePipe
from kvrelay.engine.messages import Fatal, Shutdown, StepOutputs, ToEngine, Wake, as_delta

logger = logging.getLogger(__name__)

BUSY_POLL_S = 0.01        # some replica waits on KV transfers or blocks: poll this often
IN_FLIGHT_POLL_S = 0.001  # a wake is on its way to some replica


@dataclass(frozen=True)
class RoundRow:
    """What each replica contributes to a round's all-gather (as three ints)."""

    num_tokens: int      # tokens this replica schedules this round
    wave: int            # the newest wake it has seen
    busy: bool           # unfinished work it cannot schedule yet, or KV transfers in flight

    def to_ints(self) -> list[int]:
        return [self.num_tokens, self.wave, int(self.busy)]

    @classmethod
    def from_ints(cls, row: list[int]) -> RoundRow:
        return cls(int(row[0]), int(row[1]), bool(row[2]))


class _Pipe:
    """Drains the API pipe; owner of the wave number this replica has seen."""

    def __init__(self, engine: Any, conn: MessagePipe[ToEngine], handle: Callable) -> None:
        self.engine, self.conn, self.handle = engine, conn, handle
        self.seen = 0
        self.closed = False

    def drain(self, timeout: float | None = 0.0) -> None:
        """Handle what is in the pipe; with a timeout, first wait that long for a message."""
        if timeout != 0.0 and not self.conn.poll(timeout):
            return
        while not self.closed and self.conn.poll(0):
            try:
                message = self.conn.recv()
            except EOFError:
                self.closed = True
                return
            if isinstance(message, Shutdown):
                self.closed = True
            elif isinstance(message, Wake):
                self.seen = max(self.seen, int(message.wave))
            else:
                self.handle(self.engine, self.conn, message)


def run_lockstep(engine: Any, conn: MessagePipe[ToEngine], handle: Callable,
                 stats_of: Callable) -> None:
    from kvrelay.distributed.collectives import ReplicaSync  # torch: the core process only
    sync = ReplicaSync(engine.expert_world)
    pipe = _Pipe(engine, conn, handle)
    synced, live, last_stats = 0, False, None
    logger.info("replica %d of %d steps in lockstep with the others (experts across replicas)",
                engine.expert_world.dp_rank, engine.expert_world.dp_size)
    while not pipe.closed:
        if not live:
            while pipe.seen <= synced and not pipe.closed:     # asleep until a newer wave
                pipe.drain(timeout=None)
            if pipe.closed:
                return
        pipe.drain()
        plan = engine.plan_step()
        busy = engine.transfer_busy or (engine.has_unfinished_requests() and plan.num_tokens == 0)
        try:
            mine = RoundRow(plan.num_tokens, pipe.seen, busy)
            rows = [RoundRow.from_ints(r) for r in sync.all_gather(mine.to_ints())]
            counts = tuple(r.num_tokens for r in rows)
            outputs = engine.run_planned(plan, counts)
        except BaseException as e:  # noqa: BLE001 -- any failure ends this replica, reported in one line
            conn.send(Fatal(f"engine step failed: {type(e).__name__}: {e}"))
            logger.error(traceback.format_exc())
            return
        stats = stats_of(engine)
        if outputs or stats != last_stats:
            conn.send(StepOutputs([as_delta(o) for o in outputs], stats))
            last_stats = stats
        waves = [r.wave for r in rows]
        any_busy = any(r.busy for r in rows)
        live = any(counts) or any_busy or min(waves) < max(waves)
        if live and not any(counts):
            pipe.drain(timeout=IN_FLIGHT_POLL_S if min(waves) < max(waves) else BUSY_POLL_S)
        if not live:
            synced = max(waves)
