"""Engine side of structured outputs: a request's constraint → its grammar matcher.

Owner of: the grammar backend of the engine's checkpoint, built on the first constrained
request (llguidance reads the vocabulary once, ~1 s for o200k), so an engine that never
sees one pays nothing.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from kvrelay import envs
from kvrelay.structured.params import StructuredOutputsParams

if TYPE_CHECKING:
    from kvrelay.model.tokenizer import CheckpointTokenizer
    from kvrelay.structured.backend import GrammarBackend, GrammarMatcher


class Constrainable(Protocol):
    """What a matcher is made from (the engine's `SamplingParams`)."""

    @property
    def structured_outputs(self) -> StructuredOutputsParams | None: ...
    @property
    def max_tokens(self) -> int | None: ...


# reasoning effort → the analysis budget, as a multiple of KVRELAY_STRUCTURED_ANALYSIS_BUDGET
# (the medium budget, 1024 tokens by default: low 256, medium 1024, high 4096)
EFFORT_SCALE = {"low": 0.25, "medium": 1.0, "high": 4.0}
UNLIMITED = -1          # thinking_token_budget -1 (vLLM's "no budget"): all the room there is


def effort_budget(effort: str | None) -> int:
    """The analysis budget of a reasoning effort (None: medium, harmony's default)."""
    medium = envs.STRUCTURED_ANALYSIS_BUDGET.as_int() or 0
    return int(medium * EFFORT_SCALE.get(effort or "medium", 1.0))


def requested_budget(effort: str | None, thinking_token_budget: int | None,
                     max_tokens: int | None) -> int | None:
    """What a request asks of its analysis message under enforcement: its own
    `thinking_token_budget` (-1: as much as the answer leaves, i.e. max_tokens before the
    engine's cap), else its effort's budget capped at half of max_tokens, so the answer
    keeps at least half. The engine caps either to leave room for the answer."""
    if thinking_token_budget is not None:
        if thinking_token_budget == UNLIMITED:
            return max_tokens
        return thinking_token_budget
    budget = effort_budget(effort)
    return budget if max_tokens is None else min(budget, max_tokens // 2)


def analysis_budget(p: StructuredOutputsParams, max_tokens: int | None) -> int:
    """Harmony: the analysis message's token budget before the room check — the request's
    own (`requested_budget`, set by the server), else the medium effort's default capped at
    half of max_tokens, so the constrained answer keeps room to finish."""
    if not p.harmony:
        return 0
    if p.analysis_budget is not None:
        return p.analysis_budget
    return requested_budget(None, None, max_tokens) or 0


class StructuredOutputs:
    def __init__(self, tokenizer: CheckpointTokenizer | None, vocab_size: int,
                 eos_token_ids: tuple[int, ...]) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self._backend: GrammarBackend | None = None

    @property
    def backend(self) -> GrammarBackend:
        if self._backend is None:
            from kvrelay.structured.backend import GrammarBackend
            if self.tokenizer is None:
                raise ValueError("structured outputs need the checkpoint's tokenizer.json")
            self._backend = GrammarBackend(self.tokenizer.tokenizer.to_str(), self.vocab_size,
                                           self.eos_token_ids)
        return self._backend

    def matcher(self, params: Constrainable) -> GrammarMatcher | None:
        """A matcher at the start of the output for `params`' constraint (None without
        one); ValueError naming the problem when it does not compile."""
        p = params.structured_outputs
        if p is None:
            return None
        max_tokens = params.max_tokens
        matcher = self.backend.matcher(p, self.budget(p, max_tokens))
        if p.harmony and max_tokens is not None:
            matcher.end_within(max_tokens)
        return matcher

    def budget(self, p: StructuredOutputsParams, max_tokens: int | None) -> int:
        """The analysis budget compiled into `p`'s grammar: `analysis_budget`, at most what
        leaves room within max_tokens for the analysis message's own tokens and the
        shortest answer (`answer_tokens`). 0 (no analysis message) when even that does not
        fit: the answer then has every token (and is cut at max_tokens if it needs more)."""
        want = analysis_budget(p, max_tokens)
        if want == 0 or max_tokens is None:
            return want
        answer = self.backend.answer_tokens(p) or 0
        room = max_tokens - answer - self.backend.analysis_overhead()
        return max(0, min(want, room))
