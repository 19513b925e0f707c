"""The offline API, shaped like vLLM's: `LLM(model, **engine_args).generate(...)`."""
from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from tqdm import tqdm

from kvrelay.config import EngineArgs, EngineConfig
from kvrelay.engine.core import LLMEngine
from kvrelay.engine.outputs import RequestOutput
from kvrelay.sampling_params import SamplingParams

Prompt = str | list[int] | dict[str, Any]


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

    def get_tokenizer(self):
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
