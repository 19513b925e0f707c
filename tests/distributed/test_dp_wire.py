"""The head ⇄ headless wire format: JSON frames that round-trip every engine message,
and the hello checks that name what differs."""
from __future__ import annotations

import socket

import pytest

from kvrelay.engine.dp_remote import (
    VERSION,
    FrameError,
    check_hello,
    decode,
    encode,
    recv_frame,
    send_frame,
)
from kvrelay.engine.messages import (
    AbortRequests,
    AddRequest,
    EngineInfo,
    EngineStats,
    Fatal,
    Freed,
    FreeRemote,
    Message,
    Ready,
    RequestRefused,
    Shutdown,
    StepOutputs,
    Wake,
)
from kvrelay.engine.outputs import CompletionOutput, RequestOutput
from kvrelay.engine.request import Logprob
from kvrelay.sampling_params import SamplingParams

LAYOUT = {"data_parallel_size": 4, "tensor_parallel_size": 2, "enable_expert_parallel": True,
          "model_config": "abc"}


def roundtrip(message: Message, replica: int = 3) -> Message:
    a, b = socket.socketpair()
    with a, b:
        send_frame(a, encode(message, replica))
        frame = recv_frame(b)
    assert frame["replica"] == replica
    return decode(frame)


def test_add_round_trips_the_sampling_params():
    params = SamplingParams(n=2, temperature=0.5, top_k=7, seed=3, max_tokens=9, stop=["w1"],
                            stop_token_ids=[4], logprobs=2, ignore_eos=True)
    message = AddRequest("r1", [1, 2, 3], params, {"do_remote_decode": True})
    assert roundtrip(message) == message


def test_outputs_round_trip_with_logprobs():
    lp = {5: Logprob(5, -0.25, 1), 9: Logprob(9, -1.5, 2)}
    out = RequestOutput("r1", "w1 w2", [1, 2], [CompletionOutput(
        0, "", [], "length", None, None, delta_text=" w5", delta_token_ids=[5], delta_logprobs=[lp])],
        prompt_logprobs=[None, lp], num_cached_tokens=4, finished=True, kv_transfer_params={"a": [1]})
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
                                     Fatal("gone"), Ready(INFO, EngineStats(blocks_total=9))])
def test_small_messages_round_trip(message):
    assert roundtrip(message) == message


def test_logits_processors_never_travel():
    params = SamplingParams(logits_processors=[lambda ids, logits: logits])
    with pytest.raises(ValueError, match="logits processors"):
        encode(AddRequest("r", [1], params, None), 1)


def test_malformed_frames_are_refused():
    a, b = socket.socketpair()
    with a, b:
        a.sendall(b"\x00\x00\x00\x03[1]")
        with pytest.raises(FrameError, match="must hold a JSON object"):
            recv_frame(b)
        a.sendall(b"\xff\xff\xff\xff")
        with pytest.raises(FrameError, match="exceeds"):
            recv_frame(b)


def hello(**changes):
    return {"type": "hello", "version": VERSION, "layout": LAYOUT | changes.pop("layout", {}),
            "start_rank": 2, "local_size": 2} | changes


def test_hello_gives_the_node_its_ranks():
    assert check_hello(hello(), LAYOUT, set(), head_local=2) == [2, 3]


@pytest.mark.parametrize("msg,changes,claimed", [
    ("--tensor-parallel-size differs: the head has 2, the headless node 4", {"layout": {"tensor_parallel_size": 4}}, set()),
    ("--enable-expert-parallel differs", {"layout": {"enable_expert_parallel": False}}, set()),
    ("the model's config.json differs", {"layout": {"model_config": "zzz"}}, set()),
    (r"replica ranks \[1, 3\) are not in \[2, 4\)", {"start_rank": 1}, set()),
    (r"replica ranks \[3, 5\) are not in \[2, 4\)", {"start_rank": 3}, set()),
    ("replica rank 3 is already run by another headless node", {}, {3}),
    (f"expected a version {VERSION} hello", {"version": 99}, set()),
])
def test_hello_mismatches_are_named(msg, changes, claimed):
    with pytest.raises(ValueError, match=msg):
        check_hello(hello(**changes), LAYOUT, claimed, head_local=2)
