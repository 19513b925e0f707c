"""--async-scheduling: step N+1 is planned while step N computes (engine/async_steps.py).

The scheduler's part is driven with the fake forward (tests/engine/sched_driver.py):
planned ahead, every request still produces its reference tokens, nothing leaks, and a
request is never planned past the token that ends it by length. The engine's part runs
the real model: greedy tokens equal transformers', and every output field (tokens,
logprobs, text, finish and stop reasons) equals synchronous scheduling's, across every
way a request can end, failures included.
"""
from __future__ import annotations

import pytest
import torch

from kvrelay import SamplingParams
from kvrelay.config import EngineArgs
from kvrelay.engine.scheduler import Scheduler, SchedulerOutput
from tests.engine.conftest import EOS
from tests.engine.sched_driver import (
    FakeForward,
    chunks_of,
    make_scheduler,
    reference,
    request,
)
from tests.engine.test_engine_greedy import GREEDY, _prompts, check_against_reference
from tests.engine.test_isolation import run as finals  # add requests, step to the end
from tests.faults import SAMPLE_FAULT, poison_forward


# -- the scheduler, planned ahead ----------------------------------------------------------
def run_ahead(scheduler: Scheduler, forward: FakeForward,
              max_steps: int = 500) -> list[SchedulerOutput]:
    """The async order: plan N+1 ahead of N, then N lands (fake forward + update)."""
    flight: SchedulerOutput | None = None
    planned = []
    while scheduler.has_unfinished or flight is not None:
        assert len(planned) < max_steps, "no progress"
        plan = scheduler.schedule(flight)
        planned.append(plan)
        if flight is not None:
            scheduler.update(flight, forward(flight))
            scheduler.kv.check_integrity()
        flight = None if plan.is_empty else plan
    return planned


def test_a_running_request_is_planned_one_token_ahead():
    s = make_scheduler(32)
    s.add(request("a", [1, 2, 3, 4, 5], max_tokens=5))
    first = s.schedule()
    assert chunks_of(first) == [("a", 0, 5)]
    ahead = s.schedule(first)
    assert chunks_of(ahead) == [("a", 5, 1)]       # position 5: the token first samples
    assert ahead.chunks[0].pending and ahead.chunks[0].completes
    assert s.requests["a"].num_computed_tokens == 0    # nothing advanced before it lands


def test_a_chunked_prompt_continues_ahead_without_a_pending_token():
    s = make_scheduler(32, budget=4)
    s.add(request("a", list(range(10)), max_tokens=2))
    first = s.schedule()
    ahead = s.schedule(first)
    assert chunks_of(first) == [("a", 0, 4)] and chunks_of(ahead) == [("a", 4, 4)]
    assert not ahead.chunks[0].pending and not ahead.chunks[0].completes


def test_a_request_is_not_planned_past_its_last_token():
    s = make_scheduler(32, max_model_len=9)
    s.add(request("one", [1, 2, 3], max_tokens=1))
    s.add(request("long", [4, 5, 6, 7, 8, 9, 10, 11], max_tokens=50))   # max_model_len 9
    s.add(request("two", [7, 7], max_tokens=2))
    ahead = s.schedule(s.schedule())
    assert [c.request.request_id for c in ahead.chunks] == ["two"]


def test_planned_ahead_every_request_gets_its_reference_tokens():
    """Many requests, a small pool and a small budget: chunked prefills, prefix hits
    and requests waiting for blocks, all planned one step ahead."""
    s = make_scheduler(18, budget=9, max_num_seqs=5)
    g = torch.Generator().manual_seed(3)
    shared = torch.randint(0, 97, (9,), generator=g).tolist()
    prompts = {f"r{i}": (shared if i % 2 else []) + torch.randint(0, 97, (2 + i,), generator=g)
               .tolist() for i in range(10)}
    lengths = {rid: 1 + i % 6 for i, rid in enumerate(prompts)}
    reqs = {rid: request(rid, p, max_tokens=lengths[rid]) for rid, p in prompts.items()}
    for r in reqs.values():
        s.add(r)
    planned = run_ahead(s, FakeForward(s))
    assert any(c.pending for out in planned for c in out.chunks)
    for rid, r in reqs.items():
        assert r.output_token_ids == reference(prompts[rid], lengths[rid]), rid
    s.kv.assert_no_leaks()


def test_nothing_in_flight_is_preempted_and_short_blocks_delay_admission():
    s = make_scheduler(5)                              # 4 usable blocks of 4 slots
    s.add(request("a", list(range(7)), max_tokens=6))  # 2 blocks, needs a 3rd at position 8
    s.add(request("b", list(range(20, 27)), max_tokens=6))
    first = s.schedule()
    assert [c.request.request_id for c in first.chunks] == ["a", "b"]
    s.update(first, {"a": [1], "b": [2]})
    second = s.schedule()                             # both decode position 7 (blocks full)
    third = s.schedule(second)                        # position 8: one more block each
    assert not third.preempted and s.num_preemptions == 0
    assert [c.request.request_id for c in third.chunks] == []
    s.add(request("c", [1, 2], max_tokens=1))
    assert chunks_of(s.schedule(second)) == []        # "c" waits while the running ones wait


# -- the engine ----------------------------------------------------------------------------
@pytest.mark.parametrize("prefix_caching", [True, False])
def test_greedy_matches_transformers(tiny, make_llm, prefix_caching):
    llm = make_llm(async_scheduling=True, enable_prefix_caching=prefix_caching)
    assert llm.engine.pipeline is not None
    prompts = _prompts()
    check_against_reference(tiny[1], prompts, llm.generate(prompts, GREEDY))
    check_against_reference(tiny[1], prompts, llm.generate(prompts, GREEDY))


def test_chunked_prefill_and_short_blocks_match_transformers(tiny, make_llm):
    """Prompts in 7-token chunks, and a pool too small for the batch (requests wait
    for blocks, and are preempted by plans made from idle)."""
    llm = make_llm(async_scheduling=True, max_num_batched_tokens=7, enable_chunked_prefill=True,
                   max_model_len=48, num_gpu_blocks_override=20)
    prompts = _prompts()
    check_against_reference(tiny[1], prompts, llm.generate(prompts, GREEDY))


def fields(out) -> list:
    """Everything a client sees; logprobs as (token, rank) and their values to 1e-4 (the
    batches differ: an n > 1 sibling, say, starts a step later when planned ahead)."""
    def lp(entries):
        return [sorted((t, x.rank, pytest.approx(x.logprob, abs=1e-4)) for t, x in e.items())
                if e else e for e in entries or []]
    return [out.error, out.num_cached_tokens, lp(out.prompt_logprobs)] + [
        (c.token_ids, c.text, c.finish_reason, c.stop_reason, lp(c.logprobs))
        for c in out.outputs]


def test_every_way_of_ending_matches_synchronous_scheduling(make_llm):
    """Stop ids, EOS, stop strings, min_tokens, max_tokens of 1, n = 2 seeded sampling,
    logprobs and prompt logprobs: async scheduling gives every field of the synchronous
    run. The stops are taken from a synchronous run, so requests do end early, and the
    rows planned past their end are dropped."""
    prompts = _prompts()
    free = finals(make_llm().engine, {str(i): (p, GREEDY) for i, p in enumerate(prompts)})
    tokens = {k: v.outputs[0].token_ids for k, v in free.items()}
    text = {k: v.outputs[0].text for k, v in free.items()}
    g = SamplingParams(temperature=0, max_tokens=12)
    requests = {
        "stop_id": (prompts[0], SamplingParams(temperature=0, max_tokens=12,
                                               stop_token_ids=[tokens["0"][3]])),
        "eos": (prompts[1], SamplingParams(temperature=0, max_tokens=12,
                                           stop_token_ids=[EOS, tokens["1"][5]])),
        "min_tokens": (prompts[2], SamplingParams(temperature=0, max_tokens=12, min_tokens=6,
                                                  stop_token_ids=[tokens["2"][1],
                                                                  tokens["2"][7]])),
        "stop_str": (prompts[3], SamplingParams(temperature=0, max_tokens=12,
                                                stop=[text["3"].split()[4]])),
        "one": (prompts[4], SamplingParams(temperature=0, max_tokens=1)),
        "n2": (prompts[5], SamplingParams(n=2, temperature=1.0, seed=9, max_tokens=9,
                                          logprobs=2)),
        "prompt_lp": (prompts[6], SamplingParams(temperature=0, max_tokens=4, prompt_logprobs=1,
                                                 logprobs=1)),
        "plain": (prompts[0][:5], g),
    }
    want = finals(make_llm().engine, requests)
    engine = make_llm(async_scheduling=True).engine
    got = finals(engine, requests)
    for rid in requests:
        assert fields(got[rid]) == fields(want[rid]), rid
    assert want["stop_id"].outputs[0].finish_reason == "stop"
    assert want["stop_str"].outputs[0].stop_reason is not None
    assert engine.pipeline.num_dropped_rows >= 3       # stop_id, eos, min_tokens, stop_str


def test_an_abort_while_the_step_computes_frees_everything(make_llm):
    engine = make_llm(async_scheduling=True).engine
    want = finals(make_llm().engine, {"b": (_prompts()[2], GREEDY)})
    engine.add_request("a", _prompts()[0], GREEDY)
    engine.add_request("b", _prompts()[2], GREEDY)
    assert engine.step() == [] and engine.pipeline.busy       # the first step launched
    engine.step()                                              # the second one, ahead
    engine.abort_request("a")
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            assert out.request_id == "b"
            if out.finished:
                done[out.request_id] = out
    assert done["b"].outputs[0].token_ids == want["b"].outputs[0].token_ids


def test_a_request_failing_in_the_forward_fails_alone(make_llm, monkeypatch):
    """The forward thread's failure is re-run on the main thread chunk by chunk."""
    seeded = SamplingParams(temperature=1.0, seed=42, max_tokens=10, ignore_eos=True)
    clean = {"g": (_prompts()[0], GREEDY), "s": (_prompts()[1], seeded)}
    want = finals(make_llm().engine, clean)
    engine = make_llm(async_scheduling=True).engine
    poison_forward(engine, monkeypatch)
    got = finals(engine, clean | {"bad": ([9, SAMPLE_FAULT, 6], GREEDY)})
    assert got["bad"].error_status == 500 and "the model forward" in got["bad"].error
    assert {k: fields(got[k]) for k in clean} == {k: fields(want[k]) for k in clean}


def test_a_request_failing_in_sampling_fails_alone(make_llm):
    seeded = SamplingParams(temperature=1.0, seed=42, max_tokens=10, ignore_eos=True)
    clean = {"g": (_prompts()[0], GREEDY), "s": (_prompts()[1], seeded)}
    want = finals(make_llm().engine, clean)
    engine = make_llm(async_scheduling=True, logits_processors=["tests.faults:inject"]).engine
    got = finals(engine, clean | {"bad": ([SAMPLE_FAULT, 5, 6], seeded)})
    assert got["bad"].error_status == 500 and "InjectedFault" in got["bad"].error
    assert {k: fields(got[k]) for k in clean} == {k: fields(want[k]) for k in clean}


@pytest.mark.parametrize("extra, words", [
    ({"kv_transfer_config": {"kv_connector": "NixlConnector", "kv_role": "kv_both"}},
     "--kv-transfer-config"),
    ({"enable_expert_parallel": True, "data_parallel_size": 2}, "--enable-expert-parallel"),
])
def test_refused_where_steps_are_coordinated_with_other_processes(extra, words):
    with pytest.raises(ValueError, match=words):
        EngineArgs(async_scheduling=True, **extra)


def test_the_forward_thread_stops_when_the_engine_thread_fails(make_llm, monkeypatch):
    """A failure on the engine thread (here in the scheduler's update) leaves the forward
    thread holding a step that may never draw: shutting down still ends it at once."""
    import time
    engine = make_llm(async_scheduling=True).engine
    engine.add_request("a", _prompts()[0], GREEDY)
    engine.step()                                    # step 1 computes

    def broken(plan, sampled):
        raise RuntimeError("scheduler state is broken")
    monkeypatch.setattr(engine, "update_step", broken)
    with pytest.raises(RuntimeError, match="broken"):
        engine.step()                                # step 2 handed over, never allowed to draw
    started = time.monotonic()
    engine.pipeline.shutdown()
    assert not engine.pipeline._thread.is_alive()
    assert time.monotonic() - started < 5
    engine.abort_request("a")                        # the fixture checks for leaked blocks
    engine.pipeline._flight = None
