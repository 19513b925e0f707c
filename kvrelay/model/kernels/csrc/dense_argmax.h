// The first-maximum argmax fold, written once for its three users: argmax_rows
// (argmax_op.cpp), the one-row greedy LM head (dense_op.cpp `dense_linear_argmax`) and the
// ordered product's greedy form (dense_impl.h). Each answers as torch.argmax does: the first
// maximal index, the first NaN where there is one (torch orders NaN above everything), and
// for a row of -inf none here (-1; the callers answer 0).
//
// Values are taken in blocks of L lanes; each lane keeps its best value and the block it came
// from (strict > keeps a lane's first occurrence), and the lanes' ties go to the smallest
// index. The lane loop is branch-free so that it vectorises.
//
// Include inside the including file's anonymous namespace, after its KVRELAY_TARGET line where
// it has one (as simd_generic.h): each build compiles its own copy. Every function is
// always_inline, and so is whatever calls it in argmax_op.cpp: there one copy is inlined into
// wrappers compiled for several ISAs (a callee's ISA may be a subset of its caller's), so the
// lane loop is vectorised for each wrapper's target rather than for the file's baseline.
#pragma once

#define KVRELAY_ALWAYS_INLINE __attribute__((always_inline)) inline

// No value yet: best = -inf, at = -1 in every lane.
template <int L>
KVRELAY_ALWAYS_INLINE void argmax_lanes_reset(float* best, int32_t* at) {
  for (int i = 0; i < L; ++i) best[i] = -__builtin_inff(), at[i] = -1;
}

// A whole block of L values (lane i's is get(i)) folded into the lanes; whether it held a NaN.
template <int L, class Get>
KVRELAY_ALWAYS_INLINE bool argmax_lanes_step(float* best, int32_t* at, int32_t block,
                                             const Get& get) {
  int nan = 0;
#pragma omp simd reduction(| : nan)
  for (int i = 0; i < L; ++i) {
    const float v = get(i), b = best[i];
    const bool better = v > b;
    const int32_t keep = -static_cast<int32_t>(better);   // all ones where v is better
    best[i] = better ? v : b;
    at[i] = (block & keep) | (at[i] & ~keep);   // a select GCC would turn into masked stores
    nan |= v != v;
  }
  return nan != 0;
}

// The first n < L lanes of a last, partial block.
template <int L, class Get>
KVRELAY_ALWAYS_INLINE bool argmax_lanes_tail(float* best, int32_t* at, int32_t block, int64_t n,
                                             const Get& get) {
  bool nan = false;
  for (int64_t i = 0; i < n; ++i) {
    const float v = get(i);
    nan |= v != v;
    if (v > best[i]) best[i] = v, at[i] = block;
  }
  return nan;
}

// The lanes' answer folded into (value, index), which start at (-inf, -1): the largest value
// and its first index, block · L + lane; index stays -1 where every value was -inf.
template <int L>
KVRELAY_ALWAYS_INLINE void argmax_lanes_best(const float* best, const int32_t* at, float* value,
                                             int64_t* index) {
  for (int i = 0; i < L; ++i) {
    if (at[i] < 0) continue;
    const int64_t t = int64_t(L) * at[i] + i;
    if (best[i] > *value || (best[i] == *value && t < *index)) *value = best[i], *index = t;
  }
}

// Values read from float32 memory. Where a lane's value is read through a function object it
// is this one (or another whose call operator is always_inline): a lambda's call operator is
// an ordinary inline function, which GCC may refuse to inline into a wrapper of another ISA.
struct ArgmaxF32 {
  const float* p;
  KVRELAY_ALWAYS_INLINE float operator()(int64_t i) const { return p[i]; }
};

// The first of n values (get(t)) that is a NaN, or -1.
template <class Get>
KVRELAY_ALWAYS_INLINE int64_t argmax_first_nan(int64_t n, const Get& get) {
  for (int64_t t = 0; t < n; ++t) {
    const float v = get(t);
    if (v != v) return t;
  }
  return -1;
}
