"""One request's failure inside the engine fails that request alone: the others in
the same steps produce exactly what they produce without it, no block leaks, and only
an inconsistent KV pool is fatal."""
from __future__ import annotations

import pytest

from kvrelay import SamplingParams
from kvrelay.sampling_params import SamplingParamsError
from tests.faults import ADD_FAULT, SAMPLE_FAULT, InjectedFault, poison_forward

PROMPTS = [[5, 17, 29, 40, 41, 42, 77, 90, 91, 12, 13], [100, 101, 7], list(range(20, 50))]
GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
SEEDED = SamplingParams(temperature=1.0, seed=42, max_tokens=10, ignore_eos=True)


def run(engine, requests: dict[str, tuple[list[int], SamplingParams]]) -> dict:
    for request_id, (prompt, params) in requests.items():
        engine.add_request(request_id, prompt, params)
    finals = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
    assert set(finals) == set(requests)
    return finals


def clean_tokens(make_llm) -> dict[str, list[int]]:
    finals = run(make_llm().engine, {"g": (PROMPTS[0], GREEDY), "s": (PROMPTS[1], SEEDED)})
    return {k: v.outputs[0].token_ids for k, v in finals.items()}


def test_a_request_failing_in_sampling_fails_alone(make_llm):
    """The faulty request shares every step with a greedy and a seeded request; the
    batch is re-sampled row by row with the seeded generator rewound, so both produce
    the tokens of a run without the faulty request."""
    want = clean_tokens(make_llm)
    engine = make_llm(logits_processors=["tests.faults:inject"]).engine
    finals = run(engine, {"g": (PROMPTS[0], GREEDY), "bad": ([SAMPLE_FAULT, 5, 6], SEEDED),
                          "s": (PROMPTS[1], SEEDED)})
    bad = finals["bad"]
    assert bad.error_status == 500 and "InjectedFault" in bad.error
    assert bad.outputs[0].finish_reason == "abort"
    assert {k: finals[k].outputs[0].token_ids for k in ("g", "s")} == want
    assert engine.parents == {} and engine.child_parent == {}


def test_every_sequence_of_an_n_request_fails_with_it(make_llm):
    engine = make_llm(logits_processors=["tests.faults:inject"]).engine
    finals = run(engine, {"bad": ([SAMPLE_FAULT, 5, 6], SamplingParams(n=3, max_tokens=5)),
                          "g": (PROMPTS[0], GREEDY)})
    assert finals["bad"].error and len(finals["bad"].outputs) == 3
    assert len(finals["g"].outputs[0].token_ids) == 10 and finals["g"].error is None


def test_a_request_failing_in_the_forward_fails_alone(make_llm, monkeypatch):
    """A forward that raises whenever it sees the poisoned token: each chunk is re-run
    alone, the poisoned one fails, the others keep their logits."""
    want = clean_tokens(make_llm)
    engine = make_llm().engine
    poison_forward(engine, monkeypatch)
    finals = run(engine, {"g": (PROMPTS[0], GREEDY), "bad": ([9, SAMPLE_FAULT, 6], GREEDY),
                          "s": (PROMPTS[1], SEEDED)})
    assert finals["bad"].error_status == 500 and "the model forward" in finals["bad"].error
    assert {k: finals[k].outputs[0].token_ids for k in ("g", "s")} == want


def test_a_forward_failing_for_every_request_is_fatal(make_llm, monkeypatch):
    engine = make_llm().engine

    def broken(step):
        raise InjectedFault("the device is gone")
    monkeypatch.setattr(engine.runner, "execute", broken)
    engine.add_request("a", PROMPTS[0], GREEDY)
    engine.add_request("b", PROMPTS[1], GREEDY)
    with pytest.raises(InjectedFault, match="the device is gone"):
        engine.step()
    for request_id in ("a", "b"):                      # leave the engine clean for the leak check
        engine.abort_request(request_id)


def test_a_failure_that_breaks_the_kv_pool_is_fatal(make_llm, monkeypatch):
    engine = make_llm(logits_processors=["tests.faults:inject"]).engine
    engine.add_request("bad", [SAMPLE_FAULT, 5, 6], GREEDY)

    def corrupt():
        raise AssertionError("free + used != total")
    monkeypatch.setattr(engine.kv, "check_integrity", corrupt)
    with pytest.raises(AssertionError, match="free \\+ used"):
        engine.step()
    monkeypatch.undo()


def test_a_request_failing_while_added_leaves_nothing_behind(make_llm):
    engine = make_llm(logits_processors=["tests.faults:inject"]).engine
    with pytest.raises(InjectedFault):
        engine.add_request("bad", [ADD_FAULT, 5], SamplingParams(n=2))
    assert engine.parents == {} and not engine.has_unfinished_requests()
    assert run(engine, {"bad": (PROMPTS[0], GREEDY)})["bad"].error is None   # the id is free again


def test_request_ids_in_use_are_refused(make_llm):
    engine = make_llm().engine
    engine.add_request("a", PROMPTS[0], GREEDY)
    with pytest.raises(ValueError, match="duplicate request id 'a'"):
        engine.add_request("a", PROMPTS[1], GREEDY)
    with pytest.raises(ValueError, match="duplicate request id '0_b'"):   # n > 1 child ids too
        engine.add_request("0_b", PROMPTS[1], GREEDY)
        engine.add_request("b", PROMPTS[1], SamplingParams(n=2, max_tokens=2))
    assert set(engine.parents) == {"a", "0_b"}          # "b" added none of its sequences
    while engine.has_unfinished_requests():
        engine.step()


@pytest.mark.parametrize("params,prompt,param", [
    (SamplingParams(stop_token_ids=[160], min_tokens=2, max_tokens=4), PROMPTS[0],
     "stop_token_ids"),
    (SamplingParams(logit_bias={999: 1.0}), PROMPTS[0], "logit_bias"),
    (SamplingParams(), [5, 160], "prompt"),
    (SamplingParams(), [-1, 5], "prompt"),
    (SamplingParams(logprobs=161), PROMPTS[0], "logprobs"),
])
def test_out_of_vocabulary_ids_are_refused_at_add(make_llm, params, prompt, param):
    engine = make_llm(max_logprobs=-1).engine
    with pytest.raises(SamplingParamsError) as e:
        engine.add_request("x", prompt, params)
    assert e.value.param == param
    assert not engine.has_unfinished_requests()


def test_vllm_sampling_edges(make_llm):
    """temperature below 1e-5 is greedy; top_k at least the vocabulary is off; logit_bias
    shifts logits (clamped to ±100)."""
    llm = make_llm()
    greedy = llm.generate([PROMPTS[0]], GREEDY)[0].outputs[0].token_ids
    tiny_t = SamplingParams(temperature=1e-45, max_tokens=10, ignore_eos=True)
    assert llm.generate([PROMPTS[0]], tiny_t)[0].outputs[0].token_ids == greedy
    big_k = SamplingParams(temperature=1.0, seed=3, top_k=10_000, max_tokens=10, ignore_eos=True)
    off_k = SamplingParams(temperature=1.0, seed=3, top_k=-1, max_tokens=10, ignore_eos=True)
    assert (llm.generate([PROMPTS[0]], big_k)[0].outputs[0].token_ids
            == llm.generate([PROMPTS[0]], off_k)[0].outputs[0].token_ids)
    biased = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logit_bias={"7": 1e6})
    assert biased.logit_bias == {7: 100.0}
    assert llm.generate([PROMPTS[0]], biased)[0].outputs[0].token_ids == [7] * 4


def test_engine_errors_keep_status_and_param_across_nodes():
    """A refusal from a replica on a headless node reaches the API with its field."""
    from kvrelay.engine.dp_link import decode, encode
    from kvrelay.engine.messages import RequestRefused
    for message in (RequestRefused("r1", "stop_token_ids out of range", 400, "stop_token_ids"),
                    RequestRefused("r2", "the engine could not add the request", 500, None)):
        assert decode(encode(message, 0)) == message


def test_a_held_prefill_request_keeps_its_id(make_llm, monkeypatch):
    """A finished prefill request holding its blocks for a decode still owns its id: a
    second request with that id (a gateway retry) used to hit "prefix hit on a
    non-empty table" in the scheduler and kill the engine."""
    from tests.processes import free_port
    monkeypatch.setenv("VLLM_NIXL_SIDE_CHANNEL_PORT", str(free_port()))
    engine = make_llm(kv_transfer_config={"kv_connector": "TcpConnector",
                                          "kv_role": "kv_producer"}).engine
    try:
        remote = {"do_remote_decode": True}
        prefill = SamplingParams(temperature=0, max_tokens=1)

        def run_prefill() -> str:
            engine.add_request("p", PROMPTS[0], prefill, remote)
            params = None
            while engine.has_unfinished_requests():
                for out in engine.step():
                    params = out.kv_transfer_params or params
            assert params is not None
            return params["remote_capability"]

        capability = run_prefill()
        assert "p" in engine.scheduler.held
        with pytest.raises(ValueError, match="duplicate request id 'p'"):
            engine.add_request("p", PROMPTS[0], prefill, remote)
        assert engine.free_remote("p", capability)
        capability = run_prefill()                               # free again once released
        assert engine.free_remote("p", capability)
    finally:
        engine.shutdown()
