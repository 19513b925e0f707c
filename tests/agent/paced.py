"""A logits-processor factory for tests/agent/test_responses_background.py: a scripted
gpt-oss that writes one token per $KVRELAY_PACED_DELAY_S seconds, so a background response
is still running when the test polls, reads or cancels it.

$KVRELAY_PACED_SCRIPTS holds {"answer": [token ids], "long": [token ids]}: a request for
exactly `LONG` tokens gets "long", whose last token repeats until max_tokens (a response that
runs as long as the test wants); any other gets "answer"."""
from __future__ import annotations

import json
import os
import time

import torch

LONG = 1500               # the max_tokens that asks for the long script


def paced(params, prompt_ids):
    scripts = json.loads(os.environ["KVRELAY_PACED_SCRIPTS"])
    script = scripts["long" if params.max_tokens == LONG else "answer"]
    delay = float(os.environ.get("KVRELAY_PACED_DELAY_S", "0"))

    def processor(output_ids, logits):
        time.sleep(delay)
        forced = torch.full_like(logits, float("-inf"))
        forced[script[min(len(output_ids), len(script) - 1)]] = 0.0
        return forced
    return processor
