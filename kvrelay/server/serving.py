"""The request pipeline the OpenAI endpoints share (api.py's completions and chat,
responses.py's Responses API): the server's state, the checks a request passes before it
reaches the engine (model name, lengths, hold rate, sampling parameters against the model),
merging and collecting the engine's output streams, and the per-request timing metrics.
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request

from kvrelay.disagg.params import KVTransferParams
from kvrelay.engine.client import (
    EngineClient,
    EngineError,
)
from kvrelay.engine.outputs import RequestOutput
from kvrelay.model.tokenizer import CheckpointTokenizer
from kvrelay.sampling_params import (
    SamplingParams,
    SamplingParamsError,
    check_token_ids,
    validate_for_model,
)
from kvrelay.server.admission import DEFAULT_MAX_SEQS_PER_REQUEST, AdmittedEngine
from kvrelay.server.chat import ChatRenderer
from kvrelay.server.hold_limit import HoldRateLimiter, retry_after
from kvrelay.server.limits import RequestLimits
from kvrelay.server.metrics import ServerMetrics
from kvrelay.server.prep import PrepPool
from kvrelay.server.prompt_tokens import TokenizerFacts, encode_within, tokenizer_facts
from kvrelay.server.protocol import (
    OpenAIError,
)
from kvrelay.server.tools import AgentOptions
from kvrelay.structured.params import StructuredOutputsParams

logger = logging.getLogger(__name__)


@dataclass
class ServerState:
    engine: EngineClient          # AsyncEngine, or DataParallelEngine with -dp N
    tokenizer: CheckpointTokenizer | None
    served_names: list[str]
    max_model_len: int
    max_logprobs: int
    api_key: str | None = None
    vocab_size: int = 0          # from the engine once ready; 0: not known (the engine checks)
    defaults: dict[str, Any] = field(default_factory=dict)   # generation_config.json sampling
    chat: ChatRenderer | None = None
    metrics: ServerMetrics | None = None
    agent: AgentOptions = field(default_factory=AgentOptions)   # tool / responses flags
    accepting: bool = True
    hold_limiter: HoldRateLimiter | None = None   # prefill: per-client do_remote_decode rate
    # what the tokenizer guarantees (found once at start-up; None: find it now)
    token_facts: TokenizerFacts | None = None
    prep: PrepPool = field(default_factory=PrepPool)   # tokenising etc. off the event loop

    def __post_init__(self) -> None:
        if self.token_facts is None:
            self.token_facts = tokenizer_facts(self.tokenizer)

    @property
    def ready(self) -> bool:
        """Requests are taken: the engine is up and alive, its model length is known (it is
        set from the engine's info once the engine is ready: a request taken before would
        meet "maximum context length is 0"), and the server is not draining."""
        return (self.engine.ready.is_set() and not self.engine.dead and self.accepting
                and self.max_model_len > 0)

    def request_limits(self) -> RequestLimits:
        engine = self.engine
        prompts = (engine.admission.limits.max_per_request if isinstance(engine, AdmittedEngine)
                   else DEFAULT_MAX_SEQS_PER_REQUEST)
        return RequestLimits(self.max_model_len, prompts, self.token_facts or TokenizerFacts())


def _check_model(state: ServerState, model: str | None) -> str:
    if model is None:
        return state.served_names[0]
    if model not in state.served_names:
        raise OpenAIError(f"The model `{model}` does not exist.", 404, "NotFoundError", "model")
    return model


def _tokenize(state: ServerState, prompt: str) -> list[int]:
    """The prompt's ids, counted in pieces so a prompt longer than the context is refused
    after at most about that many tokens (server/prompt_tokens.py)."""
    if state.tokenizer is None:
        raise OpenAIError("this model has no tokenizer; send prompts as token ids", param="prompt")
    facts = state.token_facts or TokenizerFacts()
    try:
        return encode_within(state.tokenizer, facts, prompt, state.max_model_len)
    except OpenAIError:
        raise
    except Exception as e:  # noqa: BLE001 -- text the tokenizer cannot take is the client's
        raise OpenAIError(f"the prompt could not be tokenized: {e}", param="prompt") from None


def _prompts(state: ServerState, prompt: Any) -> list[tuple[str | None, list[int]]]:
    prompts = _prompt_list(state, prompt)
    if state.vocab_size:
        for _, ids in prompts:                   # every list of a batch, before any is sent
            _check(check_token_ids, ids, state.vocab_size, "prompt")
    return prompts


def _prompt_list(state: ServerState, prompt: Any) -> list[tuple[str | None, list[int]]]:
    if isinstance(prompt, str):
        return [(prompt, _tokenize(state, prompt))]
    if prompt and all(isinstance(p, int) for p in prompt):
        return [(None, list(prompt))]
    if prompt and all(isinstance(p, str) for p in prompt):
        return [(p, _tokenize(state, p)) for p in prompt]
    if prompt and all(isinstance(p, list) for p in prompt):
        return [(None, list(p)) for p in prompt]
    raise OpenAIError("prompt must be a non-empty string, list of strings, or token id list(s)",
                      param="prompt")


class _Busy(OpenAIError):
    """An OpenAIError with a Retry-After header (429 a client's rate, 503 a full prefill)."""

    def __init__(self, message: str, status: int, type_: str, wait_s: float) -> None:
        super().__init__(message, status, type_)
        self.headers = {"Retry-After": str(retry_after(wait_s))}


HOLD_RETRY_AFTER_S = 1
_KV_FLAGS = ("do_remote_decode", "do_remote_prefill")


def kv_transfer_params(raw: Any) -> KVTransferParams | None:
    """A request's kv_transfer_params, parsed once: what the hold rate is charged on is
    what the engine holds for. The flags must be JSON booleans (a truthy `1`, `"x"` or
    `[1]` once placed a hold the rate check did not count); 400 naming the field."""
    if isinstance(raw, dict):
        for flag in _KV_FLAGS:
            if flag in raw and not isinstance(raw[flag], bool):
                raise OpenAIError(f"kv_transfer_params.{flag} must be a JSON boolean (true or "
                                  f"false), got {type(raw[flag]).__name__}",
                                  param=f"kv_transfer_params.{flag}")
    try:
        return KVTransferParams.from_dict(raw)
    except ValueError as e:
        raise OpenAIError(str(e), param=getattr(e, "param", "kv_transfer_params")) from None


def _check_hold_rate(state: ServerState, request: Request,
                     raw: Any) -> KVTransferParams | None:
    """Parse `raw` kv_transfer_params (`kv_transfer_params`) and charge a hold that it
    places (`take_hold`); returns the parsed params."""
    params = kv_transfer_params(raw)
    take_hold(state, request, params)
    return params


def take_hold(state: ServerState, request: Request, params: KVTransferParams | None) -> None:
    """A do_remote_decode request places a KV hold: at most `hold_rate` per second per
    client (kvrelay/server/hold_limit.py), else 429 with Retry-After."""
    limiter = state.hold_limiter
    if limiter is None or params is None or not params.do_remote_decode:
        return
    client = _hold_client(state, request)
    wait = limiter.take(client) if client is not None else None
    if wait is not None:
        raise _Busy(limiter.message(wait), 429, "RateLimitError", wait)


def refund_hold(state: ServerState, request: Request, params: KVTransferParams | None) -> None:
    """Give back the hold `take_hold` charged for a request the server then refused
    before it reached the engine (a full queue), so only requests that hold are charged."""
    limiter = state.hold_limiter
    if limiter is None or params is None or not params.do_remote_decode:
        return
    client = _hold_client(state, request)
    if client is not None:
        limiter.refund(client)


def _hold_client(state: ServerState, request: Request) -> str | None:
    """Who is rate-bounded: the peer address; None (not bounded) for a request that
    presented the server's --api-key (the door refused every other one): only the
    operator's components, e.g. the proxy, hold it, and one shared key cannot tell
    clients apart."""
    if state.api_key:
        return None
    return request.client.host if request.client else "unknown"


def _check(check: Any, *args: Any) -> Any:
    """Run a sampling_params check; its SamplingParamsError becomes a 400 naming the field."""
    try:
        return check(*args)
    except SamplingParamsError as e:
        raise OpenAIError(str(e), param=e.param) from None
    except ValueError as e:
        raise OpenAIError(str(e)) from None


def _check_lengths(state: ServerState, ids: list[int], max_tokens: int | None) -> int:
    """Validates the prompt against the context; returns the max_tokens to use."""
    n = len(ids)
    if n == 0:
        raise OpenAIError("the prompt is empty", param="prompt")
    if n >= state.max_model_len:
        raise OpenAIError(
            f"This model's maximum context length is {state.max_model_len} tokens. However, your "
            f"prompt has {n} tokens, leaving no room for a completion.", param="prompt")
    room = state.max_model_len - n
    if max_tokens is None:
        return room
    if max_tokens > room:
        raise OpenAIError(
            f"This model's maximum context length is {state.max_model_len} tokens. However, you "
            f"requested {n + max_tokens} tokens ({n} in the prompt, {max_tokens} in the "
            "completion). Please reduce the length of the prompt or "
            "max_tokens.", param="max_tokens")
    return max_tokens


def _sampling(state: ServerState, body: Any, max_tokens: int, logprobs: int | None,
              prompt_logprobs: int | None = None, extra_stop_ids: list[int] | None = None,
              logprobs_param: str = "logprobs",
              structured: StructuredOutputsParams | None = None) -> SamplingParams:
    for name, asked in ((logprobs_param, logprobs), ("prompt_logprobs", prompt_logprobs)):
        if asked is not None and state.max_logprobs != -1 and asked > state.max_logprobs:
            hint = (" (logprobs are disabled on this server: --max-logprobs 0)"
                    if state.max_logprobs == 0 else "")
            raise OpenAIError(f"{name}={asked} exceeds the server's --max-logprobs "
                              f"{state.max_logprobs}{hint}", param=name)
    best_of = getattr(body, "best_of", None)      # request models without it (e.g. new endpoints)
    if best_of is not None and best_of > 1:
        # vLLM's V1 engine refuses it too; silently returning n samples would mislead
        raise OpenAIError("best_of > 1 is not supported; use n", param="best_of")
    params = _check(_make_sampling, state, body, max_tokens, logprobs, prompt_logprobs,
                    extra_stop_ids, structured)
    if state.vocab_size:
        _check(validate_for_model, params, state.vocab_size, state.max_logprobs, logprobs_param)
    return params


def _make_sampling(state: ServerState, body: Any, max_tokens: int, logprobs: int | None,
                   prompt_logprobs: int | None, extra_stop_ids: list[int] | None,
                   structured: StructuredOutputsParams | None) -> SamplingParams:
    d = state.defaults
    return SamplingParams(
        n=body.n,
        temperature=body.temperature if body.temperature is not None else d.get("temperature", 1.0),
        top_p=body.top_p if body.top_p is not None else d.get("top_p", 1.0),
        top_k=body.top_k if body.top_k is not None else d.get("top_k", 0),
        min_p=body.min_p if body.min_p is not None else 0.0,
        seed=body.seed, max_tokens=max_tokens, min_tokens=body.min_tokens, stop=body.stop,
        stop_token_ids=(body.stop_token_ids or []) + (extra_stop_ids or []),
        ignore_eos=body.ignore_eos, logprobs=logprobs, prompt_logprobs=prompt_logprobs,
        include_stop_str_in_output=body.include_stop_str_in_output,
        skip_special_tokens=body.skip_special_tokens, logit_bias=getattr(body, "logit_bias", None),
        structured_outputs=structured)


def _token_text(state: ServerState, token_id: int) -> str:
    return state.tokenizer.decode([token_id],
                                  skip_special_tokens=False) if state.tokenizer else str(token_id)


def _completion_logprobs(state: ServerState, token_ids: list[int], logprobs: list | None,
                         offset: int = 0) -> dict[str, Any] | None:
    if logprobs is None:
        return None
    tokens, token_lps, tops, offsets = [], [], [], []
    pos = offset
    for tid, lp in zip(token_ids, logprobs):
        text = _token_text(state, tid)
        tokens.append(text)
        token_lps.append(lp[tid].logprob)
        tops.append({_token_text(state, t): v.logprob for t, v in lp.items()})
        offsets.append(pos)
        pos += len(text)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops,
            "text_offset": offsets}


def _chat_logprobs(state: ServerState, token_ids: list[int], logprobs: list | None,
                   top_n: int) -> dict[str, Any] | None:
    if logprobs is None:
        return None
    content = []
    for tid, lp in zip(token_ids, logprobs):
        text = _token_text(state, tid)
        top = sorted(lp.values(), key=lambda v: v.rank)[:top_n] if top_n else []
        content.append({"token": text, "logprob": lp[tid].logprob, "bytes": list(text.encode()),
                        "top_logprobs": [{"token": _token_text(state, v.token_id),
                                          "logprob": v.logprob,
                                          "bytes": list(_token_text(state, v.token_id).encode())}
                                         for v in top]})
    return {"content": content}


async def _merge(streams: Sequence[AsyncIterator[RequestOutput]]
                 ) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Interleave several generators' outputs as they arrive (prompt index, output)."""
    if len(streams) == 1:                      # the common case: no pump task, no queue
        try:
            async for out in streams[0]:
                yield 0, out
        finally:
            await _close(streams[0])
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(i: int, stream: AsyncIterator[RequestOutput]) -> None:
        try:
            async for out in stream:
                await queue.put((i, out))
        except BaseException as e:  # forward to the consumer
            await queue.put((i, e))
        finally:
            await queue.put((i, done))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    remaining = len(tasks)
    try:
        while remaining:
            i, item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        # a generator still running in its pump cannot be closed; once the cancelled
        # pumps have ended every generator has run its own cleanup (the aborts)
        await asyncio.gather(*tasks, return_exceptions=True)
        for s in streams:
            await _close(s)


async def _close(stream: AsyncIterator[RequestOutput]) -> None:
    """Run a generator's cleanup (its abort) now, not when it is garbage-collected."""
    if isinstance(stream, AsyncGenerator):
        await stream.aclose()


class _Timing:
    """Observes TTFT / ITL / e2e for one request into the metrics."""

    def __init__(self, metrics: ServerMetrics | None) -> None:
        self.metrics, self.start, self.tokens = metrics, time.monotonic(), 0
        self.last: float | None = None

    def tokens_arrived(self, n: int) -> None:
        if not self.metrics or n <= 0:
            return
        now = time.monotonic()
        if self.last is None:
            self.metrics.ttft.observe(now - self.start)
        else:
            self.metrics.itl.observe((now - self.last) / n)
        self.last, self.tokens = now, self.tokens + n
        self.metrics.generation_tokens.inc(n)

    def finished(self, prompt_tokens: int, reasons: list[str | None]) -> None:
        if not self.metrics:
            return
        self.metrics.e2e.observe(time.monotonic() - self.start)
        self.metrics.prompt_tokens.inc(prompt_tokens)
        for reason in reasons:
            self.metrics.request_success.labels(self.metrics.model_name, reason or "abort").inc()


_to_json = json.JSONEncoder(ensure_ascii=False).encode   # json.dumps builds one per call


def _sse(payload: dict[str, Any]) -> str:
    return f"data: {_to_json(payload)}\n\n"


class CompletionChunks:
    """The SSE events of one streamed /v1/completions response, the part every event shares
    serialised once: per token only the choice's values are encoded. Byte for byte what
    `_sse` makes of the same dict (tests/server/test_sse_chunks.py)."""

    def __init__(self, base_id: str, created: int, model: str) -> None:
        head = _to_json({"id": base_id, "object": "text_completion", "created": created,
                         "model": model, "choices": []})
        self._head = f"data: {head[:-2]}{{\"index\": "       # up to the choice's index

    def chunk(self, index: int, text: str, logprobs: dict[str, Any] | None,
              finish_reason: str | None, stop_reason: int | str | None) -> str:
        return (f"{self._head}{index}, \"text\": {_json_str(text)}, \"logprobs\": "
                f"{_json_or_null(logprobs)}, \"finish_reason\": {_json_or_null(finish_reason)}, "
                f"\"stop_reason\": {_json_or_null(stop_reason)}}}]}}\n\n")


def _json_or_null(value: Any) -> str:
    return "null" if value is None else _to_json(value)        # None: every token but the last


_json_str = json.encoder.encode_basestring          # a str as JSON, non-ASCII kept (as _to_json)


async def _until_disconnect(request: Request, work: asyncio.Future) -> Any:
    """Await `work`, cancelling it if the client goes away (which aborts the request)."""
    async def watch() -> None:
        while not await request.is_disconnected():
            await asyncio.sleep(0.05)

    watcher = asyncio.ensure_future(watch())
    try:
        done, _ = await asyncio.wait({work, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if work in done:
            return work.result()
        work.cancel()
        try:
            await work
        except BaseException:
            pass
        raise OpenAIError("client disconnected", 499, "ClientClosedRequest")
    finally:
        watcher.cancel()


async def _collect(state: ServerState, gens: Sequence[AsyncIterator[RequestOutput]],
                   prompts: list[tuple[str | None, list[int]]]) -> list[RequestOutput]:
    finals: list[RequestOutput | None] = [None] * len(gens)
    timings = [_Timing(state.metrics) for _ in gens]
    try:
        async for i, out in _merge(gens):
            timings[i].tokens_arrived(sum(len(o.delta_token_ids) for o in out.outputs))
            if out.finished:
                finals[i] = out
                timings[i].finished(len(prompts[i][1]), [o.finish_reason for o in out.outputs])
    except EngineError as e:
        raise OpenAIError(str(e), param=e.param) from None
    return finals  # type: ignore[return-value]
