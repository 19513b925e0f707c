"""N-gram drafts (vLLM's "ngram" method, prompt lookup decoding): the next tokens are
guessed by finding an earlier occurrence of the request's last n tokens (n from
`prompt_lookup_max` down to `prompt_lookup_min`) in its prompt + output and copying what
followed it. Torch-free; the scheduler asks for drafts through `NgramProposer.propose`.

Per request an index, updated with the tokens added since the last step, lists every
position under the `min_n`-gram that ends there, so a lookup costs the few candidates of
the suffix's `min_n`-gram, not a scan of the context:

    tokens   a b c d e │ x c d e f │ … y c d e          min_n = 2, max_n = 3
    suffix "d e" ends at L-1; its candidates (not the suffix itself): e at 4 and at 8
    at 8: backwards "c d e" = suffix's "c d e" → n = 3 = max_n: the match; draft f, …

Which occurrence: the longest match, the most recent among the longest (vLLM's kernel
takes the earliest; the most recent follows a loop's latest turn). When fewer than K
tokens follow the match, the copy runs on over its own output — a match one period back
in a loop of period p proposes the loop again, K tokens, instead of stopping after p.
At most `SCAN` candidates (the most recent) are extended per lookup, which bounds a step's
cost when the `min_n`-gram is frequent.
"""
from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Protocol

from kvrelay.spec_decode.config import SpeculativeConfig


class Drafted(Protocol):
    """What the proposer reads of a request (the engine's `Request`)."""

    @property
    def grammar(self) -> object | None: ...
    @property
    def remote_decode(self) -> bool: ...
    @property
    def all_token_ids(self) -> Sequence[int]: ...

SCAN = 64                   # candidate occurrences extended per lookup (most recent first)


class NgramIndex:
    """The positions of one request's `min_n`-grams, grown as its tokens grow."""

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n, self.max_n = min_n, max_n
        self.ends: dict[tuple[int, ...], list[int]] = {}
        self.next = 0                      # first position not listed yet

    def propose(self, tokens: Sequence[int], k: int) -> list[int]:
        """Up to k draft tokens to follow `tokens` ([] without a match)."""
        self._update(tokens)
        end = self._match(tokens)
        return [] if end is None else _copy(tokens, end + 1, k)

    def _update(self, tokens: Sequence[int]) -> None:
        """List the positions [next, L - 1): the last position ends the suffix itself,
        which must not match itself."""
        last = len(tokens) - 1
        if last < self.next:               # the tokens were cut (never while running): rebuild
            self.ends, self.next = {}, 0
        n = self.min_n
        for p in range(max(self.next, n - 1), last):
            self.ends.setdefault(tuple(tokens[p - n + 1:p + 1]), []).append(p)
        self.next = max(self.next, last)

    def _match(self, tokens: Sequence[int]) -> int | None:
        """The end position of the longest earlier match of the suffix (up to max_n tokens;
        the most recent among the longest), or None."""
        L = len(tokens)
        if self.min_n > L:
            return None
        candidates = self.ends.get(tuple(tokens[L - self.min_n:]))
        if not candidates:
            return None
        best, best_n = None, 0
        for end in reversed(candidates[-SCAN:]):
            n = self.min_n
            while n < self.max_n and end - n >= 0 and tokens[end - n] == tokens[L - 1 - n]:
                n += 1
            if n > best_n:
                best, best_n = end, n
                if n == self.max_n:
                    break
        return best


def _copy(tokens: Sequence[int], start: int, k: int) -> list[int]:
    """k tokens from `start` on, continuing over the copy itself past the end (start < L):

        tokens … p q r s │ r s       start = L - 2: draft r s r s … (period 2)
    """
    L = len(tokens)
    out: list[int] = []
    for i in range(k):
        src = start + i
        out.append(tokens[src] if src < L else out[src - L])
    return out


class NgramProposer:
    """Drafts for the scheduler. Owner of: each request's `NgramIndex`, weakly keyed, so
    it goes away with its request (no bookkeeping on finish, abort or failure).

    Requests that do not speculate: those with a grammar (structured outputs: a draft
    would have to be checked against the grammar too) and a prefill server's
    do_remote_decode requests (their one token ends them)."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config
        self._indexes: weakref.WeakKeyDictionary[Drafted, NgramIndex] = \
            weakref.WeakKeyDictionary()

    def propose(self, req: Drafted, room: int) -> list[int]:
        """At most min(K, room) draft tokens to follow `req`'s tokens."""
        k = min(self.config.num_speculative_tokens, room)
        if k <= 0 or req.grammar is not None or req.remote_decode:
            return []
        index = self._indexes.get(req)
        if index is None:
            index = self._indexes[req] = NgramIndex(self.config.prompt_lookup_min,
                                                    self.config.prompt_lookup_max)
        return index.propose(req.all_token_ids, k)
