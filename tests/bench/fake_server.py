"""A scripted OpenAI-compatible streaming server as an httpx MockTransport (no sockets)."""
from __future__ import annotations

import asyncio
import json

import httpx


class FakeOpenAI:
    """Streams one text chunk per token; prompts containing FAIL get a 500, BREAK an error
    event mid-stream; counts concurrent requests and serves prefix-cache counters."""

    def __init__(self, step_s: float = 0.005, usage: bool = True, metrics: bool = True) -> None:
        self.step_s, self.usage, self.metrics = step_s, usage, metrics
        self.in_flight = self.peak = 0
        self.queries = self.hits = 0
        self.log: list[tuple[str, str, float]] = []          # (event, prompt, loop time)

    def transport(self) -> httpx.MockTransport:
        return httpx.MockTransport(self.handle)

    async def handle(self, request: httpx.Request) -> httpx.Response:
        if request.url.path == "/metrics":
            if not self.metrics:
                return httpx.Response(404)
            text = ('# TYPE vllm:prefix_cache_queries counter\n'
                    f'vllm:prefix_cache_queries_total{{engine="0",model_name="m"}} '
                    f'{self.queries}.0\nvllm:prefix_cache_hits_total{{engine="0",model_name="m"}} '
                    f'{self.hits}.0\n')
            return httpx.Response(200, text=text)
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": "fake-model"}, {"id": "other"}]})
        body = json.loads(request.content)
        prompt = body.get("prompt") or body["messages"][-1]["content"]
        if "FAIL" in prompt:
            return httpx.Response(500, json={"error": {"message": "scripted failure", "type": "x"}})
        return httpx.Response(200, headers={"content-type": "text/event-stream"},
                              content=self._stream(body, prompt))

    async def _stream(self, body: dict, prompt: str):
        n = body.get("max_tokens") or body.get("max_completion_tokens")
        words = len(prompt.split())
        self.in_flight += 1
        self.peak = max(self.peak, self.in_flight)
        self.log.append(("start", prompt, asyncio.get_running_loop().time()))
        self.queries += words
        self.hits += words // 2
        try:
            chat = "messages" in body
            for i in range(n):
                await asyncio.sleep(self.step_s)
                if "BREAK" in prompt and i == 1:
                    yield b'data: {"error": {"message": "engine died"}}\n\n'
                    return
                choice = ({"index": 0, "delta": {"content": f"t{i} "}} if chat
                          else {"index": 0, "text": f"t{i} "})
                yield f"data: {json.dumps({'choices': [choice]})}\n\n".encode()
            if self.usage:
                usage = {"prompt_tokens": words + 1, "completion_tokens": n,
                         "total_tokens": words + 1 + n}
                yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n".encode()
            yield b"data: [DONE]\n\n"
        finally:
            self.in_flight -= 1
            self.log.append(("end", prompt, asyncio.get_running_loop().time()))
