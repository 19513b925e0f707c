"""Sampling, logprobs, stops, n > 1, logits processors, aborts and admission errors."""
from __future__ import annotations

import pytest
import torch

from kvrelay import SamplingParams
from tests.engine.conftest import EOS
from tests.factories import reference_logits

PROMPTS = [[5, 17, 29, 40, 41, 42, 77, 90, 91, 12, 13], [100, 101, 7], list(range(20, 50))]


def tokens(out, i=0):
    return out.outputs[i].token_ids


def test_seeded_sampling_is_reproducible_across_runs_and_batches(make_llm):
    params = SamplingParams(temperature=1.0, seed=1234, max_tokens=12, ignore_eos=True)
    alone = make_llm().generate([PROMPTS[0]], params)[0]
    llm = make_llm(max_num_batched_tokens=9)           # different chunking and batch mates
    others = SamplingParams(temperature=0.8, max_tokens=12, ignore_eos=True)
    batch = llm.generate([PROMPTS[1], PROMPTS[0], PROMPTS[2]], [others, params, others])
    assert tokens(batch[1]) == tokens(alone)
    different = make_llm().generate([PROMPTS[0]], SamplingParams(
        temperature=1.0, seed=99, max_tokens=12, ignore_eos=True))[0]
    assert tokens(different) != tokens(alone)


@pytest.mark.parametrize("params", [
    dict(top_k=1), dict(top_p=1e-6), dict(min_p=1.0), dict(temperature=0.0, top_k=50)])
def test_truncation_to_one_token_equals_greedy(make_llm, params):
    llm = make_llm()
    greedy = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    sampled = llm.generate(PROMPTS, SamplingParams(max_tokens=8, ignore_eos=True,
                                                   **({"temperature": 1.0} | params)))
    assert [tokens(o) for o in sampled] == [tokens(o) for o in greedy]


def test_logprobs_match_reference(tiny, make_llm):
    llm = make_llm()
    out = llm.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=5, logprobs=3,
                                                     ignore_eos=True))[0].outputs[0]
    ref = torch.log_softmax(reference_logits(tiny[1], PROMPTS[0] + out.token_ids),
                            -1)[len(PROMPTS[0]) - 1:]
    assert len(out.logprobs) == 5
    for j, (token, lp) in enumerate(zip(out.token_ids, out.logprobs)):
        assert lp[token].rank == 1                      # greedy picks the top token
        assert abs(lp[token].logprob - float(ref[j, token])) < 1e-4
        top3 = ref[j].topk(3).indices.tolist()
        assert set(lp) == set(top3)
        assert [lp[t].rank for t in top3] == [1, 2, 3]


def test_prompt_logprobs_match_reference(tiny, make_llm):
    llm = make_llm(max_num_batched_tokens=8)           # prompt logprobs across chunks
    out = llm.generate([PROMPTS[2]],
                       SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=0))[0]
    ref = torch.log_softmax(reference_logits(tiny[1], PROMPTS[2]), -1)
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(PROMPTS[2])
    for j in range(1, len(PROMPTS[2])):
        token = PROMPTS[2][j]
        assert abs(out.prompt_logprobs[j][token].logprob - float(ref[j - 1, token])) < 1e-4


def test_logprobs_beyond_max_logprobs_are_rejected(make_llm):
    llm = make_llm(max_logprobs=0)
    with pytest.raises(ValueError,
                       match=r"logprobs=1 exceeds the server.s --max-logprobs 0 "
                             r"\(logprobs are disabled"):
        llm.generate([PROMPTS[0]], SamplingParams(logprobs=1))
    llm = make_llm(max_logprobs=2)
    with pytest.raises(ValueError, match=r"logprobs=3 exceeds the server.s --max-logprobs 2"):
        llm.generate([PROMPTS[0]], SamplingParams(logprobs=3))


def test_stop_token_ids_and_min_tokens(make_llm):
    llm = make_llm()
    free = tokens(llm.generate([PROMPTS[0]],
                               SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))[0])
    stop_at = free[4]
    first = free.index(stop_at)
    out = llm.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=10,
                                                    stop_token_ids=[stop_at]))[0].outputs[0]
    assert out.token_ids == free[:first + 1]
    assert (out.finish_reason, out.stop_reason) == ("stop", stop_at)
    banned = llm.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=10,
                                                       min_tokens=first + 1,
                                                       stop_token_ids=[stop_at]))[0].outputs[0]
    assert stop_at not in banned.token_ids[:first + 1]


def force(sequence: list[int]):
    """A logits processor that forces a scripted token sequence."""
    def processor(output_ids, logits):
        forced = torch.full_like(logits, float("-inf"))
        forced[sequence[min(len(output_ids), len(sequence) - 1)]] = 0.0
        return forced
    return processor


def test_logits_processor_forces_a_scripted_sequence_and_eos_stops(make_llm):
    llm = make_llm()
    script = [9, 8, 7, EOS, 6, 5]
    out = llm.generate([PROMPTS[1]],
                       SamplingParams(max_tokens=6, logits_processors=[force(script)]))[0]
    assert (tokens(out), out.outputs[0].finish_reason) == ([9, 8, 7, EOS], "stop")
    out = llm.generate([PROMPTS[1]], SamplingParams(max_tokens=6, ignore_eos=True,
                                                    logits_processors=[force(script)]))[0]
    assert (tokens(out), out.outputs[0].finish_reason) == (script, "length")


def test_stop_strings_are_detected_on_text_and_trimmed(make_llm):
    llm = make_llm()
    script = [11, 22, 33, 44, 55, 66]
    base = SamplingParams(max_tokens=6, ignore_eos=True, logits_processors=[force(script)])
    out = llm.generate([PROMPTS[1]], base)[0].outputs[0]
    # the word tokenizer joins words with spaces, so the completion of a prompt starts with one
    assert out.text == " w11 w22 w33 w44 w55 w66"
    stop = SamplingParams(max_tokens=6, ignore_eos=True, stop=[" w4"],
                          logits_processors=[force(script)])
    out = llm.generate([PROMPTS[1]], stop)[0].outputs[0]
    # " w4" completes with token 44; the text is cut before the stop string
    assert (out.text, out.finish_reason, out.stop_reason) == (" w11 w22 w33", "stop", " w4")
    assert out.token_ids == script[:4]
    keep = SamplingParams(max_tokens=6, ignore_eos=True, stop=["w33"],
                          include_stop_str_in_output=True, logits_processors=[force(script)])
    assert llm.generate([PROMPTS[1]], keep)[0].outputs[0].text == " w11 w22 w33"


def test_text_prompts_are_tokenized(make_llm):
    llm = make_llm()
    out = llm.generate("w5 w17 w29",
                       SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))[0]
    assert out.prompt_token_ids == [5, 17, 29] and out.prompt == "w5 w17 w29"


def test_n_greater_than_one(make_llm):
    llm = make_llm()
    greedy = llm.generate([PROMPTS[2]],
                          SamplingParams(n=3, temperature=0, max_tokens=6, ignore_eos=True))[0]
    assert len(greedy.outputs) == 3 and [o.index for o in greedy.outputs] == [0, 1, 2]
    assert tokens(greedy, 0) == tokens(greedy, 1) == tokens(greedy, 2)
    # siblings start from the prompt's cached blocks: 28 of 30 tokens (block size 4) each
    assert llm.engine.kv.stats.hits == 2 * 28
    sampled = llm.generate([PROMPTS[2]], SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=8,
                                                        ignore_eos=True))[0]
    assert len({tuple(o.token_ids) for o in sampled.outputs}) == 3


def test_abort_frees_blocks_at_once(make_llm):
    llm = make_llm()
    engine = llm.engine
    engine.add_request("a", PROMPTS[2], SamplingParams(max_tokens=50, ignore_eos=True))
    engine.add_request("b", PROMPTS[0],
                       SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    engine.step()
    engine.step()
    assert engine.kv.pool.num_used > 0
    engine.abort_request("a")
    assert "a" not in engine.kv.requests
    finished = []
    while engine.has_unfinished_requests():
        finished += [o for o in engine.step() if o.finished]
    assert [o.request_id for o in finished] == ["b"] and len(tokens(finished[0])) == 4


def test_admission_errors_leave_other_requests_alone(make_llm):
    llm = make_llm(max_model_len=40)
    with pytest.raises(ValueError, match="the prompt has 45 tokens; max_model_len is 40"):
        llm.generate([list(range(45))], SamplingParams())
    with pytest.raises(ValueError,
                       match=r"prompt \(30 tokens\) \+ max_tokens \(20\) exceeds max_model_len 40"):
        llm.generate([PROMPTS[2]], SamplingParams(max_tokens=20))
    with pytest.raises(ValueError, match="the prompt is empty"):
        llm.generate([[]], SamplingParams())
    with pytest.raises(ValueError, match=r"prompt token ids must be in \[0, 160\)"):
        llm.generate([[1, 2, 999]], SamplingParams())
    out = llm.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=3))[0]
    assert len(tokens(out)) <= 3 and out.finished


@pytest.mark.parametrize("bad,message", [
    (dict(temperature=-1), "temperature must be non-negative"),
    (dict(max_tokens=0), "max_tokens must be at least 1"),
    (dict(top_p=0), r"top_p must be in \(0, 1\]"),
    (dict(n=0), "n must be at least 1"),
    (dict(min_tokens=5, max_tokens=2), r"min_tokens \(5\) must not exceed max_tokens \(2\)"),
])
def test_bad_sampling_params(bad, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**bad)
