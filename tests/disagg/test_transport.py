"""KV transports between two real processes: scattered block reads land exactly, untouched
memory stays zero, the producer hears the notice, bad descriptors fail cleanly."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from kvrelay.disagg.transport import ReadDesc, TransferError
from tests.disagg.conftest import needs_nixl
from tests.disagg.peer import DTYPES, SHAPE, Producer, make, producer, source_tensors

KINDS = ["tcp", pytest.param("nixl", marks=needs_nixl)]


def byte_view(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


def block_bytes(t: torch.Tensor) -> int:
    """Bytes of one block of one K or V half: kv_heads × block_size × head_dim × elem."""
    return t[0, 0].numel() * t.element_size()


def desc(t: torch.Tensor, region: int, kv: int, src: int, dst: int, head: int | None = None,
         tokens: int | None = None) -> ReadDesc:
    """Block `src` → block `dst` of the K (kv=0) or V (kv=1) half of region `region`;
    with `head`, only that head's first `tokens` tokens (a sub-block byte range)."""
    nb, bb = t.shape[1], block_bytes(t)
    base_r, base_l = (kv * nb + src) * bb, (kv * nb + dst) * bb
    if head is None:
        return ReadDesc(region, base_r, base_l, bb)
    head_bytes = t[0, 0, 0].numel() * t.element_size()
    tok_bytes = t.shape[-1] * t.element_size()
    off = head * head_bytes
    return ReadDesc(region, base_r + off, base_l + off, (tokens or t.shape[3]) * tok_bytes)


def scattered_descs(src: list[torch.Tensor]) -> list[ReadDesc]:
    out = []
    for region, t in enumerate(src):
        for s, d in [(3, 1), (7, 5), (8, 9), (12, 14)]:          # non-contiguous ids, remapped
            out += [desc(t, region, 0, s, d), desc(t, region, 1, s, d)]
    out.append(desc(src[1], 1, 1, 10, 2, head=1, tokens=2))    # part of one head of a block
    return out


def apply(descs: list[ReadDesc], src: list[torch.Tensor], dst: list[torch.Tensor]) -> None:
    for d in descs:
        byte_view(dst[d.region])[d.local_offset:d.local_offset + d.nbytes] = \
            byte_view(src[d.region])[d.remote_offset:d.remote_offset + d.nbytes]


@pytest.fixture(scope="module", params=KINDS)
def pair(request):
    """(producer process, consumer transport in this process with the peer added)."""
    kind = request.param
    prod = Producer(kind)
    try:
        consumer = make(kind, "consumer-test")
        try:
            consumer.register([torch.zeros(SHAPE, dtype=dt) for dt in DTYPES])
            md = prod.call({"op": "metadata"})["transport"]
            consumer.add_peer("prefill-0", md)
            consumer.add_peer("prefill-0", md)                 # idempotent
            yield prod, consumer, md
        finally:
            consumer.close()
    finally:
        prod.stop()
    # a clean stop is a clean exit (NIXL's bundled UCX used to segfault at process exit)
    assert prod.proc.exitcode == 0


def read(consumer, descs, notify=b"n", peer="prefill-0"):
    h = consumer.start_read(peer, descs, notify)
    try:
        consumer.wait(h, timeout=20)
    finally:
        consumer.release(h)
    return h


def test_scattered_read_is_exact(pair):
    prod, consumer, _ = pair
    src = source_tensors()
    dst = [torch.zeros(SHAPE, dtype=dt) for dt in DTYPES]
    local = consumer._tensors if consumer.name == "nixl" else None
    descs = scattered_descs(src)
    h = read(consumer, descs, notify=b"req-1:done")
    assert h.nbytes == sum(d.nbytes for d in descs) and h.seconds is not None
    apply(descs, src, dst)
    got = local or [f.view(dt).reshape(SHAPE) for f, dt in zip(consumer._flat, DTYPES)]
    for g, e in zip(got, dst):
        assert torch.equal(byte_view(g), byte_view(e))           # copied bytes exact, rest zero
    assert byte_view(got[0]).count_nonzero() > 0
    assert b"req-1:done" in prod.notifications(want=b"req-1:done")
    # a second read with the same peer reuses the connection / agent
    read(consumer, [desc(src[0], 0, 0, 15, 15)], notify=b"req-2")
    assert torch.equal(got[0][0, 15], src[0][0, 15])
    assert b"req-2" in prod.notifications(want=b"req-2")


def test_empty_read_only_notifies(pair):
    prod, consumer, _ = pair
    h = read(consumer, [], notify=b"nothing-to-pull")
    assert h.nbytes == 0
    assert b"nothing-to-pull" in prod.notifications(want=b"nothing-to-pull")


def test_out_of_bounds_descriptors_fail_and_producer_keeps_serving(pair):
    prod, consumer, md = pair
    src = source_tensors()
    size = [t.numel() * t.element_size() for t in src]
    bad = [
        ReadDesc(0, size[0] - 8, 0, 16),              # past the end of the peer's region
        ReadDesc(1, 0, size[1] - 8, 16),              # past the end of the local region
        ReadDesc(2, 0, 0, 16),                        # no such region
        ReadDesc(0, -16, 0, 16),                      # negative offset
        ReadDesc(0, 0, 0, 0),                         # empty
    ]
    for d in bad:
        with pytest.raises(TransferError, match="descriptor 0"):
            consumer.start_read("prefill-0", [d], b"x")
    with pytest.raises(TransferError, match="unknown peer"):
        consumer.start_read("nobody", [desc(src[0], 0, 0, 1, 1)], b"x")

    # a peer lying about its region sizes gets past this side's checks: the producer
    # (TCP) or NIXL's registration check refuses the read
    lying = dict(md)
    if md["transport"] == "tcp":
        lying["regions"] = [n * 4 for n in md["regions"]]
    else:
        lying["regions"] = [[a, n * 4, d] for a, n, d in md["regions"]]
    consumer.add_peer("liar", lying)
    with pytest.raises(TransferError):
        h = consumer.start_read("liar", [ReadDesc(0, size[0] * 2, 0, 64)], b"x")
        try:
            consumer.wait(h, timeout=20)
        finally:
            consumer.release(h)
    consumer.remove_peer("liar")

    # still serving
    read(consumer, [desc(src[0], 0, 1, 4, 4)], notify=b"after-bad")
    assert b"after-bad" in prod.notifications(want=b"after-bad")
    assert b"x" not in prod.notifications()


def test_metadata_of_other_transport_is_refused():
    from kvrelay.disagg.tcp import TcpTransport
    with TcpTransport() as t:
        t.register([torch.zeros(4)])
        with pytest.raises(TransferError,
                           match="uses KV transport 'nixl' but this side uses 'tcp'"):
            t.add_peer("p", {"transport": "nixl", "version": 1})
        with pytest.raises(TransferError, match="version"):
            t.add_peer("p", {"transport": "tcp", "version": 99})
        with pytest.raises(TransferError, match="port"):
            t.add_peer("p", {"transport": "tcp", "version": 1, "host": "h", "port": "x",
                             "regions": [16]})


def test_register_rejects_unusable_tensors():
    from kvrelay.disagg.tcp import TcpTransport
    with TcpTransport() as t:
        with pytest.raises(ValueError, match="contiguous"):
            t.register([torch.zeros(4, 4).t()])
        with pytest.raises(ValueError, match="at least one"):
            t.register([])
        t.register([torch.zeros(4)])
        with pytest.raises(TransferError, match="only once"):
            t.register([torch.zeros(4)])


def test_descriptor_fields_must_be_ints():
    from kvrelay.disagg.tcp import TcpTransport
    with TcpTransport() as a, TcpTransport() as b:
        a.register([torch.ones(64)])
        b.register([torch.zeros(64)])
        b.add_peer("a", a.metadata())
        with pytest.raises(TransferError, match="non-integer"):
            b.start_read("a", [dataclasses.replace(ReadDesc(0, 0, 0, 4), nbytes=4.0)], b"")
        with pytest.raises(TransferError, match="ReadDesc"):
            b.start_read("a", [(0, 0, 0, 4)], b"")
        with pytest.raises(TransferError, match="notify"):
            b.start_read("a", [], 5)


@needs_nixl
def test_read_from_a_crashed_producer_fails_cleanly():
    """NIXL reports the dead peer (no hang). TCP: test_tcp_wire's dead-peer test."""
    kind = "nixl"
    src = source_tensors()
    with producer(kind) as prod:
        consumer = make(kind, "consumer-crash")
        try:
            consumer.register([torch.zeros(SHAPE, dtype=dt) for dt in DTYPES])
            consumer.add_peer("p", prod.call({"op": "metadata"})["transport"])
            read(consumer, [desc(src[0], 0, 0, 1, 1)], peer="p")       # connected
            prod.proc.kill()
            prod.proc.join(10)
            with pytest.raises(TransferError):
                read(consumer, [desc(src[0], 0, 0, 2, 2)], peer="p")
        finally:
            consumer.close()
