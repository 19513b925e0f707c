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
`#pragma GCC target` and the ops pick the best one the running CPU supports.

Where the build fails (no compiler, no ninja, headers missing) the model keeps the
pure-PyTorch paths: `status()` says why, and a single warning is logged; the server
exports it as the `kvrelay:native_kernels_available` metric.

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
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from kvrelay import envs
from kvrelay.model import compile_hints

logger = logging.getLogger(__name__)

NAME = "kvrelay_kernels"
CSRC = Path(__file__).parent / "csrc"
SOURCES = ("moe_op.cpp", "paged_decode_op.cpp", "moe_generic.cpp", "moe_avx2.cpp",
           "moe_avx512.cpp", "paged_decode_generic.cpp", "paged_decode_avx2.cpp",
           "paged_decode_avx512.cpp", "dense_op.cpp", "dense_generic.cpp",
           "dense_avx2.cpp", "dense_avx512.cpp", "dense_avx512_bf16.cpp", "prefill_op.cpp",
           "prefill_generic.cpp", "prefill_avx2.cpp", "prefill_avx512.cpp",
           "bitmask_op.cpp", "fused_decode_op.cpp", "argmax_op.cpp", "moe_tile_op.cpp",
           "moe_tile_avx512_bf16.cpp", "decode_stack_op.cpp", "moe_avx512_bf16.cpp",
           "paged_decode_avx512_bf16.cpp")


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


@contextmanager
def _ninja_on_path() -> Iterator[None]:
    """torch's builder runs `ninja` from PATH; the `ninja` wheel (a kvrelay dependency)
    puts it in the virtualenv, which is not on PATH when a server runs the venv's python
    without activating it."""
    old = os.environ.get("PATH", "")
    if shutil.which("ninja") is None:
        try:
            import ninja
            os.environ["PATH"] = os.pathsep.join([ninja.BIN_DIR, old])
        except ImportError:
            pass
    try:
        yield
    finally:
        os.environ["PATH"] = old


def _library_path(directory: Path) -> Path:
    return directory / f"{NAME}.so"


def _build(directory: Path) -> Path:
    """Compile (or reuse) the extension; one process at a time per build directory."""
    from filelock import FileLock
    from torch.utils import cpp_extension

    directory.mkdir(parents=True, exist_ok=True)
    timeout = envs.COMPILATION_TIMEOUT_S.as_float()
    with FileLock(str(directory / "build.flock"), timeout=timeout if timeout else -1):
        library = _library_path(directory)
        if library.is_file():
            return library
        # torch's own lock file is only left behind by a build that was killed; we hold
        # the real lock, so it is stale
        (directory / "lock").unlink(missing_ok=True)
        if compiler() is None:
            raise RuntimeError(f"no C++ compiler ({cpp_extension.get_cxx_compiler()!r} not found; "
                               "set CXX or install g++)")
        logger.info("building the native kernels in %s (once per kvrelay/torch version)",
                    directory)
        with _ninja_on_path():
            cpp_extension.load(NAME, [str(CSRC / s) for s in SOURCES],
                               extra_cflags=list(CFLAGS), extra_ldflags=list(LDFLAGS),
                               extra_include_paths=[str(CSRC)],
                               build_directory=str(directory), is_python_module=False,
                               verbose=False)
        return library


@functools.cache
def _register_fake() -> None:
    """Shapes for torch.compile / FakeTensor tracing: the op returns x's shape and dtype."""
    @torch.library.register_fake("kvrelay_kernels::moe_experts")
    def _(x, route_weights, expert_ids, first_expert, gate_up, gate_up_scales, gate_up_bias,
          down, down_scales, down_bias, alpha, limit, isa):
        return x.new_empty(x.shape)

    @torch.library.register_fake("kvrelay_kernels::paged_decode")
    def _(q, kv_cache, block_table, seq_lens, sinks, scale, window, isa=""):
        return torch.empty_like(q)

    @torch.library.register_fake("kvrelay_kernels::write_kv")
    def _(kv_cache, k, v, slots):
        return None

    @torch.library.register_fake("kvrelay_kernels::dense_linear")
    def _(x, weight, bias, isa=""):
        return x.new_empty((x.shape[0], weight.shape[0]))

    @torch.library.register_fake("kvrelay_kernels::rms_norm")
    def _(x, weight, eps):
        return torch.empty_like(x)

    @torch.library.register_fake("kvrelay_kernels::add_rms_norm")
    def _(x, delta, weight, eps):
        return torch.empty_like(x), torch.empty_like(x)


@functools.cache
def status() -> KernelStatus:
    """Build/load the extension once per process; never raises."""
    try:
        library = _build(build_dir())
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
    logger.info("native CPU kernels loaded: %s (ISA %s of %s; dense %s)", library, isas[0],
                ", ".join(isas), dense_isa)
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
