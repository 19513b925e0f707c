"""The offline API, shaped like vLLM's: `LLM(model, **engine_args).generate(...)` and
`.chat(messages)`, which renders conversations as `kvrelay serve` does (the checkpoint's
Jinja chat template, or harmony for gpt-oss's o200k tokenizer: `server/chat.py`)."""
from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from tqdm import tqdm

from kvrelay.config import EngineArgs, EngineConfig
from kvrelay.engine.core import LLMEngine
from kvrelay.engine.outputs import RequestOutput
from kvrelay.sampling_params import SamplingParams

if TYPE_CHECKING:
    from kvrelay.model.tokenizer import CheckpointTokenizer
    from kvrelay.server.chat_types import Rendered

Prompt = str | list[int] | dict[str, Any]
Message = dict[str, Any]                    # an OpenAI chat message: {"role": ..., "content": ...}
CHAT_TEMPLATE_KWARGS = ("reasoning_effort",)


class LLM:
    """`enable_chunked_prefill` (default False here, unlike the server): whether a prompt
    that does not fit in what is left of a step's token budget starts with a partial
    chunk. Offline, nobody waits for a first token, and whole prompts from position 0
    take the fresh-prefill attention kernel: a continued chunk sends its whole step's
    prefill through the slower gather path (`layers/attention.py`)."""

    def __init__(self, model: str | None = None, enable_chunked_prefill: bool = False,
                 **engine_args: Any) -> None:
        config = EngineConfig.from_args(EngineArgs.from_kwargs(model=model, **engine_args))
        self.engine = LLMEngine(config)
        scheduler = self.engine.scheduler
        scheduler.config = replace(scheduler.config, chunked_prefill=enable_chunked_prefill)
        self._ids = itertools.count()

    def shutdown(self) -> None:
        """Stop tensor-parallel worker processes (if any)."""
        self.engine.shutdown()

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix (vLLM's `LLM.reset_prefix_cache`); False while
        requests hold KV blocks."""
        return self.engine.reset_prefix_cache()

    def get_tokenizer(self) -> CheckpointTokenizer | None:
        return self.engine.tokenizer

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        """Runs every prompt to completion; outputs come back in input order."""
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts
                                                 and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = list(sampling_params) if isinstance(sampling_params, Sequence) \
            else [sampling_params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} sampling params")
        order = []
        for prompt, p in zip(prompts, params):
            request_id = str(next(self._ids))
            if isinstance(prompt, dict):
                prompt = prompt.get("prompt_token_ids") or prompt["prompt"]
            self.engine.add_request(request_id, prompt, p)
            order.append(request_id)
        done: dict[str, RequestOutput] = {}
        # only finished outputs are kept here: none is built for a running request (the
        # engine's own step() callers, e.g. tests and benchmarks, still get every step's)
        self.engine.output.final_only = True
        try:
            with tqdm(total=len(order), desc="Processed prompts", disable=not use_tqdm) as bar:
                while self.engine.has_unfinished_requests():
                    for out in self.engine.step():
                        if out.finished:
                            done[out.request_id] = out
                            bar.update()
        finally:
            self.engine.output.final_only = False
        return [done[r] for r in order]

    def chat(self, messages: Sequence[Message] | Sequence[Sequence[Message]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = False, chat_template: str | None = None,
             add_generation_prompt: bool = True, tools: list[dict[str, Any]] | None = None,
             chat_template_kwargs: dict[str, Any] | None = None) -> list[RequestOutput]:
        """vLLM's `LLM.chat`: one conversation (a list of messages) or several, each
        rendered as `/v1/chat/completions` renders it, then generated as `generate` does
        (harmony's `<|return|>` / `<|call|>` added to the stop ids). `chat_template`
        replaces the checkpoint's Jinja template; `chat_template_kwargs` takes
        `reasoning_effort` (harmony). ValueError names a bad message or argument."""
        conversations = _conversations(messages)
        rendered = [self._render_chat(c, chat_template, add_generation_prompt, tools,
                                      chat_template_kwargs or {}) for c in conversations]
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = list(sampling_params) if isinstance(sampling_params, Sequence) \
            else [sampling_params] * len(rendered)
        if len(params) != len(rendered):
            raise ValueError(f"{len(rendered)} conversations but {len(params)} sampling params")
        prompts: list[Prompt] = [{"prompt_token_ids": r.prompt_ids} for r in rendered]
        return self.generate(prompts, [_with_chat_stops(p, r) for p, r in zip(params, rendered)],
                             use_tqdm)

    def _render_chat(self, messages: Sequence[Message], chat_template: str | None,
                     add_generation_prompt: bool, tools: list[dict[str, Any]] | None,
                     kwargs: dict[str, Any]) -> Rendered:
        from pydantic import ValidationError

        from kvrelay.server.chat import make_chat_renderer
        from kvrelay.server.harmony_chat import is_harmony_tokenizer
        from kvrelay.server.protocol import ChatCompletionRequest, OpenAIError
        unknown = sorted(set(kwargs) - set(CHAT_TEMPLATE_KWARGS))
        if unknown:
            raise ValueError(f"chat_template_kwargs: {unknown[0]!r} is not supported (only "
                             f"{', '.join(CHAT_TEMPLATE_KWARGS)})")
        tokenizer = self.engine.tokenizer
        if tokenizer is None:
            raise ValueError(f"chat needs a tokenizer.json in {self.engine.model_dir}")
        if chat_template is not None:
            if is_harmony_tokenizer(tokenizer):
                raise ValueError("chat_template: this checkpoint's chats are rendered in harmony "
                                 "(openai-harmony), not with a Jinja template")
            tokenizer = replace(tokenizer, chat_template=chat_template)
        renderer = make_chat_renderer(tokenizer)
        if renderer is None:
            raise ValueError(f"{self.engine.model_dir}: the checkpoint has no chat template "
                             "(pass chat_template=...)")
        try:
            body = ChatCompletionRequest.model_validate({
                "messages": list(messages), "add_generation_prompt": add_generation_prompt,
                "tools": tools, "reasoning_effort": kwargs.get("reasoning_effort")})
            return renderer.render(body)
        except (OpenAIError, ValidationError) as e:
            raise ValueError(f"messages: {e}") from None


def _conversations(messages: Sequence[Message] | Sequence[Sequence[Message]]
                   ) -> list[Sequence[Message]]:
    """One conversation (messages are dicts) or a list of them."""
    if not messages:
        raise ValueError("messages: expected a list of chat messages (or of conversations)")
    if isinstance(messages[0], dict):
        return [messages]                                  # type: ignore[list-item]
    return list(messages)                                  # type: ignore[arg-type]


def _with_chat_stops(params: SamplingParams, rendered: Rendered) -> SamplingParams:
    """`params` plus the renderer's stop ids and tool-call constraint (a copy if any)."""
    extra = [t for t in rendered.stop_token_ids if t not in (params.stop_token_ids or [])]
    structured = params.structured_outputs or rendered.structured
    if not extra and structured is params.structured_outputs:
        return params
    return replace(params, stop_token_ids=[*(params.stop_token_ids or []), *extra],
                   structured_outputs=structured)
