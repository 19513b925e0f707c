"""A request as the engine sees it. Owner: the scheduler (status, computed tokens)."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import msgspec

from kvrelay.disagg.params import KVTransferParams
from kvrelay.sampling_params import SamplingParams

if TYPE_CHECKING:
    import torch

    from kvrelay.structured.backend import GrammarMatcher


class Status(enum.Enum):
    WAITING = "waiting"
    WAITING_FOR_REMOTE_KV = "waiting_for_remote_kv"   # decode: pulling the prompt's KV
    RUNNING = "running"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def finished(self) -> bool:
        return self in (Status.FINISHED_STOPPED, Status.FINISHED_LENGTH, Status.FINISHED_ABORTED)


class Logprob(msgspec.Struct, array_like=True, gc=False):
    """One token's log-probability and rank (crosses to the API process in outputs)."""

    token_id: int
    logprob: float
    rank: int


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    eos_token_ids: tuple[int, ...] = ()
    arrival: int = 0      # Scheduler.add's counter; read by nothing: queue order is priority
    status: Status = Status.WAITING
    num_computed_tokens: int = 0
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    prompt_logprobs: list[dict[int, Logprob] | None] = field(default_factory=list)
    stop_reason: int | str | None = None
    num_preemptions: int = 0
    num_cached_tokens: int = 0                # prompt tokens served from the prefix cache
    generator: torch.Generator | None = None
    fork_of: Request | None = None            # n > 1: waits for this sibling's prompt KV
    kv_transfer: KVTransferParams | None = None   # disaggregated serving (see kvrelay/disagg)
    error: str | None = None  # why an aborted request failed (reported to the client)
    error_status: int = 502   # its HTTP status: 502 a failed KV transfer, 400 refused KV params
    grammar: GrammarMatcher | None = None     # structured outputs: advanced with every token

    def __post_init__(self) -> None:
        self.all_token_ids = list(self.prompt_token_ids)
        if self.params.seed is not None:
            # imported here: the scheduler and the API process import this module, and
            # only the engine core (which has torch loaded already) samples
            import torch
            self.generator = torch.Generator().manual_seed(self.params.seed)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def remote_prefill(self) -> bool:
        """Decode side: the prompt's KV is to be pulled from a prefill server."""
        return bool(self.kv_transfer and self.kv_transfer.do_remote_prefill)

    @property
    def remote_decode(self) -> bool:
        """Prefill side: keep the KV blocks for a decode server when finished."""
        return bool(self.kv_transfer and self.kv_transfer.do_remote_decode)

    @property
    def waits_for_sibling(self) -> bool:
        """An n > 1 child is admitted once its first sibling has computed the prompt,
        so it starts from the prompt's cached blocks instead of recomputing them."""
        first = self.fork_of
        return (first is not None and not first.status.finished
                and first.num_computed_tokens < first.num_prompt_tokens)

    def append_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
        if self.grammar is not None:
            self.grammar.accept(token_id)

    def truncate_output(self, n: int) -> None:
        """Keep the first n output tokens (and their logprobs): a stop string ended the
        output inside the tokens one speculative step appended. Never with a grammar
        (those requests do not speculate: its matcher cannot step back)."""
        drop = len(self.output_token_ids) - n
        if drop <= 0:
            return
        assert self.grammar is None, "a grammar's matcher cannot drop tokens"
        del self.output_token_ids[n:]
        del self.all_token_ids[len(self.all_token_ids) - drop:]
        del self.output_logprobs[n:]
