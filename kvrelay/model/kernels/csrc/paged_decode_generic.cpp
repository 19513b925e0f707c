// Portable paged decode attention kernel (contract: paged_decode.h): any CPU, compiled
// with the baseline flags, the loops over keys and head dims vectorised by the compiler
// (reductions through `omp simd`, built with -fopenmp-simd). The x86 builds
// (paged_decode_avx2.cpp, paged_decode_avx512.cpp) use explicit SIMD instead.
//
// Per (sequence, KV head) the visible positions [max(0, len - window), len) are walked
// block by block through the block table; the g = H / KVH query heads of the KV head keep
// an online softmax (running max m, running sum l, rescaled accumulator) in f32, so no
// gathered copy of the context is made. The learned sink joins the denominator last:
// softmax over [scores, sink] with the sink column dropped, which equals the reference
// path's `out · sigmoid(lse − sink)`.
#include "paged_decode.h"

namespace {

#include "simd_generic.h"   // bf16_to_f32, exp_neg

// n elements of the cache at element offset `at` as f32
inline void kv_to_f32(const kvrelay::DecodeProblem& p, int64_t at, int64_t n, float* dst) {
  if (p.format == kvrelay::kKvF32) {
    __builtin_memcpy(dst, static_cast<const float*>(p.kv) + at, sizeof(float) * n);
  } else if (p.format == kvrelay::kKvBF16) {
    const uint16_t* src = static_cast<const uint16_t*>(p.kv) + at;
    for (int64_t i = 0; i < n; ++i) dst[i] = bf16_to_f32(src[i]);
  } else {
    const _Float16* src = static_cast<const _Float16*>(p.kv) + at;
    for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(src[i]);
  }
}

// One block's positions [0, n) for the G query heads: scores, online-softmax update.
inline void attend_block(const float* qf, const float* kf, const float* vf, int64_t n,
                         int64_t G, int64_t D, int64_t B, float* m, float* l, float* s,
                         float* acc) {
  for (int64_t g = 0; g < G; ++g) {
    const float* qg = qf + g * D;
    float* sg = s + g * B;
    float mx = m[g];
    for (int64_t j = 0; j < n; ++j) {
      const float* k = kf + j * D;
      float dot = 0.f;
#pragma omp simd reduction(+ : dot)
      for (int64_t d = 0; d < D; ++d) dot += qg[d] * k[d];
      sg[j] = dot;
      mx = dot > mx ? dot : mx;
    }
    const float c = __builtin_isinf(m[g]) ? 0.f : exp_neg(m[g] - mx);   // first block: 0
    float sum = 0.f;
#pragma omp simd reduction(+ : sum)
    for (int64_t j = 0; j < n; ++j) {
      sg[j] = exp_neg(sg[j] - mx);
      sum += sg[j];
    }
    float* ag = acc + g * D;
#pragma omp simd
    for (int64_t d = 0; d < D; ++d) ag[d] *= c;
    for (int64_t j = 0; j < n; ++j) {
      const float e = sg[j];
      const float* v = vf + j * D;
#pragma omp simd
      for (int64_t d = 0; d < D; ++d) ag[d] += e * v[d];
    }
    m[g] = mx;
    l[g] = l[g] * c + sum;
  }
}

}  // namespace

void kvrelay::decode_tasks_generic(const DecodeProblem& p, int64_t begin, int64_t end,
                                   float* scratch) {
  const int64_t G = p.H / p.KVH, D = p.D, B = p.B;
  const int64_t v_off = p.NB * p.KVH * B * D;          // K plane, then V plane
  float* qf = scratch;                                 // [G, D]
  float* acc = qf + G * D;                             // [G, D]
  float* m = acc + G * D;                              // [G]
  float* l = m + G;                                    // [G]
  float* s = l + G;                                    // [G, B]
  float* kf = s + G * B;                               // [B, D]
  float* vf = kf + B * D;                              // [B, D]
  for (int64_t task = begin; task < end; ++task) {
    const int64_t seq = task / p.KVH, kh = task % p.KVH;
    const int64_t len = p.lens[seq];
    const int64_t first = p.window > 0 && len > p.window ? len - p.window : 0;
    const float* qs = p.q + (seq * p.H + kh * G) * D;
    for (int64_t i = 0; i < G * D; ++i) qf[i] = qs[i] * p.scale;
    for (int64_t i = 0; i < G * D; ++i) acc[i] = 0.f;
    for (int64_t g = 0; g < G; ++g) {
      m[g] = -__builtin_inff();
      l[g] = 0.f;
    }
    for (int64_t p0 = first; p0 < len;) {
      const int64_t blk = p.table[seq * p.maxb + p0 / B];
      const int64_t off0 = p0 % B;
      const int64_t n = B - off0 < len - p0 ? B - off0 : len - p0;   // positions in the block
      const int64_t k_at = ((blk * p.KVH + kh) * B + off0) * D;
      // the block's keys and values in f32 once, shared by the group's query heads
      kv_to_f32(p, k_at, n * D, kf);
      kv_to_f32(p, k_at + v_off, n * D, vf);
      attend_block(qf, kf, vf, n, G, D, B, m, l, s, acc);
      p0 += n;
    }
    float* os = p.out + (seq * p.H + kh * G) * D;
    for (int64_t g = 0; g < G; ++g) {
      const float sink = p.sinks[kh * G + g];
      const float mx = m[g] > sink ? m[g] : sink;
      const float c = exp_neg(m[g] - mx);
      const float f = c / (l[g] * c + exp_neg(sink - mx));
      for (int64_t d = 0; d < D; ++d) os[g * D + d] = acc[g * D + d] * f;
    }
  }
}
