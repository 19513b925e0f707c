"""KVConnector's per-rank bookkeeping with TP (ranks ≥ 1 scripted through a fake RankLink):
a load finishes only when every rank reported; a failed rank fails the load and cancels
the others; the prefill frees a held request only after every decode rank's notice; the
handshake refuses prefill TP > decode TP on both sides. Rank 0's reads are real (TCP)."""
from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
import torch

from kvrelay.disagg.connector import HandshakeError, KVConnector
from kvrelay.disagg.params import KVTransferConfig
from kvrelay.disagg.worker import LoadEvent
from kvrelay.kv_cache.manager import KVCacheGroup
from kvrelay.kv_cache.spec import KVCacheSpec

SPEC = KVCacheSpec("tiny:abc", "float32", 4, 2, 2, 8, hybrid=False, sliding_window=None)
NB = 10


class FakeLink:
    """Ranks 1..tp-1 of an engine: metadata copies of rank 0's, events fed by the test."""

    def __init__(self, tp: int) -> None:
        self.tp, self.events, self.setup, self.sent = tp, [], None, []

    def start_kv(self, setup, own):
        self.setup = setup
        return [own] * self.tp

    def send_kv(self, work):
        self.sent.append(work)

    def kv_events(self):
        out, self.events = self.events, []
        return out


def tcp(role: str) -> KVTransferConfig:
    return KVTransferConfig(kv_connector="TcpConnector", kv_role=role, backends=("TCP",),
                            lease_s=60)


def tensors(heads: int) -> list[torch.Tensor]:
    return [torch.randn(2, NB, heads, 4, 8) for _ in range(2)]


@pytest.fixture()
def pair(monkeypatch):
    monkeypatch.setenv("VLLM_NIXL_SIDE_CHANNEL_PORT", "0")
    made = []

    def make(prefill_tp: int, decode_tp: int):
        prefill = KVConnector(tcp("kv_producer"), "P", SPEC, tensors(2 // prefill_tp), prefill_tp,
                              FakeLink(prefill_tp) if prefill_tp > 1 else None)
        decode = KVConnector(tcp("kv_consumer"), "D", SPEC, tensors(2 // decode_tp), decode_tp,
                             FakeLink(decode_tp) if decode_tp > 1 else None)
        made.extend([prefill, decode])
        return prefill, decode

    yield make
    for c in made:
        c.close()


def params(prefill: KVConnector, rid: str, blocks: list[int]) -> SimpleNamespace:
    held = prefill.hold(rid, [blocks], list(range(10)))
    return SimpleNamespace(remote_block_ids=[blocks], **held)


def wait_loads(decode: KVConnector, timeout: float = 10) -> list:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done = decode.poll_loads()
        if done:
            return done
        time.sleep(0.005)
    return []


def test_load_waits_for_every_rank_and_prefill_for_every_notice(pair):
    prefill, decode = pair(1, 2)
    p = params(prefill, "r1", [3, 4, 5])
    decode.start_load("d1", p, [[7, 8, 9]], [KVCacheGroup(None, 2)], 0, 10, 4)
    [work] = decode.link.sent                                # sent at once, with the new peer
    assert [o.request_id for o in work.pulls] == ["d1"] and work.peers[0].tp_size == 1
    assert decode.take_work() is None
    assert work.pulls[0].notify == f"r1:2:{p.remote_capability}".encode()
    deadline = time.monotonic() + 10
    while decode.loads["d1"].waiting != {1} and time.monotonic() < deadline:
        assert decode.poll_loads() == []                    # not done while rank 1 is not
        time.sleep(0.005)
    assert decode.loads["d1"].waiting == {1}                # rank 0's read is done
    decode.link.events.append(("load", LoadEvent(1, "d1", None, 1234)))
    assert decode.poll_loads() == [("d1", None)]
    assert decode.stats.transfers == 1 and decode.stats.bytes == 3 * 2 * 2 * 1 * 4 * 8 * 4 + 1234
    # rank 0's notice reached the prefill; the second decode rank's is still missing
    deadline = time.monotonic() + 5
    done = []
    while not prefill.held.notices and time.monotonic() < deadline:
        done += prefill.read_done()
        time.sleep(0.01)
    assert done == [] and prefill.held.notices["r1"] == 1
    # the other decode rank read from the same prefill rank: its notice arrives there too
    prefill.transport._notifs.append(f"r1:2:{p.remote_capability}".encode())
    assert prefill.read_done() == ["r1"]


def test_a_failed_rank_fails_the_load_and_cancels_the_others(pair):
    prefill, decode = pair(1, 2)
    p = params(prefill, "r2", [3])
    decode.start_load("d2", p, [[5]], [KVCacheGroup(None, 2)], 0, 5, 4)
    decode.link.events.append(("load", LoadEvent(1, "d2", "rank 1: peer went away", 0)))
    done = wait_loads(decode)
    assert done == [("d2", "rank 1: peer went away")] and decode.stats.failed == 1
    late = ("load", LoadEvent(0, "d2", None, 10))          # a late report is ignored
    decode.link.events.append(late)
    assert decode.poll_loads() == []


def test_abort_while_loading_cancels_every_rank(pair):
    prefill, decode = pair(1, 2)
    p = params(prefill, "r3", [3])
    decode.start_load("d3", p, [[5]], [KVCacheGroup(None, 2)], 0, 5, 4)
    decode.cancel("d3", p)
    assert decode.take_work().cancels == ["d3"] and "d3" not in decode.loads
    deadline = time.monotonic() + 5
    freed = []
    while not freed and time.monotonic() < deadline:
        freed = prefill.read_done()                        # the release message frees it at once
        time.sleep(0.01)
    assert freed == ["r3"]


def test_prefill_tp_above_decode_tp_is_refused_on_both_sides(pair, caplog):
    prefill, decode = pair(2, 1)
    p = params(prefill, "r4", [3])
    with pytest.raises(HandshakeError, match="tensor_parallel_size: prefill 2, decode 1"):
        decode.start_load("d4", p, [[5]], [KVCacheGroup(None, 2)], 0, 5, 4)
    assert "tensor_parallel_size: prefill 2, decode 1" in caplog.text      # the prefill logged it
    assert decode.stats.handshake_errors == 1 and not decode.loads


def test_handshake_carries_every_rank(pair):
    prefill, decode = pair(2, 2)
    p = params(prefill, "r5", [3])
    decode.start_load("d5", p, [[5]], [KVCacheGroup(None, 2)], 0, 5, 4)
    peer = decode.peers["P"]
    assert peer.tp_size == 2 and len(peer.ranks) == 2 and peer.num_blocks == NB
    assert decode.local.peers["P"][1].src_rank == 0  # rank 0 reads prefill rank 0


@pytest.mark.parametrize("tamper, problem", [
    ({"tp_size": "1"}, "prefill sent tp_size '1'"),
    ({"ranks": []}, "prefill sent transport metadata for 0 of its 1 ranks"),
    ({"compat_hash": "x"}, "compatibility hash differs"),
])
def test_decode_refuses_a_malformed_handshake_reply(pair, monkeypatch, tamper, problem):
    from kvrelay.disagg import connector
    prefill, decode = pair(1, 1)
    real = connector.side_channel_call
    monkeypatch.setattr(connector, "side_channel_call",
                        lambda *a, **kw: real(*a, **kw) | tamper)
    with pytest.raises(HandshakeError, match=f"incompatible KV cache: {problem}"):
        decode.peer("P", *prefill.advertised)
    assert decode.stats.handshake_errors == 1 and "P" not in decode.peers
