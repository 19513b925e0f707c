"""Token counting and random prompt text, with or without a tokenizer.

The tokenizer is `--tokenizer PATH` (a tokenizer.json, or a model directory holding one),
else the served model's own, found on this machine from `GET /v1/models` (`served_tokenizer`:
kvrelay lists the checkpoint directory it loaded as the model's `root`; a model id is also
looked up as a directory or in the Hugging Face cache). It is loaded with the `tokenizers`
library: prompt lengths are then exact for that tokenizer. Without one (`--tokenizer words`,
or a server whose model is not on this machine) the client cannot know the server's tokens,
so it works in *units*: a unit is a word or a punctuation mark (the regex
`\\w+|[^\\w\\s]`), which is about one token of an English BPE vocabulary and exactly one
token of a word-level one. Random prompts are then random words. Either way the reported
input/output token counts come from the server's `usage` (requested with
`stream_options.include_usage`) whenever the server sends it.
"""
from __future__ import annotations

import random
import re
from functools import lru_cache
from importlib import resources
from pathlib import Path
from typing import Any, Protocol

from kvrelay.model.config import CheckpointError
from kvrelay.model.locate import locate_checkpoint

WORDS = "words"                 # --tokenizer words: word units, whatever the server serves
_UNIT = re.compile(r"\w+|[^\w\s]")


class TokenCounter(Protocol):
    exact: bool
    name: str

    def count(self, text: str) -> int: ...

    def random_units(self, rng: random.Random, n: int) -> list: ...

    def render(self, units: list, target: int | None = None) -> tuple[str, int]:
        """Text for these units and its length; with `target`, adjusted to that many tokens
        where the tokenizer allows (re-encoding decoded BPE ids may merge or split)."""
        ...


def poem_lines(text: str) -> list[str]:
    """The verse lines of a sonnet text: no blank lines, "#" comments or numeral headings."""
    return [ln.strip() for ln in text.splitlines()
            if ln.strip() and not ln.strip().isupper() and not ln.startswith("#")]


@lru_cache(maxsize=1)
def bundled_sonnets() -> tuple[str, ...]:
    sonnets = resources.files("kvrelay.bench").joinpath("data", "sonnets.txt")
    text = sonnets.read_text(encoding="utf-8")
    return tuple(poem_lines(text))


@lru_cache(maxsize=1)
def word_list() -> tuple[str, ...]:
    """Distinct lower-case words of the bundled sonnets: the vocabulary of random prompts."""
    words = {w.lower() for line in bundled_sonnets() for w in re.findall(r"[A-Za-z]+", line)}
    return tuple(sorted(w for w in words if len(w) > 1))


class WordCounter:
    """No tokenizer: one unit = one word or punctuation mark."""

    exact = False
    name = "words (no tokenizer)"

    def count(self, text: str) -> int:
        return len(_UNIT.findall(text))

    def random_units(self, rng: random.Random, n: int) -> list[str]:
        words = word_list()
        return [rng.choice(words) for _ in range(n)]

    def render(self, units: list, target: int | None = None) -> tuple[str, int]:
        text = " ".join(units)
        return text, len(units)

    def truncate(self, text: str, n: int) -> str:
        pieces = list(_UNIT.finditer(text))
        return text if len(pieces) <= n else text[:pieces[n].start()].rstrip()


class HFTokenCounter:
    """A Hugging Face `tokenizers` tokenizer (no transformers, no torch)."""

    exact = True

    def __init__(self, path: str) -> None:
        from tokenizers import Tokenizer
        p = Path(path)
        file = p / "tokenizer.json" if p.is_dir() else p
        if not file.is_file():
            raise ValueError(f"--tokenizer {path}: no tokenizer.json there (give the file or the "
                             "model directory holding it)")
        self.name = str(p)
        self.tok = Tokenizer.from_file(str(file))
        special = set(self.tok.get_added_tokens_decoder())
        vocab = self.tok.get_vocab(with_added_tokens=False)
        self.normal_ids = sorted(set(vocab.values()) - special)
        if not self.normal_ids:
            raise ValueError(f"--tokenizer {path}: the tokenizer has no ordinary tokens")

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids

    def count(self, text: str) -> int:
        return len(self.encode(text))

    def random_units(self, rng: random.Random, n: int) -> list[int]:
        return [rng.choice(self.normal_ids) for _ in range(n)]

    def render(self, units: list, target: int | None = None) -> tuple[str, int]:
        text = self.tok.decode(units)
        if target is None:
            return text, self.count(text)
        ids = self.encode(text)
        fill = random.Random(len(units))
        for _ in range(8):                       # decode(ids) may re-encode to a different length
            if len(ids) == target:
                break
            if len(ids) > target:
                ids = ids[:target]
            else:
                ids = ids + [fill.choice(self.normal_ids) for _ in range(target - len(ids))]
            text = self.tok.decode(ids)
            ids = self.encode(text)
        return text, len(ids)

    def truncate(self, text: str, n: int) -> str:
        ids = self.encode(text)
        return text if len(ids) <= n else self.tok.decode(ids[:n])


def make_counter(tokenizer: str | None) -> WordCounter | HFTokenCounter:
    return HFTokenCounter(tokenizer) if tokenizer and tokenizer != WORDS else WordCounter()


def served_tokenizer(entries: list[dict[str, Any]], model: str) -> Path | None:
    """The directory holding the tokenizer.json of the model served as `model`, found on this
    machine: its `/v1/models` entry's `root` (kvrelay: the checkpoint directory it loaded;
    vLLM: the model as given), then its id, each as a directory or a Hugging Face repo id in
    the local cache (never downloaded). None when neither is here."""
    entry = next((e for e in entries if isinstance(e, dict) and e.get("id") == model), None)
    names = [entry.get("root"), entry.get("id")] if entry else [model]
    for name in dict.fromkeys(n for n in names if isinstance(n, str) and n):
        try:
            path = locate_checkpoint(name)
        except (CheckpointError, OSError, ValueError):
            continue
        if (path / "tokenizer.json").is_file():
            return path
    return None


def choose_counter(tokenizer: str | None, entries: list[dict[str, Any]] | None,
                   model: str) -> tuple[WordCounter | HFTokenCounter, str]:
    """The counter for the dataset's lengths and a line saying which one counts and why:
    --tokenizer PATH, else the served model's tokenizer where it is on this machine, else
    words (also with --tokenizer words)."""
    if tokenizer == WORDS:
        return WordCounter(), "words, about one token each (--tokenizer words)"
    if tokenizer:
        return HFTokenCounter(tokenizer), f"tokens of {tokenizer} (--tokenizer)"
    found = served_tokenizer(entries or [], model)
    if found is not None:
        return HFTokenCounter(str(found)), (f"tokens of the served model's tokenizer, {found} "
                                            "(from GET /v1/models; --tokenizer overrides)")
    if entries is None:
        why = "GET /v1/models did not answer"
    else:
        entry = next((e for e in entries if isinstance(e, dict) and e.get("id") == model), {})
        root = entry.get("root")
        where = f"{model!r}" + (f" (root {root!r})" if root not in (None, model) else "")
        why = f"the served model {where} has no tokenizer.json on this machine"
    return WordCounter(), f"words, about one token each ({why}; --tokenizer PATH counts tokens)"
