"""Per-step work: the engine→API message per step, and the sampler's all-greedy fast path."""

from __future__ import annotations

import asyncio

import torch

from kvrelay import SamplingParams
from kvrelay.engine.codec import encode
from kvrelay.engine.core_client import CoreClient, _Stream
from kvrelay.engine.core_proc import _deltas
from kvrelay.engine.request import Request
from kvrelay.engine.sampler import Sampler


def test_prompt_travels_once_and_the_client_still_sees_it(make_llm):
    llm = make_llm()
    engine = llm.engine
    prompt = [(7 * i) % 150 + 5 for i in range(100)]
    engine.add_request("r", prompt, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    announced: set[str] = set()
    messages = []
    while engine.has_unfinished_requests():
        messages += _deltas(engine.step(), announced)
    assert len(messages) == 6 and not announced  # finished requests are forgotten
    first, later = messages[0], messages[1:]
    assert first.prompt_token_ids == prompt
    assert all(m.prompt_token_ids == [] and m.prompt is None for m in later)
    # a later message does not carry the 100-token prompt
    assert len(encode(later[0])) < len(encode(first)) - 100
    tokens = [t for m in messages for t in m.outputs[0].delta_token_ids]
    stream = _Stream(asyncio.Queue())
    for m in messages:
        acc = CoreClient._accumulate(stream, m)
    assert acc.prompt_token_ids == prompt and acc.finished
    assert acc.outputs[0].token_ids == tokens and len(tokens) == 6


def _request(rid: str, **params) -> Request:
    return Request(rid, [1, 2], SamplingParams(max_tokens=8, **params), eos_token_ids=(3,))


def test_greedy_fast_path_keeps_bans_and_logprobs():
    logits = torch.zeros(3, 10)
    logits[:, 3] = 5.0  # EOS is every row's argmax
    logits[:, 7] = 4.0
    reqs = [
        _request("plain", temperature=0),
        _request("min", temperature=0, min_tokens=2),
        _request("lp", temperature=0, logprobs=1),
    ]
    out = Sampler()(logits, reqs)
    assert out.token_ids == [3, 7, 3]  # min_tokens bans EOS for the second row only
    assert out.logprobs[0] is None and out.logprobs[1] is None and 3 in out.logprobs[2]
    fast = Sampler()(logits[:2], [reqs[0], reqs[0]])
    assert fast.token_ids == [3, 3] and fast.logprobs == [None, None]


def test_small_steps_run_on_one_thread(make_llm):
    runner = make_llm().engine.runner
    before = torch.get_num_threads()
    try:
        runner.max_threads, runner.single_thread_macs = 2, 1e6
        small = int(1e6 // runner.token_macs) - 1  # just under the threshold
        runner._set_threads(small, 0)
        assert torch.get_num_threads() == 1
        runner._set_threads(small + 2, 1)  # over it: all threads again
        assert torch.get_num_threads() == 2
        runner.single_thread_macs = 0.0  # 0 turns the policy off
        runner._set_threads(1, 1)
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
