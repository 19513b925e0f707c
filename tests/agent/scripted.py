"""A logits-processor factory for the agent tests: a scripted gpt-oss that calls a tool
when it has tools and no tool result yet, and answers once a tool result is in the prompt.

$KVRELAY_AGENT_SCRIPTS holds {"call": [token ids], "answer": [token ids]}; the script is
chosen from the prompt's tokens, so an agent loop (call → tool result → answer) runs
deterministically through the real engine on a random-weight model. A prompt holding the
word UNSCRIPTED (after a space) is left to the random model itself."""
from __future__ import annotations

import functools
import itertools
import json
import os

import torch

START, FUNCTIONS, NAMESPACE, SPACE_FUNCTIONS = 200006, 44580, 4797, 9964


def _has(ids: list[int], pair: tuple[int, int]) -> bool:
    return any((a, b) == pair for a, b in itertools.pairwise(ids))


def choose(prompt_ids: list[int]) -> str:
    if _has(prompt_ids, (START, FUNCTIONS)):            # `<|start|>functions.NAME`: a result
        return "answer"
    if _has(prompt_ids, (NAMESPACE, SPACE_FUNCTIONS)):   # `namespace functions {`: tools offered
        return "call"
    return "answer"


FREE = " UNSCRIPTED"


@functools.cache
def _free_ids() -> tuple[int, ...]:
    from kvrelay.harmony import get_encoding
    return tuple(get_encoding().encode(FREE))


def _contains(ids: list[int], sub: tuple[int, ...]) -> bool:
    n = len(sub)
    return any(tuple(ids[i:i + n]) == sub for i in range(len(ids) - n + 1))


def agent_script(params, prompt_ids):
    if _contains(list(prompt_ids), _free_ids()):
        return None
    scripts = json.loads(os.environ.get("KVRELAY_AGENT_SCRIPTS", "{}"))
    script = scripts.get(choose(list(prompt_ids)))
    if not script:
        return None

    def processor(output_ids, logits):
        forced = torch.full_like(logits, float("-inf"))
        forced[script[min(len(output_ids), len(script) - 1)]] = 0.0
        return forced
    return processor
