"""Streaming OpenAI-compatible requests, timed chunk by chunk.

Works against kvrelay, vLLM and any server that streams `/v1/completions` or
`/v1/chat/completions` as SSE. Every failure (connection, HTTP status, an error event,
a malformed chunk, a stream with no text) becomes a failed `RequestResult` with its
message; nothing here raises.
"""
from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import httpx

from kvrelay.bench.datasets import SampleRequest
from kvrelay.bench.metrics import RequestResult
from kvrelay.bench.sse import SSEParser

ENDPOINTS = ("/v1/completions", "/v1/chat/completions")


@dataclass(frozen=True)
class RequestOptions:
    """The parts of every request body that come from flags."""

    endpoint: str = "/v1/completions"
    model: str = ""
    ignore_eos: bool = False
    temperature: float = 0.0

    def __post_init__(self) -> None:
        if self.endpoint not in ENDPOINTS:
            raise ValueError(f"--endpoint must be one of {', '.join(ENDPOINTS)}; got "
                             f"{self.endpoint}")

    @property
    def chat(self) -> bool:
        return self.endpoint == "/v1/chat/completions"

    def body(self, req: SampleRequest) -> dict[str, Any]:
        body: dict[str, Any] = {"model": self.model, "stream": True,
                                "stream_options": {"include_usage": True},
                                "temperature": self.temperature}
        if self.chat:
            body["messages"] = req.chat_messages()
            body["max_completion_tokens"] = req.output_len
        else:
            body["prompt"] = req.prompt
            body["max_tokens"] = req.output_len
        if self.ignore_eos:
            body["ignore_eos"] = True
        return body


def chunk_text(chunk: dict[str, Any]) -> str:
    """The generated text a chunk carries: completions' `text`, or chat's delta content and
    reasoning (gpt-oss streams its analysis channel as `reasoning`/`reasoning_content`)."""
    text = ""
    for choice in chunk.get("choices") or []:
        if "text" in choice:
            text += choice.get("text") or ""
        delta = choice.get("delta") or {}
        for key in ("content", "reasoning", "reasoning_content"):
            value = delta.get(key)
            if isinstance(value, str):
                text += value
                if key == "reasoning":
                    break                         # a server sending both names sends the same text
    return text


def _error_text(resp: httpx.Response, body: bytes) -> str:
    try:
        err = json.loads(body).get("error")
        message = err.get("message") if isinstance(err, dict) else err
    except (ValueError, AttributeError):
        message = body.decode(errors="replace")[:300]
    return f"HTTP {resp.status_code}: {message}"


async def send(client: httpx.AsyncClient, url: str, opts: RequestOptions, req: SampleRequest,
               t0: float, count_tokens: Callable[[str], int] | None = None) -> RequestResult:
    """POST one streaming request; `t0` is the benchmark's start (perf_counter) for the
    result's start/chunk times. `count_tokens(text)` counts output tokens when the server
    sends no usage (else: one token per text chunk)."""
    result = RequestResult(prompt_len=req.prompt_len)
    start = time.perf_counter()
    result.start_time = start - t0
    stream = _StreamReader(result, start, t0)
    try:
        async with client.stream("POST", url, json=opts.body(req)) as resp:
            if resp.status_code != 200:
                result.error = _error_text(resp, await resp.aread())
                result.latency = time.perf_counter() - start
                return result
            await stream.read(resp)
        result.latency = time.perf_counter() - start
    except (httpx.HTTPError, OSError, ValueError, RuntimeError) as e:
        result.latency = time.perf_counter() - start
        result.error = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
        return result
    return stream.finish(count_tokens)


class _StreamReader:
    """One SSE stream read into its RequestResult: the times of its text chunks (ttft, itl,
    chunk_times), the text of each and the last usage the server sent."""

    def __init__(self, result: RequestResult, start: float, t0: float) -> None:
        self.result = result
        self.start = start                  # the request's perf_counter start
        self.t0 = t0                        # the benchmark's
        self.last = start                   # the previous text chunk's arrival
        self.texts: list[str] = []
        self.usage: dict[str, Any] | None = None

    async def read(self, resp: httpx.Response) -> None:
        """Every event to the end of the stream; RuntimeError on an error event, ValueError
        on a malformed chunk."""
        parser = SSEParser()
        async for piece in resp.aiter_text():
            now = time.perf_counter()
            for data in parser.feed(piece):
                self._event(data, now)
        for data in parser.flush():
            if data.strip() != "[DONE]" and (chunk := json.loads(data)).get("usage"):
                self.usage = chunk["usage"]

    def _event(self, data: str, now: float) -> None:
        if data.strip() == "[DONE]":
            return
        chunk = json.loads(data)
        _raise_error_event(chunk)
        if chunk.get("usage"):
            self.usage = chunk["usage"]
        text = chunk_text(chunk)
        if text:
            self._text(text, now)

    def _text(self, text: str, now: float) -> None:
        if not self.texts:
            self.result.ttft = now - self.start
        else:
            self.result.itl.append(now - self.last)
        self.last = now
        self.texts.append(text)
        self.result.chunk_times.append(now - self.t0)

    def finish(self, count_tokens: Callable[[str], int] | None) -> RequestResult:
        """The result of a stream read to its end: failed when it carried no text; the
        output length from the usage, else counted, else one token per text chunk."""
        result, usage = self.result, self.usage
        result.generated_text = "".join(self.texts)
        if not self.texts:
            result.error = "the stream carried no generated text"
            return result
        result.success = True
        if usage and usage.get("completion_tokens") is not None:
            result.output_len = int(usage["completion_tokens"])
        elif count_tokens is not None:
            result.output_len = count_tokens(result.generated_text)
        else:
            result.output_len = len(self.texts)
        if usage and usage.get("prompt_tokens") is not None:
            result.prompt_len = int(usage["prompt_tokens"])
        return result


def _raise_error_event(chunk: dict[str, Any]) -> None:
    """An error event (an `error` and no choices) ends the stream: RuntimeError, its message."""
    if "error" in chunk and not chunk.get("choices"):
        err = chunk["error"]
        raise RuntimeError(err.get("message", str(err)) if isinstance(err, dict) else str(err))


async def list_models(client: httpx.AsyncClient, base_url: str) -> list[dict[str, Any]]:
    """GET /v1/models' entries (id, and root: the model's path where the server gives it)."""
    resp = await client.get(f"{base_url}/v1/models", timeout=30)
    if resp.status_code != 200:
        raise RuntimeError(f"GET {base_url}/v1/models: {_error_text(resp, resp.content)}")
    try:
        data = resp.json().get("data") or []
    except (ValueError, AttributeError):
        raise RuntimeError(f"GET {base_url}/v1/models: not a model list") from None
    return [m for m in data if isinstance(m, dict) and isinstance(m.get("id"), str)]


async def first_model(client: httpx.AsyncClient, base_url: str) -> str:
    """The first model id of GET /v1/models (the default --model)."""
    data = await list_models(client, base_url)
    if not data:
        raise RuntimeError(f"GET {base_url}/v1/models lists no model; pass --model")
    return data[0]["id"]
