// The per-row work of `kvrelay_kernels::grammar_rows` (bitmask_op.cpp), included once per ISA
// inside a namespace under that ISA's `#pragma GCC target`: no includes, no `pragma once`.
// A row's bitmask is llguidance's layout: word j of `bits` allows tokens 32 j .. 32 j + 31
// (bit i: token 32 j + i); words past the logits' width and bits past V allow nothing.

// The first allowed token whose logit is the allowed maximum (torch.argmax's tie rule on the
// masked row); the first allowed token when all are -inf; -1 when none is allowed.
// One pass: 32 lanes, lane i keeping the best logit of tokens 32 j + i and the first word j
// where it was seen (a strict > keeps the first); all-zero words are skipped unread.
inline int64_t masked_argmax(const float* x, const uint32_t* bits, int64_t words, int64_t V) {
  float best[32];
  int32_t at[32];
  for (int i = 0; i < 32; ++i) best[i] = -__builtin_inff(), at[i] = -1;
  const int64_t full = V / 32 < words ? V / 32 : words;     // words with 32 live tokens
  int64_t first_word = -1;
  for (int64_t j = 0; j < full; ++j) {
    const uint32_t b = bits[j];
    if (b == 0) continue;
    if (first_word < 0) first_word = j;
    const float* xs = x + 32 * j;
    const int32_t jj = static_cast<int32_t>(j);
#pragma omp simd
    for (int i = 0; i < 32; ++i) {
      const float v = ((b >> i) & 1u) ? xs[i] : -__builtin_inff();
      const bool better = v > best[i];
      best[i] = better ? v : best[i];
      at[i] = better ? jj : at[i];
    }
  }
  if (full < words && V > 32 * full) {                      // the partial last word
    const uint32_t b = bits[full];
    const int64_t n = V - 32 * full;
    for (int i = 0; i < n; ++i) {
      if (!((b >> i) & 1u)) continue;
      if (first_word < 0) first_word = full;
      if (x[32 * full + i] > best[i]) best[i] = x[32 * full + i], at[i] = int32_t(full);
    }
  }
  int64_t token = -1;
  float m = -__builtin_inff();
  for (int i = 0; i < 32; ++i) {
    if (at[i] < 0) continue;
    const int64_t t = 32 * int64_t(at[i]) + i;
    if (best[i] > m || (best[i] == m && t < token)) m = best[i], token = t;
  }
  if (token >= 0 || first_word < 0) return token;
  // every allowed logit is -inf: the first allowed token
  for (int64_t j = first_word; j < words; ++j) {
    const uint32_t live = 32 * j + 32 <= V ? bits[j] : (bits[j] & ((1u << (V - 32 * j)) - 1u));
    if (live != 0) return 32 * j + __builtin_ctz(live);
  }
  return -1;
}

// The k largest logits of a row, best first, ties by lower token id (torch.argmax's order):
// vals[0..k), ids[0..k); k <= V. A 32-token block is read element by element only when its
// maximum beats the current k-th value, which after the first blocks is rare.
inline void row_topk(const float* x, int64_t V, int64_t k, float* vals, int64_t* ids) {
  int64_t cnt = 0;
  auto push = [&](float v, int64_t t) {
    if (v != v || (cnt == k && !(v > vals[k - 1]))) return;   // NaN, or not above the k-th
    int64_t p = cnt < k ? cnt++ : k - 1;
    while (p > 0 && vals[p - 1] < v) vals[p] = vals[p - 1], ids[p] = ids[p - 1], --p;
    vals[p] = v, ids[p] = t;
  };
  const int64_t full = V / 32;
  for (int64_t j = 0; j < full; ++j) {
    const float* xs = x + 32 * j;
    if (cnt == k) {
      float m = -__builtin_inff();
#pragma omp simd reduction(max : m)
      for (int i = 0; i < 32; ++i) m = xs[i] > m ? xs[i] : m;
      if (!(m > vals[k - 1])) continue;
    }
    for (int i = 0; i < 32; ++i) push(xs[i], 32 * j + i);
  }
  for (int64_t t = 32 * full; t < V; ++t) push(x[t], t);
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
