"""From the scheduler's sequences to the client's outputs.

Owner of: the client requests (`ParentRequest`: an n > 1 request fans out into n child
sequences sharing the prompt and its cached blocks), their incremental detokenizers,
and how much of each child was already reported (the deltas a stream sends).

    add_request ─▶ fan_out ─▶ admit (all sequences or none)
    each step:  outputs(SchedulerOutput) ─▶ detokenize (stop strings end a sequence)
                ─▶ request_output: cumulative + delta fields ─▶ `hold` (disaggregation)
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from kvrelay.disagg.params import KVTransferParams
from kvrelay.engine.detokenizer import PROMPT_CONTEXT, IncrementalDetokenizer
from kvrelay.engine.outputs import CompletionOutput, RequestOutput
from kvrelay.engine.request import Request, Status
from kvrelay.engine.scheduler import Scheduler
from kvrelay.engine.scheduler_output import SchedulerOutput
from kvrelay.model.tokenizer import CheckpointTokenizer
from kvrelay.sampling_params import SamplingParams

if TYPE_CHECKING:
    from kvrelay.structured.backend import GrammarMatcher

# (request, error, where) — fail the request alone; (output, first child) — a finished
# prefill's blocks held for a decode server (`KVTransferGlue.hold`)
FailFn = Callable[[Request, BaseException, str], None]
HoldFn = Callable[[RequestOutput, Request], None]


@dataclass
class ParentRequest:
    """A client request: its child sequences share the prompt (and its cached KV blocks)."""
    request_id: str
    prompt: str | None
    children: list[Request]
    detok: dict[str, IncrementalDetokenizer] = field(default_factory=dict)
    sent: dict[str, int] = field(default_factory=dict)     # tokens already reported per child


def fan_out(request_id: str, ids: list[int], params: SamplingParams, eos: tuple[int, ...],
            transfer: KVTransferParams | None, grammar: GrammarMatcher | None) -> list[Request]:
    """n sequences: ids `i_<id>` (just `<id>` when n = 1), seeds seed + i; the first
    carries the KV transfer, the others fork from it."""
    children: list[Request] = []
    for i in range(params.n):
        child_params = params if params.n == 1 else replace(
            params, n=1, seed=None if params.seed is None else params.seed + i)
        child_id = request_id if params.n == 1 else f"{i}_{request_id}"
        children.append(Request(child_id, ids, child_params, eos,
                                fork_of=children[0] if children else None,
                                kv_transfer=transfer if not children else None,
                                grammar=grammar.fork() if grammar else None))
    return children


class OutputProcessor:
    """`final_only` (offline `LLM.generate`, like vLLM's FINAL_ONLY): a request's output
    is built once, when it finishes, instead of at every step it is touched (a server
    streams every step's delta; offline the per-step outputs were thrown away). Its
    deltas then hold everything, like the cumulative fields. A sequence without stop
    strings is also detokenised only then: `IncrementalDetokenizer.add` goes token by
    token whatever it is given, so the text is the same, without a call per step."""

    def __init__(self, tokenizer: CheckpointTokenizer | None, scheduler: Scheduler,
                 fail: FailFn, hold: HoldFn, final_only: bool = False) -> None:
        self.tokenizer, self.scheduler, self.fail, self.hold = tokenizer, scheduler, fail, hold
        self.final_only = final_only
        self.parents: dict[str, ParentRequest] = {}
        self.child_parent: dict[str, ParentRequest] = {}

    def admit(self, parent: ParentRequest) -> None:
        """All of the request's sequences go to the scheduler, or none."""
        try:
            for child in parent.children:
                self.scheduler.add(child)
                self.child_parent[child.request_id] = parent
        except BaseException:
            for child in parent.children:
                if self.child_parent.pop(child.request_id, None) is not None:
                    self.scheduler.abort(child.request_id)
            raise
        self.parents[parent.request_id] = parent

    def parent_of(self, child_id: str) -> ParentRequest | None:
        return self.child_parent.get(child_id)

    def pop(self, request_id: str) -> ParentRequest | None:
        """Stop tracking a client request (aborted or failed)."""
        parent = self.parents.pop(request_id, None)
        if parent is not None:
            self.forget(parent)
        return parent

    def forget(self, parent: ParentRequest) -> None:
        self.parents.pop(parent.request_id, None)
        for child in parent.children:
            self.child_parent.pop(child.request_id, None)

    def outputs(self, out: SchedulerOutput) -> list[RequestOutput]:
        """One output per client request this step touched (preempted ones included:
        their output stays put); finished requests are forgotten."""
        touched: dict[str, ParentRequest] = {}
        for chunk in out.chunks:
            req = chunk.request
            if self.final_only and not req.params.stop and not req.status.finished:
                continue          # detokenised whole when it finishes: the same text
            parent = self.child_parent.get(req.request_id)
            if parent is not None:
                try:
                    self._detokenize(parent, chunk.request)
                except Exception as e:  # noqa: BLE001 -- e.g. a stop string; this request only
                    self.fail(chunk.request, e, "detokenizing")
                    continue
                touched[parent.request_id] = parent
        if not self.final_only:          # a preempted request's output stays put
            for request_id in out.preempted:
                parent = self.child_parent.get(request_id)
                if parent is not None:
                    touched.setdefault(parent.request_id, parent)
        results = []
        for parent in touched.values():
            if self.parents.get(parent.request_id) is not parent:
                continue                                 # failed after it was touched
            if self.final_only and not all(c.status.finished for c in parent.children):
                continue
            try:
                result = self.request_output(parent)
            except Exception as e:  # noqa: BLE001 -- this request's failure only
                self.fail(parent.children[0], e, "building its output")
                continue
            results.append(result)
            if result.finished:
                self.forget(parent)
        return results

    def failed_outputs(self, failed: list[Request]) -> list[RequestOutput]:
        """Outputs for sequences whose KV load failed (error set by the scheduler)."""
        outputs = []
        for req in failed:
            parent = self.child_parent.get(req.request_id)
            if parent is not None:
                out = self.request_output(parent)
                out.error, out.error_status = req.error, req.error_status
                outputs.append(out)
                if out.finished:
                    self.forget(parent)
        return outputs

    def _detokenize(self, parent: ParentRequest, req: Request) -> None:
        if self.tokenizer is None:
            return
        detok = parent.detok.get(req.request_id)
        if detok is None:
            stops: Sequence[str] = req.params.stop or ()   # a list after SamplingParams' checks
            detok = parent.detok[req.request_id] = IncrementalDetokenizer(
                self.tokenizer, req.prompt_token_ids, stops,
                req.params.include_stop_str_in_output, req.params.skip_special_tokens)
        context = min(len(req.prompt_token_ids), PROMPT_CONTEXT)
        stop = detok.add(req.output_token_ids[len(detok.ids) - context:])
        if stop is None:
            return
        # the detokenizer stops reading at the token that completes the stop string; a
        # speculative step may have appended more, which never reach the client
        read = len(detok.ids) - context
        if req.status is Status.RUNNING or read < len(req.output_token_ids):
            self.scheduler.finish_stopped(req, stop, read)

    def request_output(self, parent: ParentRequest) -> RequestOutput:
        """Cumulative text/tokens/logprobs per child, and what each adds since last time."""
        outputs = []
        for i, child in enumerate(parent.children):
            reason = child.status.value if child.status.finished else None
            detok = parent.detok.get(child.request_id)
            sent = parent.sent.get(child.request_id, 0)
            logprobs = child.output_logprobs if child.params.logprobs is not None else None
            outputs.append(CompletionOutput(
                i, detok.text if detok else "", list(child.output_token_ids), reason,
                child.stop_reason, logprobs,
                delta_text=detok.take(reason is not None) if detok else "",
                delta_token_ids=child.output_token_ids[sent:],
                delta_logprobs=logprobs[sent:] if logprobs is not None else None))
            parent.sent[child.request_id] = len(child.output_token_ids)
        first = parent.children[0]
        out = RequestOutput(
            parent.request_id, parent.prompt, list(first.prompt_token_ids), outputs,
            first.prompt_logprobs if first.params.prompt_logprobs is not None else None,
            first.num_cached_tokens, all(o.finished for o in outputs))
        self.hold(out, first)
        return out


def error_output(parent: ParentRequest, message: str) -> RequestOutput:
    """The final output of a request failed inside the engine (HTTP 500 for its client)."""
    first = parent.children[0]
    outputs = [CompletionOutput(i, "", [], "abort") for i in range(len(parent.children))]
    return RequestOutput(parent.request_id, parent.prompt, list(first.prompt_token_ids), outputs,
                         finished=True, error=message, error_status=500)
