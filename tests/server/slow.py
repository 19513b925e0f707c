"""Logits-processor factories that make every step slow: `sleepy` past the step timeout,
`drowsy` just slow enough that a request is surely still running when a test looks."""
from __future__ import annotations

import time


def sleepy(params, prompt_ids):
    def processor(output_ids, logits):
        time.sleep(3.0)
        return logits
    return processor


def drowsy(params, prompt_ids):
    def processor(output_ids, logits):
        time.sleep(0.2)
        return logits
    return processor
