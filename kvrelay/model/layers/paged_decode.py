"""Paged decode attention that reads the KV blocks in place (one query token per sequence).

    q [S, h, hd], kv_cache [2, num_blocks, kvh, B, hd], block_table [S, max_blocks],
    seq_lens [S] (context after this step), sinks [h] float32, window (0: full)
      → out [S, h, hd]

For each (sequence, KV head) the kernel walks the sequence's visible positions
`[max(0, len - window), len)` block by block through the block table, keeps the g = h / kvh
query heads of that KV head in float32 registers, and runs an online softmax (running
max, running sum, rescaled accumulator) — so no gathered copy of the context is made.
The learned sink joins the softmax denominator at the end: softmax over [scores, sink]
with the sink column dropped, the same as the reference path's `out · sigmoid(lse − sink)`.

The kernel is C++ compiled on first use with `torch.utils.cpp_extension.load_inline`
(`-O3 -march=native -fopenmp-simd`: built on and for the CPU it runs on, the extension
name keyed by the source, the torch version and the CPU's ISA flags, cached in torch's
extension folder). The loops over keys and head dims vectorise: reductions through
`omp simd`, exp through a branch-free polynomial (std::exp would need -ffast-math).
Where it cannot be built (no compiler) the caller keeps the pure-PyTorch reference path,
with one warning.
`KVRELAY_ATTENTION_KERNEL=reference` forces the reference path.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import subprocess
from pathlib import Path
from typing import Any

import torch

from kvrelay import envs

logger = logging.getLogger(__name__)

_CPP = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

// exp(x) for x <= 0 in float: x = n ln2 + r, |r| <= ln2/2, a degree-6 polynomial for e^r
// and 2^n through the exponent bits. Branch-free so the loops over keys vectorise
// (std::exp does not without -ffast-math); relative error ~2e-7, below x = -87 it returns 0.
static inline float exp_neg(float x) {
  x = std::max(x, -87.f);
  const float n = std::nearbyint(x * 1.44269504088896341f);
  const float r = x - n * 0.693359375f + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.f;
  int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

template <typename T>
static void decode_kernel(const T* q, const T* kv, const int64_t* table, const int64_t* lens,
                          const float* sinks, T* out, int64_t S, int64_t H, int64_t KVH,
                          int64_t D, int64_t B, int64_t NB, int64_t maxb, float scale,
                          int64_t window) {
  const int64_t G = H / KVH;
  const int64_t v_off = NB * KVH * B * D;            // K plane, then V plane
  at::parallel_for(0, S * KVH, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(G * D), acc(G * D), m(G), l(G), s(G * B), kf(B * D), vf(B * D);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t seq = task / KVH, kh = task % KVH;
      const int64_t len = lens[seq];
      const int64_t first = window > 0 ? std::max<int64_t>(0, len - window) : 0;
      const T* qs = q + (seq * H + kh * G) * D;
      for (int64_t i = 0; i < G * D; ++i) qf[i] = static_cast<float>(qs[i]) * scale;
      std::fill(acc.begin(), acc.end(), 0.f);
      std::fill(m.begin(), m.end(), -std::numeric_limits<float>::infinity());
      std::fill(l.begin(), l.end(), 0.f);
      for (int64_t p0 = first; p0 < len;) {
        const int64_t blk = table[seq * maxb + p0 / B];
        const int64_t off0 = p0 % B;
        const int64_t n = std::min<int64_t>(B - off0, len - p0);   // positions in this block
        const T* kb = kv + ((blk * KVH + kh) * B + off0) * D;
        const T* vb = kb + v_off;
        // this block's keys and values in fp32 once, shared by the group's query heads
        for (int64_t i = 0; i < n * D; ++i) kf[i] = static_cast<float>(kb[i]);
        for (int64_t i = 0; i < n * D; ++i) vf[i] = static_cast<float>(vb[i]);
        for (int64_t g = 0; g < G; ++g) {
          const float* qg = qf.data() + g * D;
          float* sg = s.data() + g * B;
          float mx = m[g];
          for (int64_t j = 0; j < n; ++j) {
            const float* k = kf.data() + j * D;
            float dot = 0.f;
#pragma omp simd reduction(+ : dot)
            for (int64_t d = 0; d < D; ++d) dot += qg[d] * k[d];
            sg[j] = dot;
            mx = std::max(mx, dot);
          }
          const float c = std::isinf(m[g]) ? 0.f : exp_neg(m[g] - mx);   // first block
          float sum = 0.f;
#pragma omp simd reduction(+ : sum)
          for (int64_t j = 0; j < n; ++j) {
            sg[j] = exp_neg(sg[j] - mx);
            sum += sg[j];
          }
          float* ag = acc.data() + g * D;
#pragma omp simd
          for (int64_t d = 0; d < D; ++d) ag[d] *= c;
          for (int64_t j = 0; j < n; ++j) {
            const float e = sg[j];
            const float* v = vf.data() + j * D;
#pragma omp simd
            for (int64_t d = 0; d < D; ++d) ag[d] += e * v[d];
          }
          m[g] = mx;
          l[g] = l[g] * c + sum;
        }
        p0 += n;
      }
      T* os = out + (seq * H + kh * G) * D;
      for (int64_t g = 0; g < G; ++g) {
        const float sink = sinks[kh * G + g];
        const float mx = std::max(m[g], sink);
        const float c = exp_neg(m[g] - mx);
        const float f = c / (l[g] * c + exp_neg(sink - mx));
        for (int64_t d = 0; d < D; ++d) os[g * D + d] = static_cast<T>(acc[g * D + d] * f);
      }
    }
  });
}

// new keys/values [T, kvh, hd] into their slots (block * B + offset; -1: not written)
void write_kv(torch::Tensor kv_cache, torch::Tensor k, torch::Tensor v, torch::Tensor slots) {
  TORCH_CHECK(kv_cache.is_contiguous() && kv_cache.dim() == 5, "kv_cache [2,NB,kvh,B,hd]");
  TORCH_CHECK(k.scalar_type() == kv_cache.scalar_type() && v.scalar_type() == k.scalar_type(),
              "k, v and kv_cache dtypes differ");
  k = k.contiguous();
  v = v.contiguous();
  auto sl = slots.to(torch::kInt64).contiguous();
  const int64_t T = k.size(0), NB = kv_cache.size(1), KVH = kv_cache.size(2);
  const int64_t B = kv_cache.size(3), D = kv_cache.size(4);
  TORCH_CHECK(k.size(1) == KVH && k.size(2) == D && sl.size(0) == T, "k/v/slot shapes");
  const int64_t esize = kv_cache.element_size();
  char* cache = static_cast<char*>(kv_cache.data_ptr());
  const char* kp = static_cast<const char*>(k.data_ptr());
  const char* vp = static_cast<const char*>(v.data_ptr());
  const int64_t* s = sl.data_ptr<int64_t>();
  const int64_t v_off = NB * KVH * B * D;
  for (int64_t t = 0; t < T; ++t) {
    if (s[t] < 0) continue;
    TORCH_CHECK(s[t] < NB * B, "slot out of range");
    const int64_t blk = s[t] / B, off = s[t] % B;
    for (int64_t h = 0; h < KVH; ++h) {
      const int64_t dst = ((blk * KVH + h) * B + off) * D;
      std::memcpy(cache + dst * esize, kp + (t * KVH + h) * D * esize, D * esize);
      std::memcpy(cache + (dst + v_off) * esize, vp + (t * KVH + h) * D * esize, D * esize);
    }
  }
}

torch::Tensor paged_decode(torch::Tensor q, torch::Tensor kv_cache, torch::Tensor block_table,
                           torch::Tensor seq_lens, torch::Tensor sinks, double scale,
                           int64_t window) {
  TORCH_CHECK(q.dim() == 3 && kv_cache.dim() == 5, "q [S,h,hd], kv_cache [2,NB,kvh,B,hd]");
  TORCH_CHECK(q.scalar_type() == kv_cache.scalar_type(), "q and kv_cache dtypes differ");
  q = q.contiguous();
  TORCH_CHECK(kv_cache.is_contiguous(), "kv_cache must be contiguous");
  auto table = block_table.to(torch::kInt64).contiguous();
  auto lens = seq_lens.to(torch::kInt64).contiguous();
  auto sk = sinks.to(torch::kFloat32).contiguous();
  const int64_t S = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t NB = kv_cache.size(1), KVH = kv_cache.size(2), B = kv_cache.size(3);
  TORCH_CHECK(kv_cache.size(4) == D && H % KVH == 0, "head shapes do not match");
  auto out = torch::empty_like(q);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_decode", [&] {
    decode_kernel<scalar_t>(q.data_ptr<scalar_t>(), kv_cache.data_ptr<scalar_t>(),
                            table.data_ptr<int64_t>(), lens.data_ptr<int64_t>(),
                            sk.data_ptr<float>(), out.data_ptr<scalar_t>(), S, H, KVH, D, B, NB,
                            table.size(1), static_cast<float>(scale), window);
  });
  return out;
}
"""

_FUNCTIONS = ["paged_decode", "write_kv"]


def _isa_key() -> str:
    """The CPU's ISA flags: an extension built with -march=native belongs to them."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return " ".join(
                    sorted(
                        f
                        for f in line.split(":", 1)[1].split()
                        if f.startswith(("avx", "amx", "fma", "sse", "f16c"))
                    )
                )
    except OSError:
        pass
    return torch.backends.cpu.get_cpu_capability()


@functools.cache
def extension() -> Any | None:
    """The compiled kernel module, or None (reference path) when it cannot be built."""
    if envs.ATTENTION_KERNEL.raw() == "reference":
        return None
    key = hashlib.sha256((_CPP + _isa_key() + torch.__version__).encode()).hexdigest()[:12]
    try:
        from torch.utils.cpp_extension import load_inline

        return load_inline(
            f"kvrelay_paged_decode_{key}",
            cpp_sources=[_CPP],
            functions=_FUNCTIONS,
            extra_cflags=["-O3", "-march=native", "-fopenmp-simd"],
            verbose=False,
        )
    except (RuntimeError, OSError, ImportError, subprocess.CalledProcessError) as e:
        # no compiler, no headers, a failed build: keep the reference path working
        logger.warning(
            "paged decode attention kernel unavailable (%s: %s); using the "
            "PyTorch reference path (gathers the context every step)",
            type(e).__name__,
            str(e).splitlines()[0] if str(e) else "",
        )
        return None


@torch.library.custom_op("kvrelay::paged_decode", mutates_args=())
def paged_decode(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    sinks: torch.Tensor,
    scale: float,
    window: int,
) -> torch.Tensor:
    """Decode attention over the paged cache (see the module docstring); needs extension()."""
    ext = extension()
    assert ext is not None, "paged_decode called without the compiled kernel"
    return ext.paged_decode(q, kv_cache, block_table, seq_lens, sinks, scale, window)


@paged_decode.register_fake
def _(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    sinks: torch.Tensor,
    scale: float,
    window: int,
) -> torch.Tensor:
    return torch.empty_like(q)


def available(device: torch.device) -> bool:
    return device.type == "cpu" and extension() is not None


def decode(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    sinks: torch.Tensor,
    scale: float,
    window: int,
) -> torch.Tensor:
    """`paged_decode`; eager calls go straight to the extension (the custom op's Python
    dispatch costs more than the kernel on small steps), traced ones through the op."""
    if torch.compiler.is_compiling():
        return paged_decode(q, kv_cache, block_table, seq_lens, sinks, scale, window)
    return extension().paged_decode(q, kv_cache, block_table, seq_lens, sinks, scale, window)


def write_kv(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
    """Copies each new token's K and V rows into its slot (one memcpy per KV head)."""
    extension().write_kv(kv_cache, k.to(kv_cache.dtype), v.to(kv_cache.dtype), slots)
