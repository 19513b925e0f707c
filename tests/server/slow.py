"""A logits-processor factory that makes every step slow (for the step-timeout test)."""
from __future__ import annotations

import time


def sleepy(params, prompt_ids):
    def processor(output_ids, logits):
        time.sleep(3.0)
        return logits
    return processor
