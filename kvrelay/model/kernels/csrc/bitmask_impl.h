// The per-row work of `kvrelay_kernels::grammar_rows` (bitmask_op.cpp), included once per ISA
// inside a namespace under that ISA's `#pragma GCC target`: no includes, no `pragma once`.
// A row's bitmask is llguidance's layout: word j of `bits` allows tokens 32 j .. 32 j + 31
// (bit i: token 32 j + i); words past the logits' width and bits past V allow nothing.

// The largest allowed logit of a row (-inf when every allowed one is -inf or none is allowed).
inline float masked_max(const float* x, const uint32_t* bits, int64_t words, int64_t V) {
  float m = -__builtin_inff();
  for (int64_t j = 0; j < words; ++j) {
    const uint32_t b = bits[j];
    if (b == 0) continue;
    const float* xs = x + 32 * j;
    const int64_t n = V - 32 * j < 32 ? V - 32 * j : 32;
    if (b == 0xffffffffu && n == 32) {
#pragma omp simd reduction(max : m)
      for (int i = 0; i < 32; ++i) m = xs[i] > m ? xs[i] : m;
    } else {
#pragma omp simd reduction(max : m)
      for (int i = 0; i < n; ++i) {
        const float v = ((b >> i) & 1u) ? xs[i] : -__builtin_inff();
        m = v > m ? v : m;
      }
    }
  }
  return m;
}

// The first allowed token whose logit is the allowed maximum (torch.argmax's tie rule on the
// masked row); the first allowed token when all are -inf; -1 when none is allowed.
inline int64_t masked_argmax(const float* x, const uint32_t* bits, int64_t words, int64_t V) {
  const float m = masked_max(x, bits, words, V);
  int64_t first = -1;
  for (int64_t j = 0; j < words; ++j) {
    uint32_t b = bits[j];
    while (b != 0) {
      const int64_t t = 32 * j + __builtin_ctz(b);
      b &= b - 1;
      if (t >= V) break;
      if (first < 0) first = t;
      if (x[t] == m) return t;
    }
  }
  return first;
}

// Disallowed logits of a row to -inf, in place.
inline void mask_row(float* x, const uint32_t* bits, int64_t words, int64_t V) {
  const int64_t covered = 32 * words < V ? 32 * words : V;
  for (int64_t j = 0; 32 * j < covered; ++j) {
    const uint32_t b = bits[j];
    if (b == 0xffffffffu) continue;
    float* xs = x + 32 * j;
    const int64_t n = covered - 32 * j < 32 ? covered - 32 * j : 32;
#pragma omp simd
    for (int i = 0; i < n; ++i) xs[i] = ((b >> i) & 1u) ? xs[i] : -__builtin_inff();
  }
  for (int64_t t = covered; t < V; ++t) x[t] = -__builtin_inff();
}
