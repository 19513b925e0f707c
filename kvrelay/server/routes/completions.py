"""`POST /v1/completions` and `POST /v1/chat/completions`: the body checked, the prompts
tokenised or the chat rendered on a prep worker (`_prepare_completion`, `_prepare_chat`;
server/prep.py), the engine's outputs collected into one JSON body or streamed as SSE
chunks (`_stream_completions`, `_stream_chat`), ended by an error event when the engine
fails the request."""
from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse

from kvrelay.engine.client import (
    EngineDeadError,
    EngineError,
    KVHoldRefused,
    KVTransferFailed,
    RequestFailed,
)
from kvrelay.engine.outputs import RequestOutput
from kvrelay.server import structured_hooks
from kvrelay.server.admission import AdmittedEngine
from kvrelay.server.chat import finish_reason
from kvrelay.server.harmony_chat import calls_limited
from kvrelay.server.prep import INLINE_BYTES, PreparedRoute, body_size
from kvrelay.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    OpenAIError,
    resolve_reasoning,
    without_reasoning,
)
from kvrelay.server.routes import server_state
from kvrelay.server.serving import (
    CompletionChunks,
    ServerState,
    _chat_logprobs,
    _check_lengths,
    _check_model,
    _collect,
    _completion_logprobs,
    _merge,
    _prompts,
    _sampling,
    _sse,
    _Timing,
    _until_disconnect,
    kv_transfer_params,
    refund_hold,
    take_hold,
)
from kvrelay.server.structured import is_harmony_chat, request_constraint
from kvrelay.server.tools import check_chat_tool_choice

router = APIRouter(route_class=PreparedRoute)


# response_model=None: the dict goes out as it is (a StreamingResponse is never validated)
@router.post("/v1/completions", response_model=None)
async def completions(body: CompletionRequest,
                      request: Request) -> StreamingResponse | dict[str, Any]:
    state = server_state(request)
    model = _check_model(state, body.model)
    kv = kv_transfer_params(body.kv_transfer_params)
    _check_batch_size(state, body)                       # before tokenising 100k prompts
    if body.suffix:
        raise OpenAIError("suffix is not supported", param="suffix")
    if body.kv_transfer_params and _batch_of(body.prompt) > 1:
        raise OpenAIError("kv_transfer_params needs a single prompt", param="prompt")
    prompts, params = await state.prep.run(_prepare_completion, state, body,
                                           size=_prep_size(request, body))
    base_id = f"cmpl-{request.state.request_id}"
    created = int(time.time())
    take_hold(state, request, kv)                       # 429 before the engine holds
    try:
        with _admitted_batch(state, len(prompts), body.n):  # 400 / 503 before any stream
            gens = [state.engine.generate(f"{base_id}-{i}", ids, p, body.kv_transfer_params)
                    for i, ((_, ids), p) in enumerate(zip(prompts, params))]
    except OpenAIError:
        refund_hold(state, request, kv)                 # refused: it holds nothing
        raise
    if body.stream:
        return StreamingResponse(_stream_completions(state, body, model, base_id, created,
                                                     prompts, gens),
                                 media_type="text/event-stream")
    finals = await _until_disconnect(request,
                                     asyncio.ensure_future(_collect(state, gens, prompts)))
    choices, completion_tokens = [], 0
    for i, out in enumerate(finals):
        text_prefix = ""
        if body.echo:
            prompt_text = prompts[i][0]
            text_prefix = prompt_text if prompt_text is not None else (
                state.tokenizer.decode(out.prompt_token_ids) if state.tokenizer else "")
        for o in out.outputs:
            completion_tokens += len(o.token_ids)
            choices.append({"index": i * body.n + o.index, "text": text_prefix + o.text,
                            "logprobs": _completion_logprobs(state, o.token_ids, o.logprobs,
                                                             len(text_prefix)),
                            "finish_reason": o.finish_reason, "stop_reason": o.stop_reason})
    prompt_tokens = sum(len(ids) for _, ids in prompts)
    return {"id": base_id, "object": "text_completion", "created": created, "model": model,
            "choices": choices, "usage": {"prompt_tokens": prompt_tokens,
                                          "completion_tokens": completion_tokens,
                                          "total_tokens": prompt_tokens + completion_tokens},
            **({"kv_transfer_params": finals[0].kv_transfer_params} if body.kv_transfer_params
               else {})}


@router.post("/v1/chat/completions", response_model=None)
async def chat_completions(body: ChatCompletionRequest,
                           request: Request) -> StreamingResponse | dict[str, Any]:
    state = server_state(request)
    model = _check_model(state, body.model)
    kv = kv_transfer_params(body.kv_transfer_params)
    if state.chat is None:
        raise OpenAIError("this model has no chat template", param="messages")
    hide_reasoning = resolve_reasoning(body)
    rendered, params = await state.prep.run(_prepare_chat, state, body,
                                            size=_prep_size(request, body))
    base_id = f"chatcmpl-{request.state.request_id}"
    created = int(time.time())
    take_hold(state, request, kv)                       # 429 before the engine holds
    try:
        gen = calls_limited(state.engine.generate(base_id, rendered.prompt_ids, params,
                                                  body.kv_transfer_params),
                            rendered.tools, state.chat)
    except OpenAIError:
        refund_hold(state, request, kv)                 # refused: it holds nothing
        raise
    if body.stream:
        return StreamingResponse(_stream_chat(state, body, model, base_id, created, rendered,
                                              gen, hide_reasoning),
                                 media_type="text/event-stream")
    (final,) = await _until_disconnect(request, asyncio.ensure_future(
        _collect(state, [gen], [(None, rendered.prompt_ids)])))
    choices, completion_tokens = [], 0
    for o in final.outputs:
        completion_tokens += len(o.token_ids)
        parsed = state.chat.parse(o.token_ids, o.text, rendered.tools)
        message = parsed.message()
        choices.append({"index": o.index,
                        "message": without_reasoning(message) if hide_reasoning else message,
                        "logprobs": _chat_logprobs(state, o.token_ids, o.logprobs,
                                                   body.top_logprobs or 0),
                        "finish_reason": finish_reason(o.finish_reason,
                                                       bool(parsed.tool_calls)),
                        "stop_reason": o.stop_reason})
    prompt_tokens = len(rendered.prompt_ids)
    return {"id": base_id, "object": "chat.completion", "created": created, "model": model,
            "choices": choices, "usage": {"prompt_tokens": prompt_tokens,
                                          "completion_tokens": completion_tokens,
                                          "total_tokens": prompt_tokens + completion_tokens},
            **({"kv_transfer_params": final.kv_transfer_params} if body.kv_transfer_params
               else {})}


def _batch_of(prompt: Any) -> int:
    """How many prompts a completion's `prompt` holds, from its shape."""
    batch = isinstance(prompt, list) and bool(prompt) and not isinstance(prompt[0], int)
    return len(prompt) if batch else 1


def _check_batch_size(state: ServerState, body: CompletionRequest) -> None:
    """400 for prompts × n over --max-seqs-per-request, from the body's shape alone."""
    if isinstance(state.engine, AdmittedEngine):
        state.engine.admission.check_size(_batch_of(body.prompt), body.n)


_GRAMMAR_FIELDS = ("response_format", "structured_outputs", "guided_json", "guided_regex",
                   "guided_choice", "guided_grammar")


def _prep_size(request: Request, body: Any) -> int:
    """The size `PrepPool.run` goes by: the body's, except that a request with an output
    constraint always goes to a worker (a small grammar can take seconds to check)."""
    if any(getattr(body, name, None) is not None for name in _GRAMMAR_FIELDS):
        return INLINE_BYTES + 1
    return body_size(request)


def _prepare_completion(state: ServerState, body: CompletionRequest
                        ) -> tuple[list[tuple[str | None, list[int]]], list[Any]]:
    """Tokenise the prompts, check the constraint and lengths, build each prompt's
    sampling parameters (on a prep worker for large requests: server/prep.py)."""
    prompts = _prompts(state, body.prompt)
    structured = request_constraint(body)
    params = []
    for _, ids in prompts:
        max_tokens = _check_lengths(state, ids, body.max_tokens)
        params.append(_sampling(state, body, max_tokens, body.logprobs, body.prompt_logprobs,
                                structured=structured))
    return prompts, params


def _prepare_chat(state: ServerState, body: ChatCompletionRequest) -> tuple[Any, Any]:
    """Render and tokenise the chat, check the constraint and length, build the sampling
    parameters (on a prep worker for large requests: server/prep.py)."""
    assert state.chat is not None, "the endpoint answers 400 without a chat template"
    rendered = state.chat.render(body, state.max_model_len)
    if not is_harmony_chat(state.chat):       # harmony's chat format carries the calls
        check_chat_tool_choice(rendered.tools, state.agent)
    max_tokens = _check_lengths(state, rendered.prompt_ids, body.max_new_tokens)
    top = (body.top_logprobs or 0) if body.logprobs else None   # logprobs alone: the chosen
    params = structured_hooks.attach(
        _sampling(state, body, max_tokens, top,
                  extra_stop_ids=rendered.stop_token_ids, logprobs_param="top_logprobs",
                  structured=request_constraint(body, is_harmony_chat(state.chat))),
        rendered.structured, rendered.tools, body)
    return rendered, params


def _admitted_batch(state: ServerState, prompts: int, n: int) -> contextlib.AbstractContextManager:
    """A completion's prompts × n admitted whole (server/admission.py); an engine without
    admission (tests' fakes) takes anything."""
    if isinstance(state.engine, AdmittedEngine):
        return state.engine.batch(prompts, n)
    return contextlib.nullcontext()


def _stream_error(e: Exception) -> dict[str, Any]:
    """The error event a stream ends with when the engine fails its request."""
    if isinstance(e, EngineError):
        return OpenAIError(str(e), param=e.param).body()
    kinds: dict[type[Exception], tuple[str, int]] = {
        KVTransferFailed: ("KVTransferError", 502),
        RequestFailed: ("InternalServerError", 500),
        KVHoldRefused: ("ServiceUnavailableError", 503)}
    kind, code = kinds.get(type(e), ("ServiceUnavailableError", 503))
    return {"error": {"message": str(e), "type": kind, "param": None, "code": code}}


async def _stream_completions(state: ServerState, body: CompletionRequest, model: str, base_id: str,
                              created: int, prompts: list[tuple[str | None, list[int]]],
                              gens: Sequence[AsyncIterator[RequestOutput]]) -> AsyncIterator[str]:
    timings = [_Timing(state.metrics) for _ in gens]
    chunks = CompletionChunks(base_id, created, model)
    completion_tokens = 0
    echoed: set[tuple[int, int]] = set()
    offsets: dict[tuple[int, int], int] = {}
    try:
        async for i, out in _merge(gens):
            new_tokens = sum(len(o.delta_token_ids) for o in out.outputs)
            timings[i].tokens_arrived(new_tokens)
            completion_tokens += new_tokens
            for o in out.outputs:
                if not o.delta_text and not o.delta_token_ids and o.finish_reason is None:
                    continue
                text = o.delta_text
                if body.echo and (i, o.index) not in echoed:
                    echoed.add((i, o.index))
                    text = (prompts[i][0] or (state.tokenizer.decode(prompts[i][1])
                                              if state.tokenizer else "")) + text
                key = (i, o.index)
                lp = _completion_logprobs(state, o.delta_token_ids, o.delta_logprobs,
                                          offsets.get(key, 0))
                offsets[key] = offsets.get(key, 0) + len(text)
                yield chunks.chunk(i * body.n + o.index, text, lp, o.finish_reason,
                                   o.stop_reason)
            if out.finished:
                timings[i].finished(len(prompts[i][1]), [o.finish_reason for o in out.outputs])
    except (EngineError, EngineDeadError, KVTransferFailed, RequestFailed) as e:
        yield _sse(_stream_error(e))
        yield "data: [DONE]\n\n"
        return
    if body.stream_options and body.stream_options.include_usage:
        prompt_tokens = sum(len(ids) for _, ids in prompts)
        yield _sse({"id": base_id, "object": "text_completion", "created": created, "model": model,
                    "choices": [],
                    "usage": {"prompt_tokens": prompt_tokens,
                              "completion_tokens": completion_tokens,
                              "total_tokens": prompt_tokens + completion_tokens}})
    yield "data: [DONE]\n\n"


async def _stream_chat(state: ServerState, body: ChatCompletionRequest, model: str, base_id: str,
                       created: int, rendered: Any, gen: AsyncIterator[RequestOutput],
                       hide_reasoning: bool = False) -> AsyncIterator[str]:
    def shown(deltas: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The deltas a client sees (`reasoning.exclude`: none that only carry reasoning)."""
        if not hide_reasoning:
            return deltas
        return [d for d in map(without_reasoning, deltas) if d]

    timing = _Timing(state.metrics)
    completion_tokens = 0
    streams: dict[int, Any] = {}
    chat = state.chat
    assert chat is not None, "the chat endpoint answers 400 without a chat template"

    def chunk(index: int, delta: dict[str, Any], finish: str | None = None, **extra: Any) -> str:
        return _sse({"id": base_id, "object": "chat.completion.chunk", "created": created,
                     "model": model,
                     "choices": [{"index": index, "delta": delta, "logprobs": extra.get("logprobs"),
                                  "finish_reason": finish,
                                  **({"stop_reason": extra["stop_reason"]} if finish else {})}]})

    for index in range(body.n):
        yield chunk(index, {"role": "assistant", "content": ""})
    try:
        async for _, out in _merge([gen]):
            new_tokens = sum(len(o.delta_token_ids) for o in out.outputs)
            timing.tokens_arrived(new_tokens)
            completion_tokens += new_tokens
            for o in out.outputs:
                parser = streams.setdefault(o.index, chat.stream_parser(rendered.tools))
                lp = _chat_logprobs(state, o.delta_token_ids, o.delta_logprobs,
                                    body.top_logprobs or 0)
                for delta in shown(parser.feed(o.delta_token_ids, o.delta_text)):
                    yield chunk(o.index, delta, logprobs=lp)
                    lp = None
                if o.finish_reason is not None:
                    for delta in shown(parser.flush()):
                        yield chunk(o.index, delta)
                    yield chunk(o.index, {}, finish_reason(o.finish_reason, parser.made_calls),
                                stop_reason=o.stop_reason)
            if out.finished:
                timing.finished(len(rendered.prompt_ids), [o.finish_reason for o in out.outputs])
    except (EngineError, EngineDeadError, KVTransferFailed, RequestFailed) as e:
        yield _sse(_stream_error(e))
    else:
        if body.stream_options and body.stream_options.include_usage:
            prompt_tokens = len(rendered.prompt_ids)
            yield _sse({"id": base_id, "object": "chat.completion.chunk", "created": created,
                        "model": model, "choices": [],
                        "usage": {"prompt_tokens": prompt_tokens,
                                  "completion_tokens": completion_tokens,
                                  "total_tokens": prompt_tokens + completion_tokens}})
    yield "data: [DONE]\n\n"
