"""Speculative decoding (--speculative-config, kvrelay/spec_decode/): the config, the
n-gram proposer, the scheduler's drafts and blocks (a fake model), and the engine on the
tiny checkpoint — greedy output token-identical to spec off and to transformers, stops,
logprobs, seeds, prefix caching, grammars. The sampled law: tests/engine/test_spec_decode_law.py;
the draft-model method: tests/engine/test_spec_decode_draft.py."""
from __future__ import annotations

import random

import pytest
import torch

from kvrelay import SamplingParams
from kvrelay.config import EngineArgs
from kvrelay.engine.codec import FROM_ENGINE, encode
from kvrelay.engine.messages import EngineStats
from kvrelay.engine.request import Request
from kvrelay.engine.scheduler import SchedulerOutput
from kvrelay.kv_cache.hashing import hash_block
from kvrelay.model import execution_plan
from kvrelay.spec_decode.config import SpeculativeConfig
from kvrelay.spec_decode.ngram import NgramIndex, NgramProposer
from tests.engine.sched_driver import BLOCK, FakeForward, make_scheduler, next_token, reference
from tests.factories import greedy_mismatch
from tests.structured.conftest import bytes_ckpt  # noqa: F401 -- a fixture used below

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3,
         "prompt_lookup_min": 1}


# -- the config ----------------------------------------------------------------------------
def test_config_follows_vllms_rules():
    c = SpeculativeConfig.from_json({"method": "ngram", "num_speculative_tokens": 4})
    assert (c.num_speculative_tokens, c.prompt_lookup_min, c.prompt_lookup_max) == (4, 5, 5)
    c = SpeculativeConfig.from_json({"method": "ngram", "num_speculative_tokens": 2,
                                     "prompt_lookup_max": 3})
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == (3, 3)
    c = SpeculativeConfig.from_json({"model": "[ngram]", "num_speculative_tokens": 2,
                                     "prompt_lookup_min": 2})
    assert (c.method, c.prompt_lookup_min, c.prompt_lookup_max) == ("ngram", 2, 2)
    assert SpeculativeConfig.from_json(None) is None


@pytest.mark.parametrize("raw, words", [
    ({"model": "/ckpt/draft", "num_speculative_tokens": 4}, "no config.json"),
    ({"method": "draft_model", "num_speculative_tokens": 4}, "does not go with"),
    ({"method": "eagle", "num_speculative_tokens": 4}, "'eagle' is not supported"),
    ({"method": "ngram"}, "num_speculative_tokens is required"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "positive integer"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4,
      "prompt_lookup_max": 2}, "must not exceed"),
    ({"method": "ngram", "num_speculative_tokens": 2, "draft_tp": 1}, "unknown key 'draft_tp'"),
    ({"num_speculative_tokens": 2}, "method is required"),
])
def test_config_errors_are_one_line_naming_what_is_supported(raw, words):
    with pytest.raises(ValueError) as e:
        SpeculativeConfig.from_json(raw)
    message = str(e.value)
    assert words in message and "\n" not in message
    assert message.startswith("--speculative-config")
    if "eagle" in words or "go with" in words:
        assert '"method": "ngram"' in message and '"model": DRAFT' in message


def test_engine_args_refuse_async_scheduling_with_speculation():
    with pytest.raises(ValueError, match="--async-scheduling"):
        EngineArgs(speculative_config=NGRAM, async_scheduling=True)
    with pytest.raises(ValueError, match="draft model 'x': not a checkpoint"):
        EngineArgs(speculative_config={"model": "x", "num_speculative_tokens": 1})


# -- the n-gram proposer ---------------------------------------------------------------------
def _naive(tokens: list[int], k: int, low: int, high: int) -> list[int]:
    """The rule by brute force: for n from high down to low, the most recent earlier
    occurrence of the last n tokens; copy k tokens after it (over the copy past the end)."""
    L = len(tokens)
    for n in range(high, low - 1, -1):
        if n > L:
            continue
        for end in range(L - 2, n - 2, -1):
            if tokens[end - n + 1:end + 1] == tokens[L - n:]:
                out: list[int] = []
                for i in range(k):
                    src = end + 1 + i
                    out.append(tokens[src] if src < L else out[src - L])
                return out
    return []


def test_ngram_proposals_match_the_rule_as_tokens_grow():
    """The index against brute force (an alphabet of 8 keeps every n-gram's occurrences
    under the candidates a lookup extends, `ngram.SCAN`)."""
    rng = random.Random(3)
    for low, high in ((1, 1), (1, 3), (2, 4), (3, 3)):
        index = NgramIndex(low, high)
        tokens = [rng.randrange(8) for _ in range(5)]
        for _ in range(150):
            assert index.propose(tokens, 4) == _naive(tokens, 4, low, high), (low, high, tokens)
            tokens += [rng.randrange(8) for _ in range(rng.randrange(1, 4))]


def test_ngram_prefers_the_longest_then_the_most_recent_match_and_continues_a_loop():
    index = NgramIndex(1, 3)
    #          0  1  2  3  4  5  6  7  8  9
    tokens = [7, 1, 2, 9, 5, 1, 2, 8, 3, 2]
    assert index.propose(tokens, 2) == [8, 3]        # "2" most recently at 6: then 8 3
    tokens = [7, 1, 2, 9, 5, 1, 2, 8, 3, 1, 2]
    assert index.propose(tokens, 2) == [8, 3]        # "1 2" at 5-6 beats "1 2"... at 1-2
    loop = NgramIndex(2, 2)
    assert loop.propose([4, 5, 6, 5, 6], 5) == [5, 6, 5, 6, 5]   # period 2, run on
    assert loop.propose([4, 5, 6, 5, 6, 9], 3) == []               # "6 9" never seen
    assert NgramIndex(1, 2).propose([3], 2) == []                  # nothing earlier


def test_proposer_skips_grammars_and_remote_decode_and_caps_at_room():
    proposer = NgramProposer(SpeculativeConfig.from_json(NGRAM))  # type: ignore[arg-type]
    req = Request("a", [1, 2, 3, 1, 2], SamplingParams())
    assert proposer.propose(req, 9) == [3, 1, 2]
    assert proposer.propose(req, 1) == [3]
    assert proposer.propose(req, 0) == []
    req.grammar = object()  # type: ignore[assignment]
    assert proposer.propose(req, 3) == []


# -- the scheduler, with a fake model ----------------------------------------------------------
class SpecForward(FakeForward):
    """The fake model of sched_driver, verifying drafts as the engine does: row j's token
    is the model's next token after the slots of positions [0, start + j] (so a stale slot
    of a rejected draft that were read later would change the tokens)."""

    def __call__(self, out: SchedulerOutput) -> dict[str, list[int]]:
        sampled = super().__call__(SchedulerOutput([c for c in out.chunks if not c.drafts]))
        for chunk in out.chunks:
            if not chunk.drafts:
                continue
            req = chunk.request
            tokens = [req.all_token_ids[chunk.start]] + chunk.drafts
            for j, token in enumerate(tokens):
                self.slots[self._slot(req, chunk.start + j)] = token
            got = []
            for j in range(len(tokens)):
                seen = [self.slots.get(self._slot(req, p), -1)
                        for p in range(chunk.start + j + 1)]
                got.append(next_token(seen))
                if j == len(chunk.drafts) or got[-1] != chunk.drafts[j]:
                    break
            sampled[req.request_id] = got
        return sampled


def _oracle_drafter(req: Request, room: int) -> list[int]:
    """The true continuation, wrong from a position that depends on the length (so drafts
    are fully accepted, partly accepted and rejected at once, in turn)."""
    tokens = list(req.all_token_ids)
    wrong = len(tokens) % 4                   # 3: no wrong token in 3 drafts
    out = []
    for i in range(min(3, room)):
        t = next_token(tokens)
        if i == wrong:
            t = (t + 1) % 97
        out.append(t)
        tokens.append(t)
    return out


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_scheduler_verifies_drafts_frees_their_blocks_and_caches_only_accepted(prefix_caching):
    s = make_scheduler(40, budget=16, prefix_caching=prefix_caching)
    s.drafter = _oracle_drafter
    forward = SpecForward(s)
    prompts = {f"r{i}": [random.Random(i).randrange(97) for _ in range(3 + 4 * i)]
               for i in range(4)}
    for rid, prompt in prompts.items():
        s.add(Request(rid, prompt, SamplingParams(temperature=0, max_tokens=17,
                                                  ignore_eos=True)))
    requests = dict(s.requests)
    speculative = 0
    while s.has_unfinished:
        out = s.schedule()
        speculative += sum(1 for c in out.chunks if c.drafts)
        assert out.num_batched_tokens <= 16
        s.update(out, forward(out))
        s.kv.check_integrity()
        for req in s.running:          # no block past the request's tokens survives a step
            held = len(s.kv.block_ids(req.request_id)[0])
            assert held <= -(-req.num_tokens // BLOCK)
    assert speculative > 10
    for rid, req in requests.items():
        assert req.output_token_ids == reference(prompts[rid], 17)
    s.kv.assert_no_leaks()
    if prefix_caching:
        accepted = set()
        for req in requests.values():
            parent = s.kv.root
            for i in range(req.num_tokens // BLOCK):
                parent = hash_block(parent, req.all_token_ids[i * BLOCK:(i + 1) * BLOCK])
                accepted.add(parent)
        assert s.kv.pool.cached
        assert {h for _, h in s.kv.pool.cached} <= accepted


def test_drafts_fit_max_tokens_max_model_len_and_the_budget():
    s = make_scheduler(40, budget=3, max_model_len=12)
    s.drafter = lambda req, room: [1] * room
    s.add(Request("a", [5, 6], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)))
    out = s.schedule()
    s.update(out, {"a": [9]})                   # prefill: one token out, three to go
    out = s.schedule()
    assert out.chunks[0].drafts == [1, 1]      # budget 3: the last token and two drafts
    s.update(out, {"a": [1, 1, 4]})            # both accepted, the target's 4: max_tokens
    assert s.requests == {} and s.kv.pool.num_used == 0
    s = make_scheduler(40, budget=16, max_model_len=12)
    s.drafter = lambda req, room: [1] * room
    s.add(Request("b", list(range(9)), SamplingParams(temperature=0, max_tokens=None,
                                                      ignore_eos=True)))
    s.update(s.schedule(), {"b": [1]})
    out = s.schedule()                         # 10 tokens of max_model_len 12: one draft
    assert out.chunks[0].drafts == [1]
    s.update(out, {"b": [1, 2]})
    assert s.requests == {}
    s.kv.assert_no_leaks()


def test_shrink_releases_the_lookahead_blocks_of_every_group():
    from kvrelay.kv_cache.manager import KVCacheGroup, KVCacheManager
    kv = KVCacheManager(20, 4, [KVCacheGroup(None, 1), KVCacheGroup(8, 1)])
    assert kv.allocate("a", 0, 10)                       # 3 blocks per group
    assert kv.allocate("a", 9, 17)                       # a decode with 7 lookahead slots
    assert [len(t) for t in kv.block_ids("a")] == [5, 5]
    used = kv.pool.num_used
    kv.shrink("a", 11)                                  # 11 tokens kept: 3 blocks
    assert [len(t) for t in kv.block_ids("a")] == [3, 3]
    assert kv.pool.num_used == used - 4
    kv.check_integrity()
    assert kv.allocate("a", 10, 12)                      # grows again past the fast path
    assert [len(t) for t in kv.block_ids("a")] == [3, 3]
    assert kv.allocate("a", 11, 13)
    assert [len(t) for t in kv.block_ids("a")] == [4, 4]
    kv.free("a")
    kv.assert_no_leaks()


def test_a_stop_token_inside_accepted_drafts_ends_there():
    s = make_scheduler(40)
    s.drafter = lambda req, room: [7, 8, 9][:room]
    s.add(Request("a", [5, 6], SamplingParams(temperature=0, max_tokens=20, logprobs=0,
                                              stop_token_ids=[8])))
    req = s.requests["a"]
    s.update(s.schedule(), {"a": [3]})
    req.output_logprobs.append({})
    out = s.schedule()
    req.output_logprobs += [{}, {}, {}, {}]    # what `apply` records: one per drawn token
    finished = s.update(out, {"a": [7, 8, 9, 1]})
    assert finished == [req] and req.output_token_ids == [3, 7, 8]
    assert req.stop_reason == 8 and len(req.output_logprobs) == 3
    s.kv.assert_no_leaks()


# -- the engine on the tiny checkpoint ---------------------------------------------------------
def _repeating(seed: int) -> list[int]:
    """A random phrase of 3-11 tokens, repeated to 24+ tokens."""
    g = torch.Generator().manual_seed(seed)
    n = int(torch.randint(3, 12, (1,), generator=g))
    return torch.randint(5, 160, (n,), generator=g).tolist() * (24 // n + 1)


# the tiny model's greedy continuations of seeds 33, 27 and 32 run into repeats (found by a
# scan of 60 seeds: 9-20 of 32 tokens accepted from drafts); the last prompt does not repeat
PROMPTS = [_repeating(33), _repeating(27), _repeating(32),
           torch.randint(5, 160, (23,), generator=torch.Generator().manual_seed(3)).tolist()]
GREEDY = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)


@pytest.mark.parametrize("hybrid", [True, False])
@pytest.mark.parametrize("kernel", [True, False])
def test_greedy_is_token_identical_to_spec_off_and_transformers(tiny, make_llm, monkeypatch,
                                                                hybrid, kernel):
    if not kernel:                     # every op on its reference path (numerics unchanged)
        plan = execution_plan.current().without_native()
        monkeypatch.setattr(execution_plan, "current", lambda: plan)
    args = dict(disable_hybrid_kv_cache_manager=not hybrid)
    off = make_llm(**args).generate(PROMPTS, GREEDY)
    llm = make_llm(speculative_config=NGRAM, **args)
    on = llm.generate(PROMPTS, GREEDY)
    assert [o.outputs[0].token_ids for o in on] == [o.outputs[0].token_ids for o in off]
    for prompt, out in zip(PROMPTS, on):
        assert greedy_mismatch(tiny[1], prompt, out.outputs[0].token_ids) is None
    stats = llm.engine.spec_stats
    assert stats.num_accepted_tokens > 0                          # drafts were kept …
    assert stats.num_accepted_tokens < stats.num_draft_tokens     # … and some rejected
    assert llm.engine.num_steps < 3 * GREEDY.max_tokens           # fewer steps than tokens
    again = llm.generate(PROMPTS, GREEDY)                          # prefix-cache hits
    assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in off]
    assert llm.engine.kv.stats.hits > 0


def _loop_prompt(make_llm) -> tuple[list[int], list[int]]:
    """A prompt whose greedy output repeats itself, and that output (spec off)."""
    prompt = PROMPTS[1]
    return prompt, make_llm().generate([prompt], GREEDY)[0].outputs[0].token_ids


def period_3(seen, logits):
    """Pushes the output into a loop of period 3 (what it sees includes the drafts being
    verified: the loop is accepted from drafts, through the sampler's general path)."""
    if len(seen) >= 3:
        logits[seen[-3]] += 30.0
    return logits


def test_stops_logprobs_and_processors_equal_spec_off(make_llm):
    prompt, tokens = _loop_prompt(make_llm)
    words = [f"w{t}" for t in tokens]
    looped = dict(logits_processors=[period_3])
    cases = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in (5, 6, 7)]
    # stop ids and strings where the output repeats (accepted from drafts), some only
    # counted after min_tokens so that they end the output inside a run
    cases += [SamplingParams(temperature=0, max_tokens=32, stop_token_ids=[t], min_tokens=m)
              for t, m in ((tokens[20], 19), (tokens[30], 26), (tokens[3], 0))]
    cases += [SamplingParams(temperature=0, max_tokens=32, stop=[f"{a} {b}"])
              for a, b in zip(words[18:30:3], words[19:31:3])]
    cases += [SamplingParams(temperature=0, max_tokens=32, stop=[words[21]], min_tokens=20,
                             include_stop_str_in_output=True),
              SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, logprobs=3),
              SamplingParams(temperature=0, max_tokens=20, min_tokens=18, logprobs=0),
              SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, logprobs=1,
                             logit_bias={tokens[3]: -5.0}, **looped),
              SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[tokens[2]],
                             min_tokens=9, **looped),
              SamplingParams(temperature=0, max_tokens=20, stop=[words[1]], min_tokens=7,
                             **looped)]
    off = make_llm().generate([prompt] * len(cases), cases)
    llm = make_llm(speculative_config=NGRAM)
    on = llm.generate([prompt] * len(cases), cases)
    assert llm.engine.spec_stats.num_accepted_tokens > 50
    for params, a, b in zip(cases, on, off):
        x, y = a.outputs[0], b.outputs[0]
        assert (x.token_ids, x.text, x.finish_reason, x.stop_reason) == \
            (y.token_ids, y.text, y.finish_reason, y.stop_reason), params
        if params.logprobs is not None:
            assert len(x.logprobs) == len(x.token_ids)
            for p, q in zip(x.logprobs, y.logprobs):
                assert p.keys() == q.keys()
                for t in p:
                    assert p[t].rank == q[t].rank
                    assert p[t].logprob == pytest.approx(q[t].logprob, abs=1e-4)


def test_seeded_sampling_is_reproducible_and_the_same_as_spec_off(make_llm):
    prompt, _ = _loop_prompt(make_llm)
    params = [SamplingParams(temperature=t, seed=s, max_tokens=16, ignore_eos=True, top_k=k)
              for s in range(6) for t, k in ((0.3, 0), (0.7, 20))]
    params.append(SamplingParams(temperature=0.5, seed=3, n=3, max_tokens=16, ignore_eos=True))
    off = make_llm().generate([prompt] * len(params), params)
    llm = make_llm(speculative_config=NGRAM)
    first = llm.generate([prompt] * len(params), params)
    again = llm.generate([prompt] * len(params), params)
    ids = [[c.token_ids for c in o.outputs] for o in first]
    assert ids == [[c.token_ids for c in o.outputs] for o in again]
    assert ids == [[c.token_ids for c in o.outputs] for o in off]
    assert llm.engine.spec_stats.num_accepted_tokens > 0


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_grammar_requests_run_without_drafts_beside_speculating_ones(bytes_ckpt,  # noqa: F811
                                                                     method):
    """Structured outputs need a byte-level vocabulary (tests/structured/conftest.py); the
    draft model is the checkpoint itself."""
    from kvrelay import LLM
    from kvrelay.structured.params import StructuredOutputsParams
    spec = NGRAM if method == "ngram" else {"model": str(bytes_ckpt), "num_speculative_tokens": 3}
    llm = LLM(str(bytes_ckpt), dtype="float32", max_model_len=128, block_size=4,
              speculative_config=spec)
    proposed: dict[str, list[int]] = {}
    propose = llm.engine.proposer.propose

    def spy(req, room):
        drafts = propose(req, room)
        proposed[req.request_id] = proposed.get(req.request_id, []) + drafts
        return drafts

    llm.engine.scheduler.drafter = spy
    choice = ["yes", "no, not at all"]
    params = [SamplingParams(temperature=t, seed=1, max_tokens=8,
                             structured_outputs=StructuredOutputsParams(choice=choice))
              for t in (0, 1.0)] + [GREEDY]
    prompt = [300, 301, 302, 303] * 5
    outs = llm.generate([prompt] * 3, params)
    assert [o.outputs[0].text in choice for o in outs[:2]] == [True, True]
    assert len(outs[2].outputs[0].token_ids) == GREEDY.max_tokens
    assert llm.engine.spec_stats.num_drafts > 0
    assert proposed["0"] == proposed["1"] == [] and proposed["2"]   # grammars: no drafts
    llm.engine.assert_no_leaks()
    llm.shutdown()


def test_engine_stats_carry_the_counters_over_the_wire_and_add_up():
    a = EngineStats(spec_decode_num_drafts=2, spec_decode_num_draft_tokens=6,
                    spec_decode_num_accepted_tokens=4, spec_decode_accepted_per_pos=(2, 1, 1))
    b = EngineStats(spec_decode_num_drafts=1, spec_decode_num_draft_tokens=3,
                    spec_decode_num_accepted_tokens=1, spec_decode_accepted_per_pos=(1, 0, 0))
    assert FROM_ENGINE.decode(encode(_outputs(a))).stats == a
    total = EngineStats.total([a, b])
    assert total.spec_decode_accepted_per_pos == (3, 1, 1)
    assert total.spec_decode_num_accepted_tokens == 5
    assert "spec_decode_num_drafts" not in EngineStats()        # off: not exported


def _outputs(stats: EngineStats):
    from kvrelay.engine.messages import StepOutputs
    return StepOutputs([], stats)


def test_metrics_expose_vllms_spec_decode_names():
    from prometheus_client.parser import text_string_to_metric_families

    from kvrelay.server.metrics import ServerMetrics
    stats = EngineStats(spec_decode_num_drafts=5, spec_decode_num_draft_tokens=15,
                        spec_decode_num_accepted_tokens=7,
                        spec_decode_accepted_per_pos=(4, 2, 1))
    text = ServerMetrics(lambda: stats, "m").render().decode()
    samples = {(s.name, s.labels.get("position")): s.value
               for f in text_string_to_metric_families(text) for s in f.samples}
    assert samples[("vllm:spec_decode_num_drafts_total", None)] == 5
    assert samples[("vllm:spec_decode_num_draft_tokens_total", None)] == 15
    assert samples[("vllm:spec_decode_num_accepted_tokens_total", None)] == 7
    assert [samples[("vllm:spec_decode_num_accepted_tokens_per_pos_total", str(j))]
            for j in range(3)] == [4, 2, 1]
    off = ServerMetrics(lambda: EngineStats(), "m").render().decode()
    assert "spec_decode" not in off
