"""Greedy outputs are token-identical to transformers under every scheduling regime."""
from __future__ import annotations

import pytest
import torch

from kvrelay import SamplingParams
from kvrelay.engine import runner as runner_module
from tests.factories import greedy_mismatch

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def _prompts(vocab: int = 160) -> list[list[int]]:
    g = torch.Generator().manual_seed(5)
    shared = torch.randint(0, vocab, (21,), generator=g).tolist()   # shared prefix > window
    return [
        torch.randint(0, vocab, (n,), generator=g).tolist() for n in (3, 9, 26)
    ] + [shared + torch.randint(0, vocab, (n,), generator=g).tolist()
         for n in (1, 6, 14)] + [shared]


def check_against_reference(hf, prompts, outputs):
    for prompt, out in zip(prompts, outputs):
        assert out.prompt_token_ids == prompt
        assert len(out.outputs[0].token_ids) == GREEDY.max_tokens
        problem = greedy_mismatch(hf, prompt, out.outputs[0].token_ids)
        assert problem is None, problem


@pytest.mark.parametrize("prefix_caching", [True, False])
@pytest.mark.parametrize("hybrid", [True, False])
def test_mixed_batch_matches_transformers(tiny, make_llm, prefix_caching, hybrid):
    llm = make_llm(enable_prefix_caching=prefix_caching, disable_hybrid_kv_cache_manager=not hybrid)
    prompts = _prompts()
    check_against_reference(tiny[1], prompts, llm.generate(prompts, GREEDY))
    # a second round hits the prefix cache (when on) and must give the same tokens
    again = llm.generate(prompts, GREEDY)
    check_against_reference(tiny[1], prompts, again)
    hits = llm.engine.kv.stats.hits
    assert (hits > 0) == prefix_caching
    # every prompt was computed in round one: whole blocks hit, short of the last token
    expected = [(len(p) - 1) // 4 * 4 if prefix_caching else 0 for p in prompts]
    assert [o.num_cached_tokens for o in again] == expected


@pytest.mark.parametrize("chunked", [True, False])
def test_chunked_prefill(tiny, make_llm, chunked):
    llm = make_llm(max_num_batched_tokens=7, enable_chunked_prefill=chunked)
    prompts = _prompts()
    check_against_reference(tiny[1], prompts, llm.generate(prompts, GREEDY))


def test_offline_prompts_start_whole_when_they_fit(tiny, make_llm):
    """The LLM's default (no chunked prefill): every prompt that fits a step is computed
    in one chunk from position 0, with the same tokens as the reference."""
    llm = make_llm(max_num_batched_tokens=40, enable_prefix_caching=False)
    assert llm.engine.scheduler.config.chunked_prefill is False
    chunks = []
    schedule = llm.engine.scheduler.schedule

    def recording(ahead=None):
        out = schedule(ahead)
        chunks.extend((c.start, c.num_tokens) for c in out.chunks if c.num_tokens > 1)
        return out

    llm.engine.scheduler.schedule = recording
    prompts = _prompts()
    check_against_reference(tiny[1], prompts, llm.generate(prompts, GREEDY))
    assert sorted(n for _, n in chunks) == sorted(len(p) for p in prompts)
    assert all(start == 0 for start, _ in chunks)


def test_preemption_under_a_small_kv_pool(tiny, make_llm):
    # 7 prompts × up to ~38 tokens = ~10 blocks each; 40 blocks force preemption
    llm = make_llm(num_gpu_blocks_override=40, max_model_len=64)
    prompts = _prompts()
    check_against_reference(tiny[1], prompts, llm.generate(prompts, GREEDY))
    assert llm.engine.scheduler.num_preemptions > 0


def test_buckets_validated_and_outputs_unchanged(tiny, make_llm):
    llm = make_llm(max_num_batched_tokens=32, max_num_seqs=8, additional_config={"neuron_config": {
        "num_batched_tokens_buckets": [16, 32], "num_seqs_buckets": [4, 8],
        "kv_segment_size_buckets": [32]}})
    prompts = _prompts()
    check_against_reference(tiny[1], prompts, llm.generate(prompts, GREEDY))


def test_all_greedy_forces_greedy(tiny, make_llm):
    sampling = {"on_device_sampling_config": {"all_greedy": True}}
    llm = make_llm(additional_config={"neuron_config": sampling})
    prompts = _prompts()[:3]
    outs = llm.generate(prompts,
                        SamplingParams(temperature=1.0, top_k=50, max_tokens=12, ignore_eos=True))
    check_against_reference(tiny[1], prompts, outs)


def test_compiled_decode_matches_transformers(tiny, make_llm, monkeypatch):
    """KVRELAY_COMPILE_DECODE: decode-only steps of 1-4 sequences run the forward compiled
    for 4 rows (1-3 sequences padded), and give the reference's tokens."""
    monkeypatch.setenv("KVRELAY_COMPILE_DECODE", "4")
    # the same graphs without autotuning or the C++ wrapper: minutes less to compile
    monkeypatch.setattr(runner_module, "COMPILE_OPTIONS", {"freezing": True})
    llm = make_llm(max_num_seqs=4)
    runner = llm.engine.runner
    assert runner.decode_buckets == (4,)            # compiled in warm-up, not fallen back
    prompts = _prompts()
    check_against_reference(tiny[1], prompts, llm.generate(prompts, GREEDY))
    assert runner.compiled_steps >= GREEDY.max_tokens
    assert runner.decode_buckets == (4,)            # no compiled step failed


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_greedy_steps_take_token_ids_and_the_same_tokens(make_llm, monkeypatch, dtype):
    """A step whose rows all sample plain greedily (StepInput.greedy) gets each row's
    token id from the LM head instead of its logits: the tokens are those the sampler picks
    from the logits, one sequence or many."""
    from kvrelay.engine import step_io
    # no prefix caching: the second round's prompts then compute as the first round's did
    llm = make_llm(dtype=dtype, max_num_seqs=8, enable_prefix_caching=False)
    runner = llm.engine.runner
    kinds: list[torch.dtype] = []
    execute = runner.execute

    def spy(step):
        out = execute(step)
        kinds.append(out.dtype)
        return out

    monkeypatch.setattr(runner, "execute", spy)
    prompts = _prompts()
    ids = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]
    ids += [o.outputs[0].token_ids for o in llm.generate(prompts[:1], GREEDY)]
    assert torch.int64 in kinds                        # the greedy form ran
    monkeypatch.setattr(step_io, "greedy_only", lambda plan, sampler: False)
    kinds.clear()
    logits = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]
    logits += [o.outputs[0].token_ids for o in llm.generate(prompts[:1], GREEDY)]
    assert torch.int64 not in kinds
    assert ids == logits
