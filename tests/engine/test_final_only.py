"""Offline `LLM.generate` builds each request's output once, when it finishes
(`OutputProcessor.final_only`), with the same final outputs as the per-step path."""
from __future__ import annotations

from kvrelay import SamplingParams

PROMPTS = [[5, 17, 29, 40, 41, 42, 77, 90, 91, 12, 13], [100, 101, 7], list(range(20, 50))]
PARAMS = [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
          SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=9, ignore_eos=True),
          SamplingParams(temperature=0, max_tokens=20, stop=["w9"])]


def _final(out) -> tuple:
    return (out.request_id, out.prompt_token_ids, out.finished, out.num_cached_tokens,
            [(o.index, o.text, o.token_ids, o.finish_reason, o.stop_reason, o.delta_text,
              o.delta_token_ids) for o in out.outputs])


def _stepped(engine) -> dict:
    """The per-step path, as a server drives it; the final outputs with whole deltas."""
    for i, (prompt, params) in enumerate(zip(PROMPTS, PARAMS)):
        engine.add_request(str(i), prompt, params)
    finals, text, ids = {}, {}, {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            for o in out.outputs:
                key = (out.request_id, o.index)
                text[key] = text.get(key, "") + o.delta_text
                ids[key] = ids.get(key, []) + o.delta_token_ids
            if out.finished:
                for o in out.outputs:
                    o.delta_text, o.delta_token_ids = text[out.request_id, o.index], \
                        ids[out.request_id, o.index]
                finals[out.request_id] = out
    return finals


def test_generate_builds_only_final_outputs_and_they_match_the_stepped_ones(make_llm):
    want = _stepped(make_llm().engine)
    llm = make_llm()
    built = []
    real = llm.engine.output.request_output

    def counting(parent):
        out = real(parent)
        built.append(out.finished)
        return out
    llm.engine.output.request_output = counting             # type: ignore[method-assign]
    got = llm.generate(PROMPTS, PARAMS)
    assert built == [True] * 3                              # one output per request, at the end
    assert [_final(o) for o in got] == [_final(want[str(i)]) for i in range(3)]
    assert not llm.engine.output.final_only                 # step() callers still stream
