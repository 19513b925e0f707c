"""An in-process kvrelay API over a scripted fake engine, driven by the real openai client
(through starlette's TestClient): fast checks of request handling, constraints and errors."""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from kvrelay.engine.outputs import CompletionOutput, RequestOutput
from kvrelay.model.tokenizer import CheckpointTokenizer
from kvrelay.sampling_params import SamplingParams
from kvrelay.server.api import ServerState, build_app
from kvrelay.server.chat import TemplateChat
from kvrelay.server.harmony_chat import HarmonyChat
from kvrelay.server.tools import AgentOptions

MODEL = "m"
EOS = 0          # the template models' end of turn (harmony's are its stop tokens)


class CharTokenizer(CheckpointTokenizer):
    """One token per character (id = code point): text round-trips exactly."""

    def encode(self, text: str) -> list[int]:
        return [ord(c) for c in text]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(i) for i in ids if i)       # 0 is the EOS


TOOL_TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}"
                 "{% for c in m.tool_calls or [] %}[call {{ c.function.name }}]{% endfor %}"
                 "{% endfor %}"
                 "{% if tools %}<tools>{{ tools | map(attribute='function.name') | join(',') }}"
                 "{% endif %}{% if add_generation_prompt %}<assistant>{% endif %}")


PLAIN_TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
                  "<assistant>")


def char_tokenizer(template: str = TOOL_TEMPLATE) -> CharTokenizer:
    return CharTokenizer(tokenizer=None, eos_token_ids=(0,), chat_template=template,  # type: ignore[arg-type]
                         special={})


@dataclass
class ScriptedEngine:
    """Answers every request with `script(prompt_ids)`'s tokens, one per output, ending with
    "stop" at a stop token or "length" at max_tokens. Records what it was asked."""
    script: Callable[[list[int]], list[int]]
    decode: Callable[[list[int]], str]
    ready: asyncio.Event = field(default_factory=asyncio.Event)
    dead: str | None = None
    info: dict[str, Any] = field(default_factory=lambda: {"max_model_len": 4096})
    requests: list[tuple[list[int], SamplingParams]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.ready.set()

    async def generate(self, request_id: str, prompt: list[int], params: SamplingParams,
                       kv_transfer_params: dict | None = None) -> AsyncIterator[RequestOutput]:
        self.requests.append((list(prompt), params))
        script = self.script(list(prompt))
        limit = min(len(script), params.max_tokens or len(script))
        tokens: list[int] = []
        for i, token in enumerate(script[:limit]):
            tokens.append(token)
            stop = token in (params.stop_token_ids or []) or token == EOS
            last = stop or i + 1 == limit
            reason = "stop" if stop else ("length" if last else None)
            out = CompletionOutput(0, self.decode(tokens), list(tokens), reason,
                                   token if stop else None, delta_text=self.decode([token]),
                                   delta_token_ids=[token])
            yield RequestOutput(request_id, None, list(prompt), [out], finished=last)
            await asyncio.sleep(0)
            if last:
                return


def make_state(engine: ScriptedEngine, harmony: bool, agent: AgentOptions | None = None,
               tokenizer: CheckpointTokenizer | None = None) -> ServerState:
    chat = HarmonyChat(tokenizer) if harmony else TemplateChat(tokenizer or char_tokenizer())
    return ServerState(engine=engine, tokenizer=None if harmony else chat.tokenizer,  # type: ignore[arg-type]
                       served_names=[MODEL], max_model_len=4096, max_logprobs=5, chat=chat,
                       agent=agent or AgentOptions())


def openai_client(state: ServerState):
    """The real openai client, its HTTP going into the app in-process."""
    import openai
    from starlette.testclient import TestClient
    http = TestClient(build_app(state), base_url="http://testserver")
    return openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=http,
                         max_retries=0), http
