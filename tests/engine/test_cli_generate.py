"""`kvrelay generate` on a checkpoint without tokenizer.json: a one-line error, no traceback."""
from __future__ import annotations

import pytest

from tests.factories import make_hf_model, save_checkpoint


@pytest.fixture(scope="module")
def no_tokenizer(tmp_path_factory):
    return save_checkpoint(make_hf_model(seed=3), tmp_path_factory.mktemp("no-tokenizer"))


def test_chat_without_a_tokenizer_is_a_one_line_error(no_tokenizer, capsys):
    from kvrelay.cli import main
    rc = main(["generate", "hi", "--chat", "--model", str(no_tokenizer), "--max-model-len", "64"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 1
    assert err[-1] == f"kvrelay generate: error: --chat needs a tokenizer.json in {no_tokenizer}"
