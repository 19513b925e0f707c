"""Tokenising prompt text at a cost the context length bounds, not the text's size.

A 31 MB prompt once took the API process from 509 MiB to 4.8 GB and blocked it for
36-58 s, only to be refused for its length. Three things keep that from happening:

- **The bytes bound** (`TokenizerFacts.longest_token_bytes`): for a byte-level BPE
  tokenizer (every byte of the text is in exactly one token; no normalizer; no added
  token that swallows whitespace) a text of B bytes has at least B / L tokens, L the
  longest token's byte length (o200k: 128, SmolLM2: 81). Computed once at start-up; a
  prompt over it is refused before any tokenizer runs (`server/limits.py`).
- **Counting in pieces, stopping at the context** (`encode_within`): long text is encoded
  in pieces of about `CHUNK_CHARS`, cut just before a space between two non-spaces. For
  the tokenizers kvrelay serves (byte-level BPE with GPT-2 / o200k pre-tokenizer
  patterns, whitespace-split word tokenizers) such a space always starts a new
  pre-token, so the pieces' ids are exactly the whole text's (`splittable`, checked on a
  probe text at start-up); counting stops as soon as the prompt is too long. Memory is
  one piece's worth (the tokenizer keeps ~80 bytes a character while it encodes).
- **No GIL held while encoding**: `Tokenizer.encode` holds the GIL for the whole call
  (1 MB: 1.1 s during which no other thread ran); `encode_batch_fast` releases it, so the
  event loop keeps answering while a worker thread encodes.

Text with no such space for `MAX_CHUNK_CHARS` characters (a long run of one character,
text without spaces) is cut there anyway for counting ("about N tokens"); if it then fits
the context it is encoded once more, whole, for exact ids.
"""
from __future__ import annotations

import functools
import itertools
import json
import math
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from kvrelay.model.tokenizer import CheckpointTokenizer
from kvrelay.server.protocol import OpenAIError

CHUNK_CHARS = 1 << 17          # ~10 MiB of tokenizer scratch per piece
MAX_CHUNK_CHARS = 1 << 20      # how far a piece may run on looking for a space to cut at
_NON_SPACE = re.compile(r"\S")

# Text the split check encodes whole and in pieces: scripts, punctuation, digits,
# contractions, runs of whitespace, newlines and tabs (the added tokens are appended).
_PROBE = ("Hello, world! It's 2024-05-09; the café's naïve résumé costs $3.50 (20% off).\n\n"
          "def f(x):\n    return x ** 2  # squared\t\tend\r\nA  B   C    D\u00a0E\u3000F "
          "日本語のテキスト、句読点。 中文，标点！ Ünïcödé ÀÉÎ 'S 'll 're 've 'd CAPS lower "
          "MiXeD CamelCase snake_case 12345678 3.14159 -42 +7 ...?! <tag attr=\"v\"/> "
          "https://example.com/a?b=c&d=e #hash @at ~tilde `code` 🙂 👍🏽 x")


def utf8_len(text: str) -> int:
    """The UTF-8 byte length of `text` (no copy for ASCII text)."""
    return len(text) if text.isascii() else len(text.encode("utf-8", "surrogatepass"))


@dataclass(frozen=True)
class TokenizerFacts:
    """What kvrelay may rely on about a tokenizer, found once at start-up."""
    longest_token_bytes: int | None = None    # None: no proven bytes-per-token bound
    splittable: bool = False                  # pieces cut before " x" encode as the whole
    # bytes the vocabulary has no token for are dropped, not covered: the ASCII ones, and
    # the least share of a non-ASCII character's bytes that is surely covered
    untokenized: str = ""
    kept: float = 1.0

    def covered_bytes(self, text: str) -> float:
        """At least this many bytes of `text` end up inside tokens."""
        nbytes = utf8_len(text) - sum(text.count(c) for c in self.untokenized)
        return nbytes if text.isascii() else nbytes * self.kept

    def min_tokens(self, covered_bytes: float) -> int:
        """A proven lower bound on the tokens covering that many bytes (0: none known)."""
        if not self.longest_token_bytes:
            return 0
        return math.ceil(covered_bytes / self.longest_token_bytes)


NO_FACTS = TokenizerFacts()


def tokenizer_facts(tokenizer: CheckpointTokenizer | None) -> TokenizerFacts:
    hf = hf_tokenizer(tokenizer)
    if hf is None:
        return NO_FACTS
    longest = _longest_token_bytes(hf)
    if longest is None:
        return TokenizerFacts(None, _splittable(hf))
    untokenized, kept = _untokenized_bytes(hf)
    if kept <= 0:
        return TokenizerFacts(None, _splittable(hf))
    return TokenizerFacts(longest, _splittable(hf), untokenized, kept)


def hf_tokenizer(tokenizer: Any) -> Any:
    """The HF `tokenizers.Tokenizer` behind `tokenizer` when its `encode` is the plain one
    (tests' stand-ins override `encode`); else None."""
    if not isinstance(tokenizer, CheckpointTokenizer):
        return None
    if type(tokenizer).encode is not CheckpointTokenizer.encode:
        return None
    hf = tokenizer.tokenizer
    return hf if hasattr(hf, "encode_batch") else None


def encode(hf: Any, text: str) -> list[int]:
    """`text`'s ids, without the GIL held while the tokenizer runs."""
    fast = getattr(hf, "encode_batch_fast", None) or hf.encode_batch
    return fast([text], add_special_tokens=False)[0].ids


# -- the facts -------------------------------------------------------------------------------
def _longest_token_bytes(hf: Any) -> int | None:
    """L such that no token covers more than L bytes of the text, or None where no such
    bound holds (a normalizer can shrink text; an unknown-token or whitespace-stripping
    added token can cover any length)."""
    from tokenizers import models
    if not isinstance(hf.model, models.BPE) or hf.normalizer is not None:
        return None
    if not _has_byte_level(hf.pre_tokenizer):
        return None
    vocab = hf.get_vocab(with_added_tokens=False)
    added = list(hf.get_added_tokens_decoder().values())
    if any(t.lstrip or t.rstrip for t in added):
        return None
    # byte-level vocabulary strings spell one character per byte
    return max([max(map(len, vocab), default=1)]
               + [len(t.content.encode("utf-8")) for t in added])


def _untokenized_bytes(hf: Any) -> tuple[str, float]:
    """The byte-level alphabet's characters missing from the vocabulary (BPE drops such a
    byte): the ASCII ones as text, and the least share of a multi-byte character's bytes
    still covered (0.0: a continuation byte is missing, no bound)."""
    from tokenizers import pre_tokenizers
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet(), key=_byte_of)
    vocab = hf.get_vocab(with_added_tokens=False)
    missing = [_byte_of(c) for c in alphabet if c not in vocab]
    untokenized = "".join(chr(b) for b in missing if b < 0x80)
    kept = 1.0
    for b in missing:
        if 0x80 <= b <= 0xBF:
            return untokenized, 0.0
        if 0xC2 <= b <= 0xF4:                     # a lead byte: 2, 3 or 4 bytes a character
            size = 2 if b <= 0xDF else 3 if b <= 0xEF else 4
            kept = min(kept, (size - 1) / size)
    return untokenized, kept                     # C0, C1, F5-FF never occur in UTF-8


@functools.lru_cache(maxsize=1)
def _byte_level_chars() -> dict[str, int]:
    """GPT-2's byte → character table, reversed (what ByteLevel spells each byte as)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


def _byte_of(char: str) -> int:
    return _byte_level_chars()[char]


def _has_byte_level(pre_tokenizer: Any) -> bool:
    if pre_tokenizer is None:
        return False
    try:
        spec = json.loads(pre_tokenizer.__getstate__())
    except (AttributeError, TypeError, ValueError):
        return False
    kinds = [p.get("type") for p in spec.get("pretokenizers", [spec])]
    return "ByteLevel" in kinds


def _splittable(hf: Any) -> bool:
    """Whether encoding a text in pieces cut before every " x" gives the whole text's ids
    (checked on `_PROBE` plus every added token inside words)."""
    added = [t.content for t in hf.get_added_tokens_decoder().values()][:256]
    probe = _PROBE + " " + " ".join(f"a{t}b c{t} {t}d" for t in added)
    cuts = [0] + [m.start() for m in re.finditer(r"(?<=\S) (?=\S)", probe)] + [len(probe)]
    pieces = [probe[a:b] for a, b in itertools.pairwise(cuts)]
    return [i for piece in pieces for i in encode(hf, piece)] == encode(hf, probe)


# -- encoding within a limit -----------------------------------------------------------------
def encode_within(tokenizer: CheckpointTokenizer, facts: TokenizerFacts, text: str, limit: int,
                  param: str = "prompt", what: str = "prompt") -> list[int]:
    """`text`'s ids; 400 as soon as it is known to hold `limit` tokens or more (the
    caller still checks the exact length). `limit` 0: no limit."""
    hf = hf_tokenizer(tokenizer)
    if hf is None:
        return tokenizer.encode(text)
    if not limit or len(text) <= CHUNK_CHARS or not facts.splittable:
        return encode(hf, text)
    ids: list[int] = []
    cuts = 0
    for piece, forced in pieces(text):
        ids.extend(encode(hf, piece))
        cuts += forced
        if len(ids) >= limit + 2 * cuts:
            raise too_long(limit, len(ids), exact=not cuts, param=param, what=what)
    return encode(hf, text) if cuts else ids


def count_within(tokenizer: CheckpointTokenizer, facts: TokenizerFacts, texts: Iterable[str],
                 limit: int, param: str, what: str) -> int:
    """The tokens of `texts` together (a lower bound where a piece had to be cut anywhere);
    400 once they reach `limit`."""
    hf = hf_tokenizer(tokenizer)
    total = cuts = 0
    for text in texts:
        for piece, forced in (pieces(text) if facts.splittable else [(text, False)]):
            total += len(encode(hf, piece)) if hf is not None else len(tokenizer.encode(piece))
            cuts += forced
            if total >= limit + 2 * cuts:
                raise too_long(limit, total, exact=not cuts, param=param, what=what)
    return total


def too_long(limit: int, counted: int, exact: bool, param: str, what: str) -> OpenAIError:
    amount = f"at least {counted}" if exact else f"about {counted}"
    return OpenAIError(f"This model's maximum context length is {limit} tokens. However, your "
                       f"{what} has {amount} tokens, leaving no room for a completion.",
                       param=param)


def pieces(text: str) -> Iterator[tuple[str, bool]]:
    """`text` in pieces of about CHUNK_CHARS characters, each cut just before a space
    between two non-spaces; (piece, True) where no such space came within
    MAX_CHUNK_CHARS and the cut is anywhere."""
    start, n = 0, len(text)
    while start < n:
        if n - start <= CHUNK_CHARS:
            yield text[start:], False
            return
        hi = min(n, start + MAX_CHUNK_CHARS)
        end = _boundary(text, start + CHUNK_CHARS, hi)
        forced = end < 0 and hi < n
        end = hi if end < 0 else end
        yield text[start:end], forced
        start = end


def _boundary(text: str, lo: int, hi: int) -> int:
    """The first space in [lo, hi) with a non-space on both sides, or -1."""
    pos = lo
    while True:
        pos = text.find(" ", pos, hi)
        if pos < 0 or pos + 1 >= len(text):
            return -1
        if not text[pos - 1].isspace() and not text[pos + 1].isspace():
            return pos
        found = _NON_SPACE.search(text, pos + 1, hi)       # past this run of whitespace
        if found is None:
            return -1
        pos = found.start()
