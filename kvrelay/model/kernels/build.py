"""Compiling the native kernels: progress in the log, and the background compiler process.

    waiting build (`kernels._build`)        torch.utils.cpp_extension.load in this process
    background build (`BackgroundBuild`)    run_child: python -m kvrelay.model.kernels.build
                                            (nice 10, MAX_JOBS=1: serving keeps the cores)
    either way, BuildWatch reads the build directory's .ninja_log, where ninja appends one
    line per finished step, every second:
        "native kernels: 3/26 moe_avx2.o built (41 s)"
        nothing new for HEARTBEAT_S → "native kernels: still compiling (3/26 done, 51 s)"

The background compiler is a process of its own, in its own process group, so it can be
stopped as a whole (`stop`, when the engine shuts down), and it dies with the thread that
started it (PR_SET_PDEATHSIG): no compiler outlives a killed server and keeps writing into a
directory the next start builds in. A waiting build runs in the caller's process as it
always has (its compilers stop with the caller's process group).
"""
from __future__ import annotations

import ctypes
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from dataclasses import asdict, dataclass
from pathlib import Path
from types import TracebackType

logger = logging.getLogger(__name__)

HEARTBEAT_S = 10.0          # a log line at least this often while the compiler works
POLL_S = 1.0                # how often .ninja_log is read
BACKGROUND_NICE = 10        # serving keeps priority over a background build
BACKGROUND_JOBS = 1         # ... and all but one core
_PR_SET_PDEATHSIG = 1

_children: set[subprocess.Popen[bytes]] = set()      # background compilers of this process
_children_lock = threading.Lock()


@dataclass(frozen=True)
class BuildSpec:
    """What `torch.utils.cpp_extension.load` compiles (its arguments; JSON for the child)."""

    name: str
    sources: tuple[str, ...]          # paths
    cflags: tuple[str, ...]
    ldflags: tuple[str, ...]
    include: str

    def load(self, directory: Path) -> None:
        """Compile (what is not compiled yet) and load the library into this process."""
        from torch.utils import cpp_extension
        cpp_extension.load(self.name, list(self.sources), extra_cflags=list(self.cflags),
                           extra_ldflags=list(self.ldflags), extra_include_paths=[self.include],
                           build_directory=str(directory), is_python_module=False,
                           verbose=False)

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> BuildSpec:
        raw = json.loads(text)
        return cls(raw["name"], tuple(raw["sources"]), tuple(raw["cflags"]),
                   tuple(raw["ldflags"]), raw["include"])


class BuildWatch:
    """Logs a build's progress from the outside, on a thread: what ninja has finished
    (its .ninja_log; lines there from earlier builds are skipped) and how long it took."""

    def __init__(self, directory: Path, steps: int) -> None:
        self.log_path = directory / ".ninja_log"
        self.steps, self.done = steps, 0
        self.started = self.last_news = time.monotonic()
        self.offset = self.log_path.stat().st_size if self.log_path.is_file() else 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvrelay-kernel-build-watch",
                                        daemon=True)

    def __enter__(self) -> BuildWatch:
        self._thread.start()
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self._stop.set()
        self._thread.join()
        self.poll()                          # the last steps, before the caller's summary

    def elapsed(self) -> float:
        return time.monotonic() - self.started

    def _run(self) -> None:
        while not self._stop.wait(POLL_S):
            self.poll()
            if time.monotonic() - self.last_news >= HEARTBEAT_S:
                self.last_news = time.monotonic()
                logger.info("native kernels: still compiling (%d/%d done, %.0f s)", self.done,
                            self.steps, self.elapsed())

    def poll(self) -> None:
        for output in self._new_outputs():
            self.done += 1
            self.last_news = time.monotonic()
            logger.info("native kernels: %d/%d %s built (%.0f s)", self.done, self.steps,
                        output, self.elapsed())

    def _new_outputs(self) -> list[str]:
        """The outputs of the .ninja_log lines added since the last call (`start end mtime
        output hash`, tab-separated; a line still being written is left for next time)."""
        try:
            with open(self.log_path, "rb") as f:
                f.seek(self.offset)
                text = f.read()
        except FileNotFoundError:
            return []
        complete = text[:text.rfind(b"\n") + 1]
        self.offset += len(complete)
        fields = (line.split("\t") for line in complete.decode(errors="replace").splitlines())
        return [f[3] for f in fields if len(f) >= 4 and not f[0].startswith("#")]


def run_child(spec: BuildSpec, directory: Path) -> None:
    """Compile `spec` into `directory` in a background compiler process and wait for it;
    RuntimeError naming the first compiler error when it fails."""
    command = [sys.executable, "-m", "kvrelay.model.kernels.build", str(directory),
               str(os.getpid()), spec.to_json()]
    output: deque[str] = deque(maxlen=400)
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          start_new_session=True) as child:
        with _children_lock:
            _children.add(child)
        try:
            assert child.stdout is not None
            for line in child.stdout:
                output.append(line.decode(errors="replace").rstrip())
            status = child.wait()
        finally:
            with _children_lock:
                _children.discard(child)
    if status != 0:
        raise RuntimeError(_failure(status, list(output)))


def stop() -> None:
    """Stop the background compilers of this process (each one's whole process group)."""
    with _children_lock:
        children = list(_children)
    for child in children:
        try:
            os.killpg(child.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass


def _failure(status: int, output: list[str]) -> str:
    """One line for the warning: the first compiler error, else the last line of output."""
    errors = [line for line in output if " error: " in line or line.startswith("error:")]
    cause = errors[0] if errors else next((line for line in reversed(output) if line.strip()),
                                          "no output")
    return f"the compiler failed (exit status {status}): {cause.strip()}"


# -- the child ------------------------------------------------------------------------------------
def _die_with_parent(parent: int) -> None:
    """SIGTERM when the thread that started us ends (Linux); SIGTERM stops our whole group
    (ninja and the compilers it runs)."""
    def stop_group(_signum: int, _frame: object) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.killpg(0, signal.SIGTERM)

    signal.signal(signal.SIGTERM, stop_group)
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
        except (OSError, AttributeError):
            pass
    if os.getppid() != parent:                    # the parent was gone before prctl
        stop_group(signal.SIGTERM, None)


def path_with_ninja(path: str) -> str:
    """PATH with the `ninja` wheel's directory first where no ninja is on it: torch's
    builder runs `ninja` from PATH, and the wheel (a kvrelay dependency) puts it in the
    virtualenv, which is not on PATH when a server runs the venv's python without
    activating it."""
    import shutil
    if shutil.which("ninja", path=path) is not None:
        return path
    try:
        import ninja
    except ImportError:
        return path
    return os.pathsep.join([ninja.BIN_DIR, path])


def main(argv: list[str]) -> int:
    """`python -m kvrelay.model.kernels.build DIRECTORY PARENT_PID SPEC_JSON`: compile in
    the background (the parent holds the build lock)."""
    directory, parent, spec = Path(argv[0]), int(argv[1]), BuildSpec.from_json(argv[2])
    _die_with_parent(parent)
    os.nice(BACKGROUND_NICE)
    os.environ["MAX_JOBS"] = str(BACKGROUND_JOBS)
    os.environ["PATH"] = path_with_ninja(os.environ.get("PATH", ""))
    spec.load(directory)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
