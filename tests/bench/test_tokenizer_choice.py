"""`kvrelay bench serve` counts lengths with the served model's tokenizer by default: found
from GET /v1/models (kvrelay's `root` is the checkpoint it loaded; an id is looked up as a
directory or in the Hugging Face cache), else words, and it says which."""
from __future__ import annotations

import json

import pytest

from kvrelay.bench.tokens import HFTokenCounter, WordCounter, choose_counter, served_tokenizer


@pytest.fixture()
def checkpoint(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    path = tmp_path / "ckpt"
    path.mkdir()
    vocab = {f"w{i}": i for i in range(50)} | {"[UNK]": 50}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(path / "tokenizer.json"))
    (path / "config.json").write_text(json.dumps({"model_type": "gpt_oss"}))
    return path


def test_the_root_of_the_served_model_is_its_tokenizer(checkpoint):
    entries = [{"id": "other", "root": "/nowhere"}, {"id": "tiny", "root": str(checkpoint)}]
    assert served_tokenizer(entries, "tiny") == checkpoint
    counter, which = choose_counter(None, entries, "tiny")
    assert isinstance(counter, HFTokenCounter) and counter.count("w1 w2 w3") == 3
    assert which == (f"tokens of the served model's tokenizer, {checkpoint} (from GET /v1/models;"
                     " --tokenizer overrides)")


def test_a_repo_id_is_found_in_the_hugging_face_cache(checkpoint, tmp_path, monkeypatch):
    snapshot = tmp_path / "hub" / "models--org--name" / "snapshots" / "abc"
    snapshot.parent.mkdir(parents=True)
    checkpoint.rename(snapshot)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    assert served_tokenizer([{"id": "served-name", "root": "org/name"}], "served-name") == snapshot
    assert served_tokenizer([], "org/name") == snapshot             # no listing: the model id


def test_a_model_not_on_this_machine_counts_words_and_says_why(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-hub"))
    entries = [{"id": "openai/gpt-oss-120b", "root": "/remote/gpt-oss-120b"}]
    counter, which = choose_counter(None, entries, "openai/gpt-oss-120b")
    assert isinstance(counter, WordCounter)
    assert which == ("words, about one token each (the served model 'openai/gpt-oss-120b' "
                     "(root '/remote/gpt-oss-120b') has no tokenizer.json on this machine; "
                     "--tokenizer PATH counts tokens)")
    counter, which = choose_counter(None, None, "m")
    assert isinstance(counter, WordCounter) and "GET /v1/models did not answer" in which


def test_a_directory_without_a_tokenizer_is_passed_over(checkpoint):
    (checkpoint / "tokenizer.json").unlink()
    assert served_tokenizer([{"id": "m", "root": str(checkpoint)}], "m") is None


def test_the_flag_wins(checkpoint):
    entries = [{"id": "tiny", "root": str(checkpoint)}]
    counter, which = choose_counter("words", entries, "tiny")
    assert isinstance(counter, WordCounter) and which.endswith("(--tokenizer words)")
    counter, which = choose_counter(str(checkpoint / "tokenizer.json"), [], "tiny")
    assert isinstance(counter, HFTokenCounter)
    assert which == f"tokens of {checkpoint / 'tokenizer.json'} (--tokenizer)"
