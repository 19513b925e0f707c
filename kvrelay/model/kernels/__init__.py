"""Native CPU kernels (C++), built on first use with `torch.utils.cpp_extension`.

The extension (`csrc/`) holds the grouped MoE expert computation
(`kvrelay_kernels::moe_experts`) and paged decode attention over the KV blocks in place
(`kvrelay_kernels::paged_decode`, `write_kv`; wrapped by `layers/paged_decode.py`), and
the decode-sized dense layers (`dense_linear`, `rms_norm`, `add_rms_norm`; used by
`layers/linear.py` and `layers/norm.py`, with their own ISA list: `dense_isa`). It is
compiled once per source/torch version into
`$KVRELAY_KERNELS_DIR/<name>-<hash>/` (default `~/.cache/kvrelay/kernels`, not under
KVRELAY_CACHE_DIR: one build serves every embedded-model cache) under a file lock, so
concurrent server processes build it once and later starts only load it.

No `-march=native`: the machine that builds is not always the one that runs (a shared
cache, a CPU that changes under a VM), so every ISA variant is compiled with its own
target (csrc/isa.h) and the ops pick the best one the running CPU supports, by one rule
for every family: `isa.py` is the table (`cpu_features()`, each family's variants best
first), csrc/isa_dispatch.h the same check in C++; KVRELAY_CPU_ISA caps both.

Where the build fails (no compiler, no ninja, headers missing) the model keeps the
pure-PyTorch paths: `status()` says why, and a single warning is logged; the server
exports it as the `kvrelay:native_kernels_available` metric.

A build logs each source as it is built, and a heartbeat (`build.py`). By default
`status()` waits for it, compiling in this process. After `build_in_background()` (the
serving engine core, `engine/native_switch.py`) it does not: a missing build starts on a
thread, whose compiler is a process of its own — one job at low priority — and `status()`
answers "not available, building" until it is done; the caller then clears `status` (and
what was decided from it) at a safe point and asks again, which loads the library (or
logs the failure's one warning).

This package sits below the layers that call it (`layers/moe.py`, `layers/paged_decode.py`)
and imports none of them; whether each layer uses its kernel is the layer's decision, and
`kvrelay.model.fast_paths` reports them together.
"""
from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
import shutil
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kvrelay import envs
from kvrelay.model import compile_hints
from kvrelay.model.kernels import isa
from kvrelay.model.kernels.isa import cpu_features as cpu_features

logger = logging.getLogger(__name__)

NAME = "kvrelay_kernels"
CSRC = isa.CSRC
SOURCES = isa.sources()     # every csrc/*.cpp: <family>_op.cpp and <family>_<variant>.cpp


def _thread_flags() -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(compile, link) flags for the ops' at::parallel_for (csrc/parallel.h).

    Where torch's parallel backend is OpenMP, at::parallel_for is a header template that
    opens a parallel region only in code compiled with -fopenmp; linked with -fopenmp on
    Linux, the library needs `libgomp.so.1`, which resolves to the copy torch has already
    loaded (one runtime, one thread pool, torch.set_num_threads respected). With torch's
    native thread pool, parallel_for calls into libtorch and needs no flag. Elsewhere
    (macOS clang has no -fopenmp) the ops run on one thread; -fopenmp-simd keeps the
    `omp simd` loops of the decode kernel vectorised either way."""
    openmp = "parallel backend: OpenMP" in torch.__config__.parallel_info()
    if openmp and sys.platform.startswith("linux"):
        return ("-fopenmp",), ("-fopenmp",)
    return ("-fopenmp-simd",), ()


_THREAD_CFLAGS, LDFLAGS = _thread_flags()
CFLAGS = ("-O3", "-std=c++17", "-fno-math-errno", *_THREAD_CFLAGS)


@dataclass(frozen=True)
class KernelStatus:
    """Whether the native kernels are in use, and if not, why."""

    available: bool
    isa: str | None          # the ISA variant the op runs on this CPU (best first in `isas`)
    isas: tuple[str, ...]
    reason: str              # "" when available, otherwise why the build or load failed
    library: str | None = None
    dense_isa: str | None = None   # the dense ops' variant (they also know "avx512_bf16")
    building: bool = False   # not available yet: a background build is running


def kernels_root() -> Path:
    configured = envs.KERNELS_DIR.raw()
    if configured:
        return Path(configured).expanduser()
    return envs.user_cache_dir() / "kvrelay" / "kernels"


def build_dir() -> Path:
    """One directory per source / torch / platform combination."""
    digest = hashlib.sha256()
    for name in sorted(os.listdir(CSRC)):
        digest.update(name.encode() + (CSRC / name).read_bytes())
    digest.update(f"{torch.__version__}|{platform.machine()}|{CFLAGS}|{LDFLAGS}".encode())
    return kernels_root() / f"{NAME}-{digest.hexdigest()[:16]}"


def compiler() -> str | None:
    """The C++ compiler torch's extension builder will use, if there is one."""
    from torch.utils import cpp_extension
    return shutil.which(cpp_extension.get_cxx_compiler())


def _library_path(directory: Path) -> Path:
    return directory / f"{NAME}.so"


def _build(directory: Path, background: bool = False) -> Path:
    """Compile (or reuse) the extension; one process at a time per build directory.
    `background`: one compile job at low priority, and no limit on waiting for another
    process's build (nothing waits on this one)."""
    from filelock import FileLock
    from torch.utils import cpp_extension

    from kvrelay.model.kernels import build

    directory.mkdir(parents=True, exist_ok=True)
    timeout = envs.COMPILATION_TIMEOUT_S.as_float()
    lock = FileLock(str(directory / "build.flock"), timeout=-1 if background or not timeout
                    else timeout)
    with _locked(lock, directory):
        library = _library_path(directory)
        if library.is_file():
            return library
        # torch's own lock file is only left behind by a build that was killed; we hold
        # the real lock, so it is stale
        (directory / "lock").unlink(missing_ok=True)
        if compiler() is None:
            raise RuntimeError(f"no C++ compiler ({cpp_extension.get_cxx_compiler()!r} not found; "
                               "set CXX or install g++)")
        logger.info("building the native kernels in %s (once per kvrelay/torch version): "
                    "%d sources%s", directory, len(SOURCES),
                    ", one compile job at low priority; serving on the PyTorch reference "
                    "paths meanwhile" if background else "")
        spec = build.BuildSpec(NAME, tuple(str(CSRC / s) for s in SOURCES), CFLAGS, LDFLAGS,
                               str(CSRC))
        with build.BuildWatch(directory, len(SOURCES) + 1) as watch:    # sources + the link
            if background:
                build.run_child(spec, directory)
            else:
                with _ninja_on_path():
                    spec.load(directory)
        logger.info("native kernels built in %.0f s", watch.elapsed())
        return library


@contextmanager
def _locked(lock: Any, directory: Path) -> Iterator[None]:
    """Hold the build lock; say so when another process's build has it first."""
    from filelock import Timeout

    try:
        lock.acquire(timeout=0)
    except Timeout:
        logger.info("waiting for another process building the native kernels in %s", directory)
        lock.acquire()
    try:
        yield
    finally:
        lock.release()


@contextmanager
def _ninja_on_path() -> Iterator[None]:
    """`build.path_with_ninja` while this process builds."""
    from kvrelay.model.kernels import build

    old = os.environ.get("PATH", "")
    os.environ["PATH"] = build.path_with_ninja(old)
    try:
        yield
    finally:
        os.environ["PATH"] = old


def _finished_build(directory: Path) -> bool:
    """Whether a complete build is in `directory` now (checked under the build lock, which a
    build holds until it has linked; False while another process holds it)."""
    from filelock import FileLock, Timeout

    if not _library_path(directory).is_file():
        return False
    try:
        with FileLock(str(directory / "build.flock"), timeout=0):
            return _library_path(directory).is_file()
    except Timeout:
        return False


class BackgroundBuild:
    """Owner of this process's background build: a thread running `_build` (which waits for
    another process's build of the same directory, or compiles) and its outcome."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.started = time.monotonic()
        self.seconds: float | None = None       # until the outcome is known
        self.error: BaseException | None = None
        self.done = threading.Event()
        if _finished_build(directory):          # a warm start: nothing to wait for
            self.seconds = 0.0
            self.done.set()
            return
        threading.Thread(target=self._run, name="kvrelay-kernel-build", daemon=True).start()

    def _run(self) -> None:
        try:
            _build(self.directory, background=True)
        except BaseException as exc:  # noqa: BLE001 - kept for status(), which warns once
            self.error = exc
        finally:
            self.seconds = time.monotonic() - self.started
            self.done.set()

    def library(self) -> Path | None:
        """The built library; None while building; the build's error once it failed."""
        if not self.done.is_set():
            return None
        if self.error is not None:
            raise self.error
        return _library_path(self.directory)


_background: BackgroundBuild | None = None
_in_background = False


def build_in_background() -> None:
    """From now on `status()` does not wait for a build (see the module docstring)."""
    global _in_background
    _in_background = True


def background_build() -> BackgroundBuild | None:
    """This process's background build, once `status()` has started (or found) it."""
    return _background


def stop_background_build() -> None:
    """Stop a compiler still running for this process (the engine is shutting down)."""
    from kvrelay.model.kernels import build
    build.stop()


def _library() -> Path | None:
    """The library to load, building it first (or, in the background, None until built)."""
    global _background
    if not _in_background:
        return _build(build_dir())
    if _background is None:
        _background = BackgroundBuild(build_dir())
    return _background.library()


@functools.cache
def _register_fake() -> None:
    """Shapes for torch.compile / FakeTensor tracing: the op returns x's shape and dtype."""
    @torch.library.register_fake("kvrelay_kernels::moe_experts")
    def _(x: torch.Tensor, route_weights: torch.Tensor, expert_ids: torch.Tensor,
          first_expert: int, gate_up: torch.Tensor, gate_up_scales: torch.Tensor | None,
          gate_up_bias: torch.Tensor | None, down: torch.Tensor, down_scales: torch.Tensor | None,
          down_bias: torch.Tensor | None, alpha: float, limit: float, isa: str) -> torch.Tensor:
        return x.new_empty(x.shape)

    @torch.library.register_fake("kvrelay_kernels::paged_decode")
    def _(q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
          seq_lens: torch.Tensor, sinks: torch.Tensor, scale: float, window: int,
          isa: str = "") -> torch.Tensor:
        return torch.empty_like(q)

    @torch.library.register_fake("kvrelay_kernels::write_kv")
    def _(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
        return None

    @torch.library.register_fake("kvrelay_kernels::dense_linear")
    def _(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
          isa: str = "") -> torch.Tensor:
        return x.new_empty((x.shape[0], weight.shape[0]))

    @torch.library.register_fake("kvrelay_kernels::rms_norm")
    def _(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return torch.empty_like(x)

    @torch.library.register_fake("kvrelay_kernels::add_rms_norm")
    def _(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor,
          eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.empty_like(x), torch.empty_like(x)


@functools.cache
def status() -> KernelStatus:
    """Build/load the extension once per process; never raises for the build. In the
    background (`build_in_background`) it answers `building` without waiting; call again after
    `status.cache_clear()` once `background_build().done` is set. A KVRELAY_CPU_ISA this CPU
    cannot run is a configuration error, not a reason to serve without the kernels: its
    ValueError is raised (`isa.cap`)."""
    isa.cap()
    try:
        library = _library()
        if library is None:
            return KernelStatus(False, None, (), "building in the background", building=True)
        if not hasattr(torch.ops.kvrelay_kernels, "moe_experts"):
            torch.ops.load_library(str(library))
        isas = tuple(torch.ops.kvrelay_kernels.isas())
        dense_isa = str(torch.ops.kvrelay_kernels.dense_isas()[0])
        _register_fake()
    except Exception as exc:  # noqa: BLE001 - any build failure means "use the torch path"
        reason = f"{type(exc).__name__}: {str(exc).strip().splitlines()[-1] if str(exc) else ''}"
        logger.warning("native CPU kernels unavailable, using the PyTorch reference paths "
                       "(slower MoE/MXFP4 and decode attention): %s", reason)
        return KernelStatus(False, None, (), reason)
    logger.info("native CPU kernels loaded: %s (ISA %s of %s; dense %s)%s", library, isas[0],
                ", ".join(isas), dense_isa, f", capped by {envs.CPU_ISA.name}" if isa.cap() else "")
    if isas != isa.variants("moe"):
        logger.warning("the kernels' CPU check (%s) disagrees with isa.py's (%s) on this CPU",
                       ", ".join(isas), ", ".join(isa.variants("moe")))
    return KernelStatus(True, isas[0], isas, "", str(library), dense_isa)


@compile_hints.constant_result      # a constant to torch.compile's tracing
def kernels_available() -> bool:
    return status().available


def moe_experts(x: torch.Tensor, route_weights: torch.Tensor, expert_ids: torch.Tensor,
                first_expert: int, gate_up: tuple[torch.Tensor, torch.Tensor | None],
                gate_up_bias: torch.Tensor | None, down: tuple[torch.Tensor, torch.Tensor | None],
                down_bias: torch.Tensor | None, alpha: float, limit: float,
                isa: str = "") -> torch.Tensor:
    """The MoE expert computation of this rank's experts, in fp32 (see `layers.moe`).

    x [T, H] f32 or bf16 (computed in fp32 all the same; the result's dtype); route_weights
    [T, k] f32; expert_ids [T, k] int64 (global ids; choices outside [first_expert,
    first_expert + E) are skipped). `gate_up`/`down` are
    (weights, MXFP4 scales or None): f32/bf16 [E, out, in], or MXFP4 codes
    [E, out, in/32, 16] with scales [E, out, in/32]. Biases f32 [E, out]. Returns [T, H]
    in x's dtype: Σ over a token's local choices of weight · down(swiglu(gate_up(x))).
    """
    return torch.ops.kvrelay_kernels.moe_experts(
        x, route_weights, expert_ids, first_expert, gate_up[0], gate_up[1], gate_up_bias,
        down[0], down[1], down_bias, alpha, limit, isa)
