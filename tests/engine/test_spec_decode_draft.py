"""Speculative decoding with a draft model (`{"model": PATH, ...}`,
kvrelay/engine/draft_proposer.py) on the tiny checkpoint: the target itself as its draft
(every draft accepted: the draft's cache, catch-up and rollback are right) and a perturbed
copy (some drafts rejected: each proposal is checked against the draft's own greedy
continuation in transformers, which a stale draft cache would break). Greedy output
token-identical to spec off, the sampled law, blocks freed, the config's one-line errors."""
from __future__ import annotations

import copy
import json
import shutil
import time
from collections import Counter

import pytest
import torch

from kvrelay import SamplingParams
from kvrelay.config import EngineArgs, EngineConfig
from kvrelay.engine.draft_proposer import DraftState
from kvrelay.engine.request import Request
from tests.engine.conftest import EOS, VOCAB
from tests.engine.test_spec_decode import GREEDY, PROMPTS
from tests.engine.test_spec_decode_law import two_sample_p_value
from tests.factories import add_word_tokenizer, greedy_mismatch, save_checkpoint

K = 3


def draft_config(path, k: int = K) -> dict:
    return {"model": str(path), "num_speculative_tokens": k}


@pytest.fixture(scope="session")
def perturbed(tiny, tmp_path_factory):
    """(checkpoint dir, transformers model): the tiny target with noise on its LM head —
    the same vocabulary, a draft that agrees with the target often but not always."""
    hf = copy.deepcopy(tiny[1])
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        w = hf.lm_head.weight
        w.add_(torch.randn(w.shape, generator=gen) * 0.6 * float(w.std()))
    path = save_checkpoint(hf, tmp_path_factory.mktemp("tiny-draft"))
    add_word_tokenizer(path, VOCAB, eos_id=EOS)
    return path, hf


@pytest.mark.parametrize("output, known", [
    ([9], 3),                 # d1 rejected: the target's 9 is fed next step, from position 3
    ([7, 9], 4),              # d1 accepted, d2 rejected
    ([7, 8, 9], 5),           # d1 d2 accepted (d3 never fed): d3 and the bonus fed next
    ([7, 8, 5, 9], 5),        # all accepted, then the bonus token
])
def test_rollback_counts_only_the_accepted_fed_drafts_as_known(output, known):
    """Prompt [1, 2, 3] caught up (known 3), drafts 7 8 5 of which 7 8 were fed back."""
    req = Request("r", [1, 2, 3], GREEDY)
    state = DraftState(req, known=3, fed=[7, 8])
    for token in output:
        req.append_token(token)
    state.confirm()
    assert (state.known, state.fed) == (known, [])
    assert state.known < req.num_tokens            # the last token is always fed again


def _recording(llm) -> list[tuple[list[int], list[int]]]:
    """Every proposal the scheduler gets: (the request's tokens then, the drafts)."""
    seen: list[tuple[list[int], list[int]]] = []
    propose = llm.engine.proposer.propose

    def spy(req, room):
        drafts = propose(req, room)
        if drafts:
            seen.append((list(req.all_token_ids), drafts))
        return drafts

    llm.engine.scheduler.drafter = spy
    return seen


def test_target_as_its_own_draft_is_always_accepted(tiny, make_llm):
    """Chunked prefill (budget 16 < the prompts), prefix caching (the second round hits):
    the draft catches up through both, and each of its drafts is the target's token."""
    args = dict(max_num_batched_tokens=16)
    off = [o.outputs[0].token_ids for o in make_llm(**args).generate(PROMPTS, GREEDY)]
    llm = make_llm(speculative_config=draft_config(tiny[0]), **args)
    sizes: list[int] = []                 # tokens of each draft forward
    execute = llm.engine.draft.runner.execute

    def counting(step):
        sizes.append(len(step.token_ids))
        return execute(step)

    llm.engine.draft.runner.execute = counting
    for _ in range(2):
        on = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]
        assert on == off
    stats = llm.engine.spec_stats
    assert stats.num_draft_tokens > 0
    assert stats.num_accepted_tokens == stats.num_draft_tokens
    assert llm.engine.kv.stats.hits > 0
    assert max(sizes) == 16               # the prompts caught up in chunks of the budget
    assert llm.engine.num_steps < 2 * len(PROMPTS) * GREEDY.max_tokens / 2


def test_a_different_draft_is_rejected_sometimes_and_output_stays_the_targets(make_llm,
                                                                             perturbed):
    off = [o.outputs[0].token_ids for o in make_llm().generate(PROMPTS, GREEDY)]
    llm = make_llm(speculative_config=draft_config(perturbed[0]))
    seen = _recording(llm)
    on = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]
    assert on == off
    stats = llm.engine.spec_stats
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    # after every rejection the draft rolled back: each proposal is still its own greedy
    # continuation of the request's tokens
    assert len(seen) > 20
    for tokens, drafts in seen:
        assert greedy_mismatch(perturbed[1], tokens, drafts) is None, (tokens, drafts)


def test_sampling_keeps_the_law_with_a_draft_model(tiny, make_llm):
    """As the n-gram law test (test_spec_decode_law.py): temperature 0.05 spreads each
    token's law over a few tokens; the draft proposes the argmax, accepted only when the
    target's draw is it."""
    params = SamplingParams(temperature=0.05, max_tokens=5, ignore_eos=True)
    prompt, n = PROMPTS[3], 300
    off = make_llm(seed=1).generate([prompt] * n, params)
    llm = make_llm(seed=2, speculative_config=draft_config(tiny[0], 2))
    on = llm.generate([prompt] * n, params)
    stats = llm.engine.spec_stats
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    for j in range(1, 5):
        a = Counter(o.outputs[0].token_ids[j] for o in on)
        b = Counter(o.outputs[0].token_ids[j] for o in off)
        assert two_sample_p_value(a, b) > 1e-3, (j, a, b)


def test_finished_and_aborted_requests_free_their_draft_blocks(tiny, make_llm):
    llm = make_llm(speculative_config=draft_config(tiny[0]))
    engine, draft = llm.engine, llm.engine.draft
    engine.add_request("a", PROMPTS[0], GREEDY)
    engine.add_request("b", PROMPTS[1], SamplingParams(temperature=0, max_tokens=8,
                                                       ignore_eos=True))
    for _ in range(2):                         # the prompts, then the first drafts
        engine.step()
    assert set(draft.states) == {"a", "b"} and draft.kv.pool.num_used > 0
    while "b" in draft.states:                                    # b ends by max_tokens
        engine.step()
    assert set(draft.kv.requests) == {"a"}
    engine.abort_request("a")
    assert not draft.states and draft.kv.pool.num_used == 0
    draft.assert_no_leaks()


# -- the config ----------------------------------------------------------------------------
def _config(target, **spec) -> EngineConfig:
    return EngineConfig.from_args(EngineArgs(model=str(target), speculative_config=spec))


def _one_line_error(target, spec: dict, words: str) -> None:
    with pytest.raises(ValueError) as e:
        _config(target, **spec)
    message = str(e.value)
    assert words in message and "\n" not in message, message
    assert message.startswith("--speculative-config")


def test_a_draft_must_be_a_checkpoint_sharing_the_tokenizer(tiny, tmp_path):
    target = tiny[0]
    c = _config(target, **draft_config(target))
    assert (c.speculative.method, c.speculative.model) == ("draft_model", str(target))
    _one_line_error(target, draft_config(tmp_path / "nowhere"), "no config.json")
    other_vocab = tmp_path / "vocab"
    other_vocab.mkdir()
    raw = json.loads((target / "config.json").read_text()) | {"vocab_size": VOCAB + 8}
    (other_vocab / "config.json").write_text(json.dumps(raw))
    _one_line_error(target, draft_config(other_vocab), f"vocab_size {VOCAB + 8}")
    other_tokenizer = tmp_path / "tokenizer"
    other_tokenizer.mkdir()
    shutil.copy(target / "config.json", other_tokenizer / "config.json")
    add_word_tokenizer(other_tokenizer, VOCAB + 1, eos_id=EOS)
    _one_line_error(target, draft_config(other_tokenizer), "another tokenizer")
    _one_line_error(target, draft_config(target) | {"draft_tensor_parallel_size": 2},
                    "draft_tensor_parallel_size 2")
    _one_line_error(target, draft_config(target) | {"method": "ngram"}, "does not go with")
    with pytest.raises(ValueError, match="--tensor-parallel-size 2"):
        EngineConfig.from_args(EngineArgs(model=str(target), tensor_parallel_size=2,
                                          speculative_config=draft_config(target)))


def test_disaggregated_decode_drafts_after_the_remote_prefill(tiny, monkeypatch):
    """A decode engine with a draft model pulls the prompt's KV from a prefill engine (also
    with one: its remote-decode request ends after one token, without drafts); the draft
    computes the prompt itself, and the tokens are the plain engine's."""
    from kvrelay import LLM
    from tests.engine.test_kv_load_policy import PROMPT, _kv_config
    common = dict(dtype="float32", max_model_len=128, block_size=4,
                  speculative_config=draft_config(tiny[0]))
    monkeypatch.setenv("KVRELAY_NIXL_SIDE_CHANNEL_PORT", "0")
    prefill = LLM(str(tiny[0]), kv_transfer_config=_kv_config("kv_producer"), **common)
    decode = LLM(str(tiny[0]), kv_transfer_config=_kv_config("kv_consumer"), **common)
    try:
        one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
        params = _until_done(prefill.engine, "p", one, {"do_remote_decode": True})
        assert prefill.engine.spec_stats.num_drafts == 0
        out = _until_done(decode.engine, "d", GREEDY, params.kv_transfer_params)
        want = decode.generate([PROMPT], GREEDY)[0].outputs[0].token_ids   # local prefill
        assert out.error is None and out.outputs[0].token_ids == want
        assert decode.engine.connector.stats.failed == 0
        stats = decode.engine.spec_stats
        assert stats.num_accepted_tokens == stats.num_draft_tokens > 0
        decode.engine.assert_no_leaks()
        deadline = time.monotonic() + 30                 # the prefill learns of the read
        while prefill.engine.scheduler.held and time.monotonic() < deadline:
            prefill.engine.step()
            time.sleep(0.005)
        prefill.engine.assert_no_leaks()
    finally:
        prefill.shutdown()
        decode.shutdown()


def _until_done(engine, request_id: str, params: SamplingParams, transfer: dict):
    """Steps `engine` until PROMPT's request ends (a KV load runs on a thread: idle steps
    wait a little), 30 s at most."""
    from tests.engine.test_kv_load_policy import PROMPT
    engine.add_request(request_id, PROMPT, params, kv_transfer_params=transfer)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        for out in engine.step():
            if out.finished:
                return out
        if engine.last_step_idle:
            time.sleep(0.005)
    raise AssertionError(f"{request_id} did not finish in 30 s")
