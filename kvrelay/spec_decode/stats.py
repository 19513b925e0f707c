"""The counters behind vLLM's `vllm:spec_decode_*` metrics. Owner: the engine (one per
engine core), updated once per verified draft after the scheduler's update."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecDecodeStats:
    num_drafts: int = 0                  # speculative chunks verified (one draft each)
    num_draft_tokens: int = 0            # draft tokens proposed
    num_accepted_tokens: int = 0         # of which the target accepted
    accepted_per_pos: list[int] = field(default_factory=list)   # [j]: drafts accepted at j

    def record(self, drafted: int, accepted: int) -> None:
        """One draft of `drafted` tokens whose first `accepted` were accepted."""
        self.num_drafts += 1
        self.num_draft_tokens += drafted
        self.num_accepted_tokens += accepted
        if len(self.accepted_per_pos) < drafted:
            self.accepted_per_pos += [0] * (drafted - len(self.accepted_per_pos))
        for j in range(accepted):
            self.accepted_per_pos[j] += 1
