// The screen (screen.h), written once and compiled once per ISA. Include inside an anonymous
// namespace after the build's simd_*.h (bf16_to_f32) and a `struct D` with
//
//   D::MR                         input rows per pass over a block's codes
//   D::dots<R>(q, x, pairs, kp0, kp1, acc)
//        acc[m][lane] += Σ_{kp in [kp0, kp1)} Σ_{j=0,1} q[kp][lane][j] · p[m][2 kp + j]
//        for R input rows (x: their code pairs, row stride `pairs`), int32, exact
//   D::F, D::W                    a float vector of W lanes (W divides 16), and on it
//        set1 load store ints(const int32_t*) (converted) add sub mul fma abs
//        any_ge(a, b) (some lane a >= b)
//
// A block's codes (16 rows × Kp bytes) are read once per pass of MR input rows, k in chunks
// that stay in L1 between the passes. Then, per input row, every lane's A ± G (screen.h), the
// best lower end, and the lanes whose upper end reaches the current threshold.
#pragma once

constexpr int64_t kChunkPairs = 512;    // 16 KiB of a block's codes per chunk

template <int R>
inline void screen_pass(const kvrelay::ScreenProblem& p, const int8_t* q, int64_t m0,
                        int32_t* acc) {
  for (int64_t kp0 = 0; kp0 < p.pairs; kp0 += kChunkPairs) {
    const int64_t kp1 = kp0 + kChunkPairs < p.pairs ? kp0 + kChunkPairs : p.pairs;
    D::dots<R>(q, p.x + m0 * p.pairs, p.pairs, kp0, kp1,
                        acc + m0 * kvrelay::kScreenLanes);
  }
}

// Keeps the rows of `s` (input row m) whose upper end reaches the current threshold; false
// where more than `cap` do.
inline bool screen_compact(kvrelay::ScreenState& s, int64_t m) {
  int64_t* index = s.index + m * s.cap;
  float* hi = s.hi + m * s.cap;
  const float threshold = s.threshold[m];
  int32_t kept = 0;
  for (int32_t i = 0; i < s.count[m]; ++i)
    if (hi[i] >= threshold) index[kept] = index[i], hi[kept] = hi[i], ++kept;
  s.count[m] = kept;
  return kept < s.cap;
}

// A block's facts as floats: the scale, W and E of each lane (screen.h).
struct BlockFacts {
  alignas(64) float s[kvrelay::kScreenLanes], w[kvrelay::kScreenLanes],
      e[kvrelay::kScreenLanes];
};

// Row m's 16 lanes of block b: A ± G, the running best lower end, the new candidates.
// Upper ends first: where none reaches the threshold no lower end can raise the best
// (lo <= hi < threshold <= lo_max), so most blocks stop there. G's coefficients come
// inflated by 2^-15 (screen_op.cpp), which covers the rounding of its three FMAs and of A ± G.
inline void screen_lanes(const kvrelay::ScreenProblem& p, int64_t b, int64_t m,
                         const int32_t* acc, const BlockFacts& f, kvrelay::ScreenState& s) {
  using F = D::F;
  constexpr int64_t L = kvrelay::kScreenLanes, V = L / D::W;
  const F t = D::set1(p.t[m]), c1 = D::set1(p.c1[m]), c2 = D::set1(p.c2[m]),
          c4 = D::set1(p.c4[m]), ua = D::set1(kvrelay::kScreenRelative),
          threshold = D::set1(s.threshold[m]);
  F a[V], g[V];
  bool any = false;
  for (int64_t j = 0; j < V; ++j) {
    a[j] = D::mul(D::ints(acc + j * D::W), D::mul(D::load(f.s + j * D::W), t));
    g[j] = D::fma(D::abs(a[j]), ua,
                  D::fma(D::load(f.w + j * D::W), c1, D::fma(D::load(f.e + j * D::W), c2, c4)));
    any |= D::any_ge(D::add(a[j], g[j]), threshold);
  }
  if (!any && !p.lo_out) return;
  alignas(64) float lo[L], hi[L];
  for (int64_t j = 0; j < V; ++j) {
    D::store(lo + j * D::W, D::sub(a[j], g[j]));
    D::store(hi + j * D::W, D::add(a[j], g[j]));
  }
  const int64_t valid = p.N - b * L;
  for (int64_t i = valid < 0 ? 0 : valid; i < L; ++i) lo[i] = hi[i] = -__builtin_inff();
  if (p.lo_out) {
    for (int64_t i = 0; i < L && i < valid; ++i) {
      p.lo_out[m * p.N + b * L + i] = lo[i];
      p.hi_out[m * p.N + b * L + i] = hi[i];
    }
  }
  float best = s.lo_max[m];
  for (int64_t i = 0; i < L; ++i) best = lo[i] > best ? lo[i] : best;
  s.lo_max[m] = best;
  if (s.overflow[m]) return;
  s.threshold[m] = kvrelay::screen_threshold(best, p.round_bf16);
  for (int64_t i = 0; i < L; ++i) {
    if (!(hi[i] >= s.threshold[m])) continue;
    if (s.count[m] == s.cap && !screen_compact(s, m)) {
      s.overflow[m] = 1;
      return;
    }
    s.index[m * s.cap + s.count[m]] = b * L + i;
    s.hi[m * s.cap + s.count[m]] = hi[i];
    ++s.count[m];
  }
}

void screen_blocks(const kvrelay::ScreenProblem& p, int64_t b0, int64_t b1,
                   kvrelay::ScreenState& s) {
  constexpr int64_t L = kvrelay::kScreenLanes;
  alignas(64) int32_t acc[kvrelay::kScreenMaxRows * L];
  BlockFacts f;
  for (int64_t b = b0; b < b1; ++b) {
    const int8_t* q = p.q + b * p.pairs * 2 * L;
    const uint16_t* facts = p.facts + b * 3 * L;
    for (int64_t i = 0; i < L; ++i) {
      f.s[i] = bf16_to_f32(facts[i]);
      f.w[i] = bf16_to_f32(facts[L + i]);
      f.e[i] = bf16_to_f32(facts[2 * L + i]);
    }
    for (int64_t i = 0; i < p.M * L; ++i) acc[i] = 0;
    int64_t m = 0;
    for (; m + D::MR <= p.M; m += D::MR) screen_pass<D::MR>(p, q, m, acc);
    if (p.M - m >= 4 && D::MR > 4) screen_pass<4>(p, q, m, acc), m += 4;
    if (p.M - m >= 2) screen_pass<2>(p, q, m, acc), m += 2;
    if (p.M - m >= 1) screen_pass<1>(p, q, m, acc), m += 1;
    for (int64_t r = 0; r < p.M; ++r) screen_lanes(p, b, r, acc + r * L, f, s);
  }
}
