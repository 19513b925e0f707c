"""The head ⇄ headless wire format: msgpack frames (engine/codec.py) that round-trip every
engine message, and the hello checks that name what differs."""
from __future__ import annotations

import asyncio
import socket
import threading

import msgspec
import pytest

from kvrelay.engine.client import EngineDeadError
from kvrelay.engine.codec import CodecError
from kvrelay.engine.dp_link import (
    VERSION,
    check_hello,
    decode,
    encode,
    from_node,
    handshake,
    recv_message,
    send_message,
    to_node,
)
from kvrelay.engine.dp_remote import RemoteReplica
from kvrelay.engine.messages import (
    AbortRequests,
    AddRequest,
    EngineInfo,
    EngineStats,
    Fatal,
    Freed,
    FreeRemote,
    Hello,
    Layout,
    Message,
    Ready,
    Reject,
    RequestRefused,
    Shutdown,
    StepOutputs,
    Wake,
    Welcome,
)
from kvrelay.engine.outputs import CompletionOutput, RequestOutput
from kvrelay.engine.request import Logprob
from kvrelay.framing import FrameError
from kvrelay.sampling_params import SamplingParams

LAYOUT = Layout(data_parallel_size=4, tensor_parallel_size=2, enable_expert_parallel=True,
                model_config="abc")


def roundtrip(message: Message, replica: int = 3) -> Message:
    a, b = socket.socketpair()
    with a, b:
        send_message(a, encode(message, replica))
        frame = recv_message(b)
    assert msgspec.msgpack.decode(frame)[0] == replica
    return decode(frame)


def test_add_round_trips_the_sampling_params():
    params = SamplingParams(n=2, temperature=0.5, top_k=7, seed=3, max_tokens=9, stop=["w1"],
                            stop_token_ids=[4], logprobs=2, ignore_eos=True)
    message = AddRequest("r1", [1, 2, 3], params, {"do_remote_decode": True})
    assert roundtrip(message) == message


def test_outputs_round_trip_with_logprobs():
    lp = {5: Logprob(5, -0.25, 1), 9: Logprob(9, -1.5, 2)}
    out = RequestOutput("r1", "w1 w2", [1, 2], [CompletionOutput(
        0, "", [], "length", None, None, delta_text=" w5", delta_token_ids=[5],
        delta_logprobs=[lp])], prompt_logprobs=[None, lp], num_cached_tokens=4, finished=True,
                        kv_transfer_params={"a": [1]})
    stats = EngineStats(num_steps=3, kv_transfers=2, kv_cache_usage_perc=0.5)
    got = roundtrip(StepOutputs([out], stats))
    assert got == StepOutputs([out], stats)
    assert got.stats["kv_transfers"] == 2 and "kv_handshakes" not in got.stats


INFO = EngineInfo(max_model_len=96, model_dir="/m", pid=7, vocab_size=201088,
                  kv_cache_spec={"block_size": 16}, native={"kernels": {"moe": "avx2"}})


@pytest.mark.parametrize("message", [AbortRequests(["a", "b"]), Wake(7),
                                     FreeRemote("x", "cap", 3), Freed(3, True), Shutdown(),
                                     RequestRefused("r1", "bad"),
                                     RequestRefused("r2", "no", 500, None),
                                     RequestRefused("r3", "bad", 400, "stop_token_ids"),
                                     Fatal("gone"), Ready(INFO, EngineStats(blocks_total=9)),
                                     Hello(VERSION, LAYOUT, 2, 2), Welcome(None), Welcome(29500),
                                     Reject("--tensor-parallel-size differs")])
def test_small_messages_round_trip(message):
    assert roundtrip(message) == message


def test_logits_processors_never_travel():
    params = SamplingParams(logits_processors=[lambda ids, logits: logits])
    with pytest.raises(ValueError, match="logits processors"):
        encode(AddRequest("r", [1], params, None), 1)


def test_each_side_takes_only_its_direction():
    assert to_node(encode(Wake(2), 3)) == (3, Wake(2))
    assert from_node(encode(Freed(1, True), 2)) == (2, Freed(1, True))
    with pytest.raises(CodecError):
        to_node(encode(Fatal("x"), 3))                  # the head never sends a core's message
    with pytest.raises(CodecError):
        from_node(encode(Shutdown(), 3))
    with pytest.raises(CodecError):
        handshake(encode(Shutdown(), 3))                # a handshake frame has no replica


def test_malformed_frames_are_refused():
    a, b = socket.socketpair()
    with a, b:
        a.sendall(b"\x00\x00\x00\x03[1]")
        with pytest.raises(CodecError, match="malformed"):
            decode(recv_message(b))
        a.sendall(b"\xff\xff\xff\xff")
        with pytest.raises(FrameError, match="exceeds"):
            recv_message(b)


def hello(**changes):
    """A hello as it arrives: a frame through the codec."""
    layout = msgspec.structs.replace(LAYOUT, **changes.pop("layout", {}))
    return handshake(encode(Hello(**({"version": VERSION, "layout": layout, "start_rank": 2,
                                       "local_size": 2} | changes))))


def test_hello_gives_the_node_its_ranks():
    assert check_hello(hello(), LAYOUT, set(), head_local=2) == [2, 3]


@pytest.mark.parametrize("msg,changes,claimed", [
    ("--tensor-parallel-size differs: the head has 2, the headless node 4",
     {"layout": {"tensor_parallel_size": 4}}, set()),
    ("--enable-expert-parallel differs", {"layout": {"enable_expert_parallel": False}}, set()),
    ("the model's config.json differs", {"layout": {"model_config": "zzz"}}, set()),
    (r"replica ranks \[1, 3\) are not in \[2, 4\)", {"start_rank": 1}, set()),
    (r"replica ranks \[3, 5\) are not in \[2, 4\)", {"start_rank": 3}, set()),
    ("replica rank 3 is already run by another headless node", {}, {3}),
    (f"expected a version {VERSION} hello", {"version": 99}, set()),
])
def test_hello_mismatches_are_named(msg, changes, claimed):
    """A node of another layout or rank range is refused with the flag that differs."""
    with pytest.raises(ValueError, match=msg):
        check_hello(hello(**changes), LAYOUT, claimed, head_local=2)


class FakeNode:
    """A headless node that answers frees at once, from another thread (as its reader does)."""

    closed = False

    def __init__(self) -> None:
        self.replica: RemoteReplica | None = None
        self.sent: list[Message] = []

    def send(self, frame: bytes) -> None:
        message = decode(frame)
        self.sent.append(message)
        if isinstance(message, FreeRemote):
            threading.Thread(target=self.replica.receive,
                             args=(Freed(message.token, message.capability == "cap"),)).start()


def test_a_remote_replica_answers_frees_and_fails_its_streams_when_lost():
    """A replica on a headless node is a whole engine client: an explicit free gets its
    answer, and losing the node fails the requests in flight on it (EngineDeadError)."""

    async def main() -> None:
        replica, node = RemoteReplica(2), FakeNode()
        replica.node, node.replica = node, replica
        replica.start()
        assert await asyncio.wait_for(replica.free_remote("r1", "cap"), 5) is True
        assert await asyncio.wait_for(replica.free_remote("r1", "other"), 5) is False
        gen = replica.generate("r2", [1, 2], SamplingParams(max_tokens=2))
        pending = asyncio.ensure_future(gen.__anext__())
        await asyncio.sleep(0.05)
        replica.receive(Fatal("data-parallel replica 2: lost the headless node"))
        with pytest.raises(EngineDeadError, match="lost the headless node"):
            await asyncio.wait_for(pending, 5)
        assert replica.dead and isinstance(node.sent[-1], AddRequest)
        replica.shutdown()
        assert isinstance(node.sent[-1], Shutdown)

    asyncio.run(main())


def test_a_malformed_or_foreign_first_frame_is_refused():
    short_hello = msgspec.msgpack.encode([None, ["hello", VERSION, None, 2]])
    with pytest.raises(ValueError, match="malformed engine message"):
        handshake(short_hello)
    with pytest.raises(ValueError, match="malformed engine message"):
        handshake(b'{"type": "hello", "version": 2}')      # a version 2 node's JSON frame
    with pytest.raises(ValueError, match="expected a version 3 hello, got 'welcome'"):
        check_hello(Welcome(None), LAYOUT, set(), head_local=2)
