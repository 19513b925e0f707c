"""Scripted faults for failure-isolation tests, as a logits-processor factory
(`--logits-processors tests.faults:inject`): a request whose prompt starts with
SAMPLE_FAULT gets a processor that raises while its token is sampled; one that starts
with ADD_FAULT makes the factory itself raise while the request is added. Every other
request is untouched (the factory returns None)."""
from __future__ import annotations

SAMPLE_FAULT = 157
ADD_FAULT = 158


class InjectedFault(RuntimeError):
    pass


def inject(params, prompt_ids):
    if prompt_ids and prompt_ids[0] == ADD_FAULT:
        raise InjectedFault("injected fault while adding the request")
    if not prompt_ids or prompt_ids[0] != SAMPLE_FAULT:
        return None

    def processor(output_ids, logits):
        raise InjectedFault("injected fault while sampling")
    return processor


def poison_forward(engine, monkeypatch) -> None:
    """The engine's model forward raises whenever a step holds the SAMPLE_FAULT token."""
    real = engine.runner.execute

    def execute(step):
        if SAMPLE_FAULT in step.token_ids:
            raise InjectedFault("injected fault in the forward")
        return real(step)
    monkeypatch.setattr(engine.runner, "execute", execute)
