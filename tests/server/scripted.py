"""A logits-processor factory for server tests: forces the token ids listed (JSON) in
$KVRELAY_TEST_SCRIPT on every request, so real engine/harmony/streaming paths run on a
tiny random model."""
from __future__ import annotations

import json
import os

import torch


def force_script(params, prompt_ids):
    script = json.loads(os.environ.get("KVRELAY_TEST_SCRIPT", "[]"))
    if not script:
        return None

    def processor(output_ids, logits):
        forced = torch.full_like(logits, float("-inf"))
        forced[script[min(len(output_ids), len(script) - 1)]] = 0.0
        return forced
    return processor
