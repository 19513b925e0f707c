from __future__ import annotations

import pytest

from tests.factories import add_word_tokenizer, make_hf_model, save_checkpoint

VOCAB = 160
EOS = 3


@pytest.fixture(scope="session")
def tiny(tmp_path_factory):
    """(checkpoint dir, transformers reference) with a sliding window of 8 on even layers
    and a word tokenizer whose EOS is w3."""
    hf = make_hf_model(seed=11, num_hidden_layers=4, sliding_window=8)
    path = save_checkpoint(hf, tmp_path_factory.mktemp("tiny-engine"))
    add_word_tokenizer(path, VOCAB, eos_id=EOS)
    return path, hf


@pytest.fixture()
def make_llm(tiny):
    """Builds LLMs on the tiny checkpoint and checks each for leaked KV blocks after the test."""
    from kvrelay import LLM
    made = []

    def factory(**kwargs):
        args = dict(dtype="float32", max_model_len=128, block_size=4) | kwargs
        llm = LLM(str(tiny[0]), **args)
        made.append(llm)
        return llm

    yield factory
    for llm in made:
        assert not llm.engine.has_unfinished_requests()
        llm.engine.assert_no_leaks()
        llm.shutdown()                 # its threads (async scheduling's forward thread) end
