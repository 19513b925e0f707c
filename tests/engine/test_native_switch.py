"""Serving before the native kernels are built, then switching to them between two steps
(engine/native_switch.py): an engine built while its kernels are "still building" runs on
the PyTorch reference paths, switches once the build is done, and answers the same tokens
before, across and after the switch (each checked against transformers, near-tie rule)."""
from __future__ import annotations

import ast
import logging
import threading
from pathlib import Path

import pytest
import torch

from kvrelay import SamplingParams
from kvrelay.engine import native_switch, sampler
from kvrelay.engine.native_switch import NativeSwitch
from kvrelay.model import fast_paths, kernels
from kvrelay.model.kernels import build
from kvrelay.model.layers import linear, norm, paged_decode
from tests.factories import greedy_mismatch

GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
NO_KERNELS = {"moe": None, "paged_decode": None, "dense": None}


class PendingBuild:
    """A background build the test finishes: `done.set()` hands over the real library (or
    `error`), as `kernels.BackgroundBuild` does when its thread ends."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.done = threading.Event()
        self.error: BaseException | None = None
        self.seconds: float | None = 12.0

    def library(self) -> Path | None:
        if not self.done.is_set():
            return None
        if self.error is not None:
            raise self.error
        return kernels._library_path(self.directory)


def forget_decisions() -> None:
    for decision in native_switch._CACHED_DECISIONS:
        decision.cache_clear()


@pytest.fixture
def pending(monkeypatch):
    """kernels.status() in the background, its build not finished yet; afterwards the
    process's real status again."""
    if kernels.compiler() is None:
        pytest.skip("no C++ compiler: the native kernels cannot be built here")
    real = kernels.status()
    assert real.available, real.reason
    pending = PendingBuild(Path(str(real.library)).parent)
    monkeypatch.setattr(kernels, "_in_background", True)
    monkeypatch.setattr(kernels, "_background", pending)
    forget_decisions()
    yield pending
    monkeypatch.undo()
    forget_decisions()


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(0, 160, (n,), generator=g).tolist() for n in (4, 11, 23)]


def token_ids(outputs) -> list[list[int]]:
    return [list(out.outputs[0].token_ids) for out in outputs]


def switch_now(engine, switch: NativeSwitch) -> bool:
    return switch.apply(engine.model, engine.executor, engine.runner.num_groups,
                        engine.args.block_size)


def test_serves_on_the_reference_paths_then_switches_with_the_same_tokens(tiny, make_llm,
                                                                          pending):
    llm = make_llm()
    engine = llm.engine
    assert fast_paths.native_paths()["kernels"] == NO_KERNELS
    assert fast_paths.native_paths()["build"] == "building"
    before = llm.generate(prompts(), GREEDY)                      # the reference paths

    engine.add_request("across", prompts()[2], GREEDY)           # a request across the switch
    for _ in range(4):
        engine.step()
    switch = NativeSwitch(pending=True)
    assert not switch.due()                                       # still building
    pending.done.set()
    assert switch.due()
    assert switch.due(pipeline_busy=True) is False                # never mid-forward
    assert switch_now(engine, switch) and not switch.pending

    status = kernels.status()
    assert fast_paths.native_paths()["build"] == "ready"
    assert fast_paths.native_paths()["kernels"] == {
        "moe": status.isa, "paged_decode": status.isa, "dense": linear.dense_kernel_isa()}
    across = []
    while engine.has_unfinished_requests():
        across += [out for out in engine.step() if out.finished]
    after = llm.generate(prompts(), GREEDY)                       # the native kernels

    for prompt, old, new in zip(prompts(), token_ids(before), token_ids(after)):
        assert greedy_mismatch(tiny[1], prompt, old) is None
        assert greedy_mismatch(tiny[1], prompt, new) is None
        assert new == old
    assert token_ids(across) == token_ids(before)[2:]
    # the decisions cached from the status were made again, on the kernels
    assert paged_decode.enabled() and norm._native_ops() is not None
    assert sampler._argmax_op() is not None
    stack = engine.model.__dict__.get("_stack")
    assert stack is not None and stack.native is not None        # decode-only steps: one call


def test_a_failed_build_keeps_the_reference_paths_with_one_warning(tiny, make_llm, pending,
                                                                  caplog):
    llm = make_llm()
    engine = llm.engine
    before = llm.generate(prompts(), GREEDY)
    pending.error = RuntimeError("the compiler failed (exit status 1): x.cpp:1:1: error: boom")
    pending.done.set()
    switch = NativeSwitch(pending=True)
    with caplog.at_level(logging.WARNING, logger="kvrelay.model.kernels"):
        assert switch.due() and not switch_now(engine, switch)
        after = llm.generate(prompts(), GREEDY)
        fast_paths.native_paths()
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "error: boom" in warnings[0], warnings
    assert fast_paths.native_paths() | {"half_matmul": None} == {
        "kernels": NO_KERNELS, "build": "failed", "half_matmul": None}
    assert token_ids(after) == token_ids(before)
    assert not switch.due()                                       # once


def test_a_build_finished_before_the_model_needs_no_switch(make_llm, pending):
    pending.done.set()
    make_llm()
    assert fast_paths.native_paths()["build"] == "ready"
    switch = NativeSwitch(pending=True)
    assert not switch.due() and not switch.pending


def test_the_build_watch_logs_each_finished_step_and_a_heartbeat(tmp_path, caplog, monkeypatch):
    log = tmp_path / ".ninja_log"
    log.write_text("# ninja log v5\n1\t2\t3\told.o\tabc\n")      # an earlier build's line
    monkeypatch.setattr(build, "POLL_S", 0.01)
    monkeypatch.setattr(build, "HEARTBEAT_S", 0.2)
    with caplog.at_level(logging.INFO, logger="kvrelay.model.kernels"), \
            build.BuildWatch(tmp_path, 3) as watch:
        with open(log, "a") as f:
            f.write("5\t900\t7\tmoe_avx2.o\tdef\n6\t10")      # the second line unfinished
        watch._stop.wait(0.5)                                  # a heartbeat's worth
        with open(log, "a") as f:
            f.write("00\t8\tkvrelay_kernels.so\t123\n")
    lines = [r.getMessage() for r in caplog.records]
    assert "native kernels: 1/3 moe_avx2.o built" in lines[0]
    assert any("still compiling (1/3 done" in line for line in lines)
    assert "native kernels: 2/3 kvrelay_kernels.so built" in lines[-1]
    assert not any("old.o" in line for line in lines)


def test_a_compiler_failure_names_the_first_error():
    output = ["[1/3] c++ -c a.cpp", "/x/moe.cpp:12:3: error: 'foo' was not declared",
              "/x/moe.cpp:13:1: error: later", "ninja: build stopped: subcommand failed."]
    assert build._failure(1, output) == (
        "the compiler failed (exit status 1): /x/moe.cpp:12:3: error: 'foo' was not declared")
    assert build._failure(2, ["", "Killed", ""]).endswith("(exit status 2): Killed")


def test_every_cached_decision_on_the_kernels_is_forgotten_at_the_switch():
    """A functools.cache'd function that reads the kernels' availability (directly or through
    another decision) keeps its first answer: the switch must clear it."""
    root = Path(kernels.__file__).parents[2]
    reads = ("kernels.status()", "kernels_available()", "dense_kernel_isa()", "enabled()")
    cached = set()
    for path in (root / "kvrelay").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.FunctionDef)
                    and any("cache" in ast.unparse(d) for d in node.decorator_list)
                    and any(r in ast.unparse(node) for r in reads)):
                cached.add(f"{path.stem}.{node.name}")
    cleared = {f"{d.__module__.rsplit('.', 1)[-1]}.{d.__name__}"
               for d in native_switch._CACHED_DECISIONS}
    assert cached <= cleared, cached - cleared
