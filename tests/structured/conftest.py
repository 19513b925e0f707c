"""Tiny random-weight gpt-oss checkpoints with real byte-level vocabularies, so that
structured outputs (JSON, regex, choice) can be spelled: the embedded model's 49k
SmolLM2 tokenizer, and gpt-oss's o200k tokenizer with harmony's special tokens."""
from __future__ import annotations

import shutil

import pytest

from tests.factories import make_hf_model, save_checkpoint

SMALL = {"hidden_size": 32, "head_dim": 8, "intermediate_size": 32, "num_local_experts": 2,
         "num_hidden_layers": 2}


@pytest.fixture(scope="session")
def bytes_ckpt(tmp_path_factory):
    """A random checkpoint with the embedded model's tokenizer (EOS id 2, chat template)."""
    from kvrelay.model.embedded import embedded_model_dir
    src = embedded_model_dir()
    path = tmp_path_factory.mktemp("structured-bytes")
    save_checkpoint(make_hf_model(seed=5, vocab_size=49152, **SMALL), path)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(src / name, path / name)
    return path


@pytest.fixture(scope="session")
def harmony_ckpt(tmp_path_factory):
    """A random checkpoint with gpt-oss's o200k tokenizer (harmony chat)."""
    from tests.harmony_factories import GPT_OSS_VOCAB_SIZE, make_o200k_tokenizer_json
    path = tmp_path_factory.mktemp("structured-o200k")
    save_checkpoint(make_hf_model(seed=7, vocab_size=GPT_OSS_VOCAB_SIZE, **SMALL), path)
    make_o200k_tokenizer_json(path)
    return path
