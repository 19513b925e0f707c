"""Finishing a constrained harmony turn within max_tokens: the shortest way to the end of
the grammar, and the switch that takes it when the tokens left are about to run out.

Owner of: nothing shared. A `Closer` (one per grammar backend) searches endings; an
`Ending` (one per sequence, held by its GrammarMatcher) decides when to force one.

Why: a grammar alone guarantees that an output is a *prefix* of a valid answer. A model
that never ends its analysis, or never closes a JSON string (a random-weight model at
temperature 1 almost never picks `"` among the ~200k tokens a string allows), reaches
max_tokens mid-answer: OpenAI clients then see `finish_reason: "length"` with no call, or
`status: "incomplete"` (the Agents SDK's ModelBehaviorError). The analysis budget
(manager.py) leaves room for the answer; the `Ending` makes the answer itself finish:

    tokens produced ──────────────────────────────────────────────▶ max_tokens
    | analysis ≤ B | free answer tokens ...  | forced ending (d tokens) |
                                             ▲
                   the first check where d + GROWTH ≥ tokens left: from here on the
                   mask allows only the next token of the ending found there

An ending is found by a depth-first search over a short list of candidate tokens, tried in
order: fast-forward tokens (the only ones the grammar allows), harmony's message ends
(`<|end|>`, `<|return|>`, `<|call|>`: they end free text at once), then JSON's closers and
shortest values (`"`, `}`, `,`, ..., `0`, `[]`), then single printable characters (a key, an
enum value, a pattern's next character), then UTF-8 continuation bytes (a model's token may
end in the middle of a character) — those that change what may come next first, those that
leave it as it was (more text in a string) last (`_Search`). It is not always the shortest
ending, but it is found in about a millisecond (a few hundred lexer checks of ~0.5-2 us at
o200k; 0.8 ms on average over 64 random-model turns), and `CLOSE_CHECKS` / `MAX_ENDING`
bound the work when nothing short exists (then no ending is forced and the turn runs to
max_tokens, as without this module).

GROWTH is the most one sampled token is assumed to lengthen the ending (a token such as
`[{"` opens an array and an object; a JSON object with required keys adds them). Checks
are spaced so that, under that assumption, none is missed; a token that lengthens the
ending by more, right before the end, can still leave the turn cut at max_tokens.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

GROWTH = 16                 # tokens one sampled token may add to the ending (see above)
CLOSE_CHECKS = 4000         # token checks one search may make (~0.5-2 us each at o200k)
MAX_ENDING = 256            # the longest ending looked for (one stack frame per token)

# harmony's markers, which end or delimit messages (tried first: they end free text)
_SPECIALS = ("<|end|>", "<|return|>", "<|call|>", "<|start|>", "<|channel|>", "<|message|>",
             "<|constrain|>")
# JSON's closers, then its shortest values: a closer first, so that the search ends a
# string or a number rather than extending it (`0` would add digits to a number forever)
_CLOSERS = ('"', "}", "]", '"}', '"]', "}}", "}]", "]}", ",", ',"', ":", '""', "0", "{}",
            "[]", "false", "null", "true")
# UTF-8 continuation bytes (as byte tokens) that complete any character a token left
# half-written inside a string: 0x80 after most lead bytes, 0xA0 after E0, 0x90 after F0
_CONTINUATIONS = (0x80, 0xA0, 0x90)
# what a position looks like (`_Search.signature`): which of these may come next
_PROBES = ('"', "}", "]", ",", ":", "0", "a", "A", ".", " ", "-", "@", "_")


class Closer:
    """Finds a way from a matcher's position to the end of its grammar (`path`)."""

    def __init__(self, tokenizer: Any, eos_token_ids: tuple[int, ...] = ()) -> None:
        self.candidates = _candidates(tokenizer, eos_token_ids)
        self.probes = self.candidates[:len(_SPECIALS) + len(eos_token_ids)] + [
            t for t in (_single(tokenizer, c) for c in _PROBES) if t is not None]

    def path(self, matcher: Any, limit: int) -> list[int] | None:
        """Tokens that take (a copy of) `matcher`, an llguidance LLMatcher, to its end
        (stopped: nothing more is allowed), at most `limit` (and MAX_ENDING) of them; None
        when none was found within that and CLOSE_CHECKS token checks."""
        return _Search(self, min(limit, MAX_ENDING)).run(matcher.deep_copy(), 0)


class _Search:
    """One depth-first search (see the module docstring). At each position the candidates
    that change what may come next (its `signature`: a closed string, a finished number)
    are tried before those that leave it as it was (more text, more digits), which are
    tried only when no other way ends: so text-like positions are left at once instead of
    being extended until the search runs out. Each step works on a copy of the matcher
    (copying is cheaper than llguidance's rollback)."""

    def __init__(self, closer: Closer, limit: int) -> None:
        self.closer, self.limit = closer, limit
        self.checks = 0

    def run(self, m: Any, depth: int) -> list[int] | None:
        if m.is_stopped():
            return []
        if depth >= self.limit or self.checks >= CLOSE_CHECKS or m.is_error():
            return None
        forced = m.compute_ff_tokens()[:self.limit - depth]
        if forced:
            return self._step(m, forced, depth)
        here = self.signature(m, [])
        same: list[int] = []
        for token in self.closer.candidates:
            self.checks += 1
            if self.checks > CLOSE_CHECKS:
                return None
            if m.validate_tokens([token]) != 1:
                continue
            if self.signature(m, [token]) == here:
                same.append(token)
                continue
            path = self._step(m, [token], depth)
            if path is not None:
                return path
        for token in same:
            path = self._step(m, [token], depth)
            if path is not None:
                return path
        return None

    def signature(self, m: Any, prefix: list[int]) -> tuple[bool, ...]:
        """Which probes may follow `prefix` (validated, not consumed)."""
        self.checks += len(self.closer.probes)
        return tuple(m.validate_tokens([*prefix, p]) == len(prefix) + 1
                     for p in self.closer.probes)

    def _step(self, m: Any, tokens: list[int], depth: int) -> list[int] | None:
        child = m.deep_copy()
        taken = child.try_consume_tokens(tokens)
        if taken == 0:
            return None
        rest = self.run(child, depth + taken)
        return None if rest is None else tokens[:taken] + rest


def _single(tokenizer: Any, text: str) -> int | None:
    ids = tokenizer.tokenize_str(text)
    return ids[0] if len(ids) == 1 else None


def _candidates(tokenizer: Any, eos_token_ids: tuple[int, ...]) -> list[int]:
    """The search's candidate tokens, best first, each once: harmony's markers and the eos
    ids, JSON's closers, then the printable ASCII characters (those that are one token)."""
    out: list[int] = []
    texts = [(s, True) for s in _SPECIALS] + [(s, False) for s in _CLOSERS]
    texts += [(chr(c), False) for c in range(32, 127)]
    for i, (text, special) in enumerate(texts):
        if i == len(_SPECIALS):
            out.extend(eos_token_ids)
        ids = tokenizer.tokenize_str(text, parse_special=special)
        if len(ids) == 1 and (not special or tokenizer.is_special_token(ids[0])):
            out.append(ids[0])
    for byte in _CONTINUATIONS:
        ids = tokenizer.tokenize_bytes(bytes([byte]))
        if len(ids) == 1:
            out.append(ids[0])
    return list(dict.fromkeys(out))


@dataclass
class Ending:
    """When one sequence must stop choosing and take an ending: owned by its GrammarMatcher,
    advanced with every token it accepts. `limit` is the request's max_tokens."""
    limit: int
    produced: int = 0
    next_check: int = 0
    forced: list[int] = field(default_factory=list)   # the ending being taken, next first

    def copy(self) -> Ending:
        return Ending(self.limit, self.produced, self.next_check, list(self.forced))

    @property
    def next_forced(self) -> int | None:
        return self.forced[0] if self.forced else None

    def accepted(self, token: int) -> None:
        self.produced += 1
        if self.forced:
            if token == self.forced[0]:
                del self.forced[0]
            else:                     # the mask allowed nothing else; never expected
                self.forced.clear()

    def due(self) -> bool:
        """Whether `check` has work to do now (else it costs nothing)."""
        return not self.forced and self.produced >= self.next_check

    def check(self, matcher: Any, closer: Closer) -> None:
        """At `next_check`: measure the ending from here (`closer.path`); take it now when the
        tokens left could no longer hold it after one more free token, else schedule the
        next measurement for when they could first run short."""
        left = self.limit - self.produced
        path = closer.path(matcher, left) if left > 0 else None
        if path is None:              # none found within what is left: look again later
            self.next_check = self.produced + GROWTH
            return
        if len(path) + GROWTH >= left:
            self.forced = path
            return
        self.next_check = self.produced + max(1, (left - len(path) - GROWTH) // (GROWTH + 1))
