"""Engine side of structured outputs: a request's constraint → its grammar matcher.

Owner of: the grammar backend of the engine's checkpoint, built on the first constrained
request (llguidance reads the vocabulary once, ~1 s for o200k), so an engine that never
sees one pays nothing.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from kvrelay import envs
from kvrelay.structured.params import StructuredOutputsParams

if TYPE_CHECKING:
    from kvrelay.model.tokenizer import CheckpointTokenizer
    from kvrelay.sampling_params import SamplingParams
    from kvrelay.structured.backend import GrammarBackend, GrammarMatcher


def analysis_budget(p: StructuredOutputsParams, max_tokens: int | None) -> int:
    """Harmony: the analysis message's token budget — the request's own, else the
    default (KVRELAY_STRUCTURED_ANALYSIS_BUDGET) capped at half of max_tokens, so the
    constrained answer keeps room to finish."""
    if not p.harmony:
        return 0
    if p.analysis_budget is not None:
        return p.analysis_budget
    default = envs.STRUCTURED_ANALYSIS_BUDGET.as_int() or 0
    return default if max_tokens is None else min(default, max_tokens // 2)


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

    def matcher(self, params: SamplingParams) -> GrammarMatcher | None:
        """A matcher at the start of the output for `params`' constraint (None without
        one); ValueError naming the problem when it does not compile."""
        p = params.structured_outputs
        if p is None:
            return None
        return self.backend.matcher(p, analysis_budget(p, params.max_tokens))
