"""The lockstep protocol of replicas whose experts span all of them (engine/lockstep.py),
with fake engines in threads and an in-process all-gather: every replica runs the same
rounds, idle ones run dummy forwards while another has work, no round is lost when a
wake is still on its way, and with no work nobody steps."""
from __future__ import annotations

import multiprocessing as mp
import random
import threading
import time
from dataclasses import dataclass

import pytest

from kvrelay.engine import lockstep
from kvrelay.engine.messages import Fatal, Shutdown, Wake


@dataclass
class World:
    dp_rank: int
    dp_size: int


class FakeSync:
    """All-gather through shared slots and a barrier (a deadlock breaks the barrier)."""

    barrier: threading.Barrier
    slots: list

    def __init__(self, world: World) -> None:
        self.rank = world.dp_rank

    def all_gather(self, row: list[int]) -> list[list[int]]:
        FakeSync.slots[self.rank] = list(row)
        FakeSync.barrier.wait(timeout=10)
        rows = [list(r) for r in FakeSync.slots]
        FakeSync.barrier.wait(timeout=10)
        return rows


@dataclass
class Plan:
    num_tokens: int


class FakeEngine:
    """Each request needs `n` forwards of one token."""

    def __init__(self, rank: int, size: int) -> None:
        self.expert_world = World(rank, size)
        self.remaining: list[int] = []
        self.forwards: list[tuple[int, ...]] = []  # the counts of every forward this replica ran
        self.rounds = 0
        self.adds = 0                                     # add messages handled
        self.transfer_busy = False

    def has_unfinished_requests(self) -> bool:
        return bool(self.remaining)

    def plan_step(self) -> Plan:
        self.rounds += 1
        return Plan(len(self.remaining))

    def run_planned(self, plan: Plan, counts: tuple[int, ...]) -> list:
        if max(counts):
            self.forwards.append(counts)
            self.remaining = [n - 1 for n in self.remaining if n > 1]
        return []


@dataclass(frozen=True)
class Add:
    """The fake engine's add message: a request of `n` one-token forwards."""

    n: int


def handle(engine: FakeEngine, conn, message: Add) -> None:
    engine.adds += 1
    if message.n > 0:                                   # 0 tokens: a request the engine refused
        engine.remaining.append(message.n)


@pytest.mark.parametrize("seed", range(5))
def test_replicas_step_together_and_sleep_together(monkeypatch, seed):
    import kvrelay.distributed.collectives as coll
    dp = 3
    FakeSync.barrier, FakeSync.slots = threading.Barrier(dp), [None] * dp
    monkeypatch.setattr(coll, "ReplicaSync", FakeSync)
    engines = [FakeEngine(r, dp) for r in range(dp)]
    pipes = [mp.Pipe() for _ in range(dp)]
    failures: list = []

    def drain(conn):                                    # the API side reads what the cores send
        while True:
            try:
                msg = conn.recv()
            except (EOFError, OSError):
                return
            if isinstance(msg, Fatal):
                failures.append(msg.reason)

    threads = [threading.Thread(target=lockstep.run_lockstep,
                                args=(engines[r], pipes[r][1], handle, lambda e: {"n": e.rounds}),
                                daemon=True)
               for r in range(dp)]
    for r in range(dp):
        threading.Thread(target=drain, args=(pipes[r][0],), daemon=True).start()
        threads[r].start()
    rng = random.Random(seed)
    # Each pipe keeps its order (the target gets its add before the wake), but pipes are
    # independent: across nodes one replica may see a wake long before the add arrives
    # at another (two TCP connections), so every pipe's messages get their own delay.
    schedule: list[list[tuple[float, tuple]]] = [[] for _ in range(dp)]
    now = 0.0
    for wave in range(1, 13):
        target = rng.randrange(dp)
        for r in range(dp):
            messages = [Add(rng.choice([0, 1, 3, 5])), Wake(wave)] if r == target else [Wake(wave)]
            at = max(schedule[r][-1][0] if schedule[r] else 0.0,
                     now + rng.choice([0, 0, 0.002, 0.03]))
            schedule[r] += [(at, m) for m in messages]
        now += rng.choice([0, 0, 0.001, 0.05])

    def deliver(r: int, t0: float) -> None:
        for at, message in schedule[r]:
            time.sleep(max(t0 + at - time.monotonic(), 0))
            pipes[r][0].send(message)

    t0 = time.monotonic()
    senders = [threading.Thread(target=deliver, args=(r, t0)) for r in range(dp)]
    for t in senders:
        t.start()
    for t in senders:
        t.join()
    adds = [sum(isinstance(m, Add) for _, m in schedule[r]) for r in range(dp)]

    def busy() -> bool:
        return any(e.remaining or e.adds < n for e, n in zip(engines, adds))

    deadline = time.monotonic() + 20
    while busy() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not failures
    assert not busy(), "work left undone"
    for _ in range(10):                                 # the last wakes may still be on their way
        rounds = [e.rounds for e in engines]
        time.sleep(0.3)
        if [e.rounds for e in engines] == rounds:
            break
    else:
        pytest.fail("replicas keep stepping with no work")
    assert len(set(rounds)) == 1                        # every replica ran every round
    assert engines[0].forwards == engines[1].forwards == engines[2].forwards
    assert sum(max(c) > 0 and 0 in c for c in engines[0].forwards) > 0   # dummy forwards happened
    for r in range(dp):
        pipes[r][0].send(Shutdown())
    for t in threads:
        t.join(5)
        assert not t.is_alive()
