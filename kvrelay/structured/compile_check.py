"""The API server's compile check, in worker processes that a crash cannot spread from.

Owner: structured outputs. The API server compiles every constraint once before the
engine sees it, so a bad one is a 400 (server/structured.py). That compile runs here:

    CompileChecker.check(p) ─▶ an idle worker (started on demand, at most `workers`)
        ─ frame {"params": p.to_dict(), "analysis_budget": B} ─▶
          python -m kvrelay.structured.compile_check --fd N [--tokenizer tokenizer.json]
        ◀─ frame {"error": message | null} ─  (backend.validate: with the checkpoint's
                                               tokenizer it is the engine's own compile)
    no answer within `budget_s` (a runaway compile), or the worker died (a stack overflow,
    an abort): the worker is killed and replaced, and the answer is "too complex" (400)

Frames are kvrelay/framing.py's length-prefixed JSON over a socket pair; nothing is
pickled, the worker imports no torch, and it exits when the server's end of the pair
closes (the server died). Workers are in the server's process group, so stopping the
group stops them; `close()` (also at exit) ends them.

Why a process and not a thread with a large stack (measured on this 2-core machine
under load, 49k-token tokenizer, warm workers): a check costs ~0.3 ms more in a worker than
on a thread (the frame round trip; a typical schema compiles in 1-20 ms either way), and
the worker is the only place where everything the bounds miss stays harmless: a stack
overflow there is a dead worker and a 400, where on the API's own thread it was the
server; a compile that runs away (an integer `multipleOf` of 10^6: 7 s and 560 MB with a
tokenizer, 49 s and 1.8 GB at 3·10^6; ~128,000 choices: 23 s) is killed at the budget,
where a thread cannot be stopped and would keep its core and memory. A large stack
makes only the first of these harmless. Workers compile on their main thread's 8 MiB
stack, a tighter budget than the engine's 256 MiB compile thread (backend.py), so
anything that passes here compiles in the engine with ≥ 30× the stack.

A worker costs its interpreter, llguidance and the tokenizer (o200k: ~2 s to start,
~250 MB); the first one starts when the server configures the check (`configure`, at
`kvrelay serve`'s start), a second only when two checks overlap. A process that never
configures it (an app built in a test's process, the offline API's callers) gets
`InlineChecker`: the same compile without a tokenizer, on backend.py's large-stack
thread, with no time budget.
"""
from __future__ import annotations

import argparse
import atexit
import contextlib
import logging
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from kvrelay.framing import FrameError, recv_frame, send_frame
from kvrelay.structured.params import StructuredOutputsParams

logger = logging.getLogger(__name__)

BUDGET_S = 5.0                 # one compile, else "too complex"
STARTUP_S = 120.0              # a worker loading a tokenizer (o200k: ~2 s; slow disks, load)
WORKERS = 2                    # at most this many checks at once (more wait their turn)
TOO_COMPLEX = "the grammar is too complex to compile"
TIMED_OUT = f"{TOO_COMPLEX}: it did not compile within"   # (a verdict that depends on load)


class CheckUnavailable(RuntimeError):
    """No worker could be started (the server answers 503)."""


class _Worker:
    """One worker process and the server's end of its socket pair."""

    def __init__(self, tokenizer: Path | None) -> None:
        ours, theirs = socket.socketpair()
        args = [sys.executable, "-m", "kvrelay.structured.compile_check",
                "--fd", str(theirs.fileno())]
        if tokenizer is not None:
            args += ["--tokenizer", str(tokenizer)]
        try:
            self.proc = subprocess.Popen(args, pass_fds=(theirs.fileno(),),
                                         stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
        except OSError:
            ours.close()
            raise
        finally:
            theirs.close()
        self.sock = ours
        self.ready = False

    def wait_ready(self, timeout: float) -> None:
        """Until the worker has its tokenizer; CheckUnavailable if it never gets there."""
        try:
            hello = recv_frame(self.sock, deadline=time.monotonic() + timeout)
        except (OSError, FrameError) as e:
            self.kill()
            raise CheckUnavailable(f"the grammar check worker did not start: {e}") from None
        if not hello or not hello.get("ready"):
            self.kill()
            raise CheckUnavailable(f"the grammar check worker did not start (exit status "
                                   f"{self.proc.poll()})")
        if hello.get("why"):
            logger.warning("grammar checks run without the checkpoint's tokenizer, which "
                           "llguidance cannot read: %s", hello["why"])
        self.ready = True

    def ask(self, message: dict[str, Any], budget_s: float) -> str | None:
        """The worker's answer: None (compiles) or an error message. TimeoutError /
        ConnectionError when it took too long or died (the caller kills it)."""
        self.sock.settimeout(budget_s)
        send_frame(self.sock, message)
        answer = recv_frame(self.sock, deadline=time.monotonic() + budget_s)
        if answer is None:
            raise ConnectionError("the worker closed its end")
        error = answer.get("error")
        return error if isinstance(error, str) else None

    def kill(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.close()
        if self.proc.poll() is None:
            self.proc.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(5)


class CompileChecker:
    """Compile checks on up to `workers` worker processes; thread-safe (the server runs
    checks on its preparation threads)."""

    def __init__(self, tokenizer: Path | None = None, workers: int = WORKERS,
                 budget_s: float = BUDGET_S, startup_s: float = STARTUP_S) -> None:
        self.tokenizer = tokenizer
        self.max_workers = workers
        self.budget_s = budget_s
        self.startup_s = startup_s
        self._idle: list[_Worker] = []
        self._live = 0
        self._closed = False
        self._cond = threading.Condition()
        self.restarts = 0            # workers killed (a crash or a runaway compile)

    def prestart(self) -> None:
        """Start one worker now (its tokenizer loads while the server starts)."""
        with self._cond:
            if self._live or self._closed:
                return
            self._live += 1
        try:
            worker = _Worker(self.tokenizer)
        except OSError as e:
            logger.warning("grammar check worker not started: %s", e)
            self._release(None)
            return
        self._release(worker)

    def check(self, p: StructuredOutputsParams, analysis_budget: int = 0) -> str | None:
        """None when `p` compiles; else why not (TOO_COMPLEX when the worker ran out of
        time or died). CheckUnavailable when no worker could be started."""
        message = {"params": p.to_dict(), "analysis_budget": analysis_budget}
        worker = self._acquire()
        try:
            if not worker.ready:
                worker.wait_ready(self.startup_s)
            error = worker.ask(message, self.budget_s)
        except CheckUnavailable:
            self._release(None)
            raise
        except (OSError, FrameError, ValueError) as e:
            why = _why_lost(worker, e, self.budget_s)
            worker.kill()
            self._release(None, restarted=True)
            logger.warning("grammar check: %s: %s", TOO_COMPLEX, why)
            return f"{TOO_COMPLEX}: {why}"
        self._release(worker)
        return error

    def _acquire(self) -> _Worker:
        with self._cond:
            while True:
                if self._closed:
                    raise CheckUnavailable("the grammar check is shut down")
                if self._idle:
                    return self._idle.pop()
                if self._live < self.max_workers:
                    self._live += 1
                    break
                self._cond.wait()
        try:
            return _Worker(self.tokenizer)
        except OSError as e:
            self._release(None)
            raise CheckUnavailable(f"the grammar check worker did not start: {e}") from None

    def _release(self, worker: _Worker | None, restarted: bool = False) -> None:
        with self._cond:
            if worker is None:
                self._live -= 1
                self.restarts += restarted
            elif self._closed:
                self._live -= 1
                worker.kill()
            else:
                self._idle.append(worker)
            self._cond.notify()

    def close(self) -> None:
        """Ends the idle workers now and busy ones when their check returns."""
        with self._cond:
            self._closed = True
            idle, self._idle = self._idle, []
            self._live -= len(idle)
            self._cond.notify_all()
        for worker in idle:
            worker.kill()

    @property
    def pids(self) -> list[int]:
        """The idle workers' process ids (tests)."""
        with self._cond:
            return [w.proc.pid for w in self._idle]


def _why_lost(worker: _Worker, error: Exception, budget_s: float) -> str:
    """Why a worker gave no answer: out of time, or it died (a crash: its exit status)."""
    if isinstance(error, TimeoutError):
        return f"{TIMED_OUT.removeprefix(TOO_COMPLEX + ': ')} {budget_s:g} s"
    try:
        status = worker.proc.wait(1)
    except subprocess.TimeoutExpired:
        return f"the compiler broke off ({type(error).__name__})"
    return f"it stopped the compiler (exit status {status})"


# -- the worker process -----------------------------------------------------------------------
def _serve(sock: socket.socket, tokenizer_path: str | None) -> None:
    from kvrelay.structured.backend import validate
    tokenizer, why = None, None
    try:
        if tokenizer_path is not None:
            import llguidance
            tokenizer = llguidance.LLTokenizer(Path(tokenizer_path).read_text())
    except Exception as e:  # noqa: BLE001 -- llguidance cannot read it: check without one
        why = f"{type(e).__name__}: {e}"     # (the engine's compile reports it per request)
    send_frame(sock, {"ready": True, "tokenizer": tokenizer is not None, "why": why})
    while True:
        message = recv_frame(sock)
        if message is None:                 # the server closed its end (or died)
            return
        try:
            p = StructuredOutputsParams.from_dict(message["params"])
            validate(p, tokenizer, int(message.get("analysis_budget") or 0))
            error = None
        except RecursionError:
            error = f"{TOO_COMPLEX}: it nests too deep"
        except (ValueError, TypeError, KeyError) as e:      # GrammarError is a ValueError
            error = str(e) or type(e).__name__
        send_frame(sock, {"error": error})


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="kvrelay's grammar compile-check worker")
    parser.add_argument("--fd", type=int, required=True)
    parser.add_argument("--tokenizer", default=None)
    args = parser.parse_args(argv)
    sock = socket.socket(fileno=args.fd)
    try:
        _serve(sock, args.tokenizer)
    except (OSError, FrameError):
        pass                                # the server went away
    finally:
        sock.close()
    os._exit(0)                             # skip interpreter teardown (llguidance's threads)


class InlineChecker:
    """The check in this process, on the engine's large-stack compile thread (backend.py),
    without a tokenizer: for processes that did not `configure` workers."""

    def check(self, p: StructuredOutputsParams, analysis_budget: int = 0) -> str | None:
        from kvrelay.structured.backend import compile_in_thread, validate
        try:
            compile_in_thread(validate, p)
        except ValueError as e:                 # GrammarError
            return str(e)
        return None

    def close(self) -> None:
        pass


_DEFAULT: CompileChecker | InlineChecker | None = None
_DEFAULT_LOCK = threading.Lock()


def configure(tokenizer: Path | None, prestart: bool = True) -> CompileChecker:
    """The process's checker, compiling with the checkpoint's `tokenizer.json` (None:
    llguidance's validation without one); replaces (and closes) an earlier one."""
    global _DEFAULT
    checker = CompileChecker(tokenizer)
    with _DEFAULT_LOCK:
        previous, _DEFAULT = _DEFAULT, checker
    if previous is not None:
        previous.close()
    if prestart:
        checker.prestart()
    return checker


def default() -> CompileChecker | InlineChecker:
    """The process's checker: workers once `configure` was called, else `InlineChecker`."""
    global _DEFAULT
    with _DEFAULT_LOCK:
        if _DEFAULT is None:
            _DEFAULT = InlineChecker()
        return _DEFAULT


def _close_default() -> None:
    if _DEFAULT is not None:
        _DEFAULT.close()


atexit.register(_close_default)

if __name__ == "__main__":
    main()
