"""A starting `kvrelay serve` / `kvrelay proxy`'s step, read from the log it writes.

Both deploy back ends watch a starting process this way: the local launcher for its
progress lines, a Ray server actor for its progress and its readiness. Reading the new part
of a log file costs nothing on the cores the servers start on; an HTTP look every tenth of
a second cost the server a request (and a log line) each time.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

READY_LINE = "Application startup complete"
STARTING = "starting"
READY_STEP = "ready"
# The furthest of these a log shows is the process's step (in the order they happen;
# "starting" before any: Python's imports). The texts are kvrelay serve's and uvicorn's log
# lines; a step a log never shows (the proxy, a small checkpoint without a weights bar) is
# skipped, and one logged out of order (a background kernel build) never moves a step back.
STEPS = (
    ("Waiting for application startup", "starting up"),
    ("building the embedded model", "building the embedded model"),
    ("building the native kernels", "building the native kernels"),
    ("Loading weights", "loading the weights"),
    ("kvrelay.model.loader: loaded", "allocating the KV cache"),
    ("KV cache: ", "warming up"),
    (READY_LINE, READY_STEP),
)
_LONGEST_STEP = max(len(text) for text, _ in STEPS)
_ORDER = [STARTING] + [step for _, step in STEPS]


def step_reached(step: str | None, goal: str) -> bool:
    """Whether a process at `step` is at `goal` or past it (STEPS' order)."""
    return step in _ORDER and _ORDER.index(step) >= _ORDER.index(goal)


@dataclass
class LogSteps:
    """One run's step: the log from `offset` on (a restarted process appends to its log)."""

    path: Path
    offset: int = 0
    step: str = STARTING
    index: int = field(default=-1, repr=False)
    scanned: int = field(default=-1, repr=False)     # log bytes read so far (-1: from offset)

    @property
    def ready(self) -> bool:
        return self.step == READY_STEP

    def update(self) -> bool:
        """Read what the log gained since the last call; True when the step changed."""
        start = max(self.scanned, self.offset)
        back = min(_LONGEST_STEP, start - self.offset)    # a line cut in two last time
        try:
            with open(self.path, "rb") as f:
                f.seek(start - back)
                new = f.read()
        except OSError:
            return False
        self.scanned = start - back + len(new)
        text = new.decode(errors="replace")
        found = max((i for i, (line, _) in enumerate(STEPS) if line in text), default=-1)
        if found <= self.index:
            return False
        self.index, self.step = found, STEPS[found][1]
        return True
