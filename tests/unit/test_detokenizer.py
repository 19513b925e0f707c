"""Incremental detokenisation: deltas add up to the full decode; stop strings; hold-back."""
from __future__ import annotations

import pytest

from kvrelay.engine.detokenizer import IncrementalDetokenizer
from kvrelay.model.tokenizer import CheckpointTokenizer


@pytest.fixture(scope="module")
def byte_tok():
    """A byte-level BPE tokenizer trained on a few sentences (multi-byte UTF-8 included)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = ["Paris is the capital of France.", "Zürich, 東京 and São Paulo 🙂", "a b c"] * 20
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=300,
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return CheckpointTokenizer(tok, (), None, {})


def stream(tok, ids, **kw):
    d = IncrementalDetokenizer(tok, tok.encode("Q: "), **kw)
    deltas = []
    for i in ids:
        stopped = d.add([i])
        deltas.append(d.take(stopped is not None))
        if stopped:
            break
    return d, deltas


def test_deltas_concatenate_to_the_full_decode(byte_tok):
    text = "Zürich, 東京 and São Paulo 🙂 is not Paris"
    ids = byte_tok.encode(text)
    d, deltas = stream(byte_tok, ids)
    assert "".join(deltas) + d.take(True) == text == d.text
    assert all("\ufffd" not in x for x in deltas)          # never half a character


def test_stop_string_across_token_boundaries_is_trimmed(byte_tok):
    ids = byte_tok.encode("Paris is the capital of France.")
    d, deltas = stream(byte_tok, ids, stop=["capital of"])
    assert d.stopped_on == "capital of"
    assert "".join(deltas) == d.text == "Paris is the "


def test_stream_holds_back_what_could_still_become_a_stop_string(byte_tok):
    ids = byte_tok.encode("a b c a b c")
    d = IncrementalDetokenizer(byte_tok, [], stop=["c a b x"])     # 7 chars: hold back 6
    shown = ""
    for i in ids:
        d.add([i])
        shown += d.take(False)
        assert len(shown) == max(len(d.text) - 6, 0)
    assert shown + d.take(True) == "a b c a b c"


def test_include_stop_string(byte_tok):
    d, _ = stream(byte_tok, byte_tok.encode("Paris is the capital of France."),
                  stop=["the"], include_stop=True)
    assert d.text == "Paris is the"
