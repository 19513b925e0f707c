"""The grammar engine (llguidance): compile constraints into matchers, one per sequence.

Owner of: the llguidance tokenizer of one checkpoint, the cache of compiled grammars
(keyed by the constraint and the analysis budget; the tokenizer is fixed per backend) and
the executor that fills several sequences' masks in parallel (outside the GIL).

Why llguidance (docs/benchmarks.md, "Structured outputs: grammar engine"): compiling a JSON
schema takes ~0.5-2 ms against xgrammar's 18-30 ms at the o200k vocabulary (agents send a
new tool schema per conversation), its Lark grammars name special tokens and bound a rule's
token count, which the harmony envelope needs, and its masks (10-20 us median per token) are
small next to a step.
"""
from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from kvrelay.structured.grammar import GrammarError, build_grammar
from kvrelay.structured.params import StructuredOutputsParams

logger = logging.getLogger(__name__)

CACHE_SIZE = 256               # compiled grammars kept (least recently used evicted)


class GrammarMatcher:
    """One sequence's position in its grammar. Owner: the Request it is attached to;
    advanced by `Request.append_token` with every accepted token."""

    def __init__(self, matcher: Any, backend: GrammarBackend) -> None:
        self.matcher = matcher
        self.backend = backend
        self.failed: str | None = None

    def fork(self) -> GrammarMatcher:
        """A matcher at the same position, advancing independently (n > 1 children)."""
        return GrammarMatcher(self.matcher.deep_copy(), self.backend)

    def accept(self, token_id: int) -> None:
        if self.failed is None and not self.matcher.consume_token(token_id):
            self.failed = self.matcher.get_error() or f"token {token_id} is not allowed here"
            logger.error("structured output: %s", self.failed)

    def allows(self, token_id: int) -> bool:
        """Whether `token_id` is allowed next (its bit in the next mask), without the mask:
        a lexer step over the token's bytes."""
        return self.failed is None and self.matcher.validate_tokens([token_id]) == 1

    @property
    def terminated(self) -> bool:
        """The grammar is complete and allows nothing more (the request stops)."""
        return self.matcher.is_stopped()


@dataclass(frozen=True)
class _Key:
    constraint: str
    analysis_budget: int


class GrammarBackend:
    def __init__(self, tokenizer_json: str, vocab_size: int,
                 eos_token_ids: tuple[int, ...]) -> None:
        import llguidance
        self._ll = llguidance
        self.vocab_size = vocab_size
        self.tokenizer = llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab_size,
                                                eos_token=list(eos_token_ids) or None)
        self.executor = llguidance.LLExecutor()
        self._cache: OrderedDict[_Key, Any] = OrderedDict()
        self.hits = self.misses = 0

    def matcher(self, p: StructuredOutputsParams, analysis_budget: int) -> GrammarMatcher:
        """A fresh matcher for `p`; GrammarError (a ValueError) when it does not compile."""
        key = _Key(p.cache_key(), analysis_budget)
        template = self._cache.get(key)
        if template is None:
            self.misses += 1
            template = self._compile(p, analysis_budget)
            self._cache[key] = template
            if len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        else:
            self.hits += 1
            self._cache.move_to_end(key)
        return GrammarMatcher(template.deep_copy(), self)

    def _compile(self, p: StructuredOutputsParams, analysis_budget: int) -> Any:
        grammar = build_grammar(p, analysis_budget)
        matcher = self._ll.LLMatcher(self.tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise GrammarError(_short(matcher.get_error()))
        return matcher

    def fill(self, rows: list[tuple[GrammarMatcher, int]], bitmask_ptr: int, batch: int,
             parallel: bool = True) -> None:
        """Write each matcher's allowed-token bitmask (int32 words, bit i of word j = token
        32 j + i) into row `index` of the [batch, words] buffer at `bitmask_ptr`. `parallel`:
        rows spread over llguidance's executor threads; else filled one by one on the calling
        thread, which for a few rows saves the hand-off to the pool and back (on a busy CPU
        the wait to be scheduled again cost more than the masks: 7 ms of wall time against
        0.1 ms of CPU for 8 rows of o200k under load 5)."""
        words = (self.vocab_size + 31) // 32
        if parallel:
            self.executor.unsafe_compute_mask_ptr([(m.matcher, i) for m, i in rows], bitmask_ptr,
                                                  words * 4, batch)
            return
        for m, i in rows:
            m.matcher.unsafe_compute_mask_ptr(bitmask_ptr + i * words * 4, words * 4)


def validate(p: StructuredOutputsParams) -> None:
    """Check that `p` compiles, without a tokenizer (the API server's early 400).
    GrammarError names the problem."""
    import llguidance
    grammar = build_grammar(p, analysis_budget=0)
    if p.harmony:                 # special tokens need a tokenizer: check the pieces alone
        grammar = build_grammar(_without_envelope(p), analysis_budget=0)
    error = llguidance.LLMatcher.validate_grammar(grammar)
    if error and not error.startswith("WARNING"):
        raise GrammarError(_short(error))


def _without_envelope(p: StructuredOutputsParams) -> StructuredOutputsParams:
    from dataclasses import replace
    return replace(p, harmony=False)


def _short(error: str) -> str:
    """llguidance's message on one line: its first line plus an `error: ...` detail line
    (it also quotes the pattern and our grammar with carets, which we leave out)."""
    lines = [line.strip() for line in error.strip().splitlines() if line.strip()]
    if not lines:
        return "invalid grammar"
    detail = next((line for line in lines[1:] if line.startswith("error:")), "")
    return f"{lines[0]} {detail}".strip()
