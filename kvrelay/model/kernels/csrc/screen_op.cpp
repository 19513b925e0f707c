// torch ops of the screened greedy LM head (layers/screened.py), in the best ISA build this
// CPU supports:
//
//   kvrelay_kernels::screen_quantize(weight [N, K]) -> (codes, facts, w_max)
//       the int8 copy (screen.h: codes, per-row scale and norms) and the largest ‖w‖;
//       w_max -1 where a weight is not finite.
//   kvrelay_kernels::screen_argmax(x [M, K], codes, facts, N, w_max, weight [N, K], mode, kc,
//                                  max_candidates) -> (tokens int64 [M], candidates int64 [M])
//       the exact path's greedy token of every row from the int8 copy (codes, facts): the
//       screen bounds every logit (screen.h), only the candidates are computed exactly — by
//       the dense kernels' own code (`mode` 0: dense_linear's kernel for M rows, on the
//       8-column group holding the candidate; 1: the ordered product in k blocks of kc, on
//       the 16-row block holding it, packed on the fly) — and the first maximum among them
//       in index order is the token. -1 for every row where it cannot answer (an input not
//       finite, logits that could overflow, more candidates than max_candidates): the caller
//       takes the exact path. `candidates`: how many rows each input row computed exactly.
//   kvrelay_kernels::screen_exact_rows(x, weight, mode, kc) -> f32 [M, N]
//       every row as the candidates are computed (the caller checks it against the exact path
//       once per shape: the same bits, or the screen is not used there).
//   kvrelay_kernels::screen_bounds(x, codes, facts, N) -> (lo, hi) f32 [M, N]
//       every row's A - G and A + G (tests).
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <memory>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "dense.h"
#include "isa_dispatch.h"
#include "parallel.h"
#include "screen.h"

namespace kvrelay {
namespace {

#include "simd_generic.h"   // bf16_to_f32

const Variants<ScreenKernels>& screen_variants() {  // best first
  static const Variants<ScreenKernels> all = [] {
    Variants<ScreenKernels> v("kvrelay screen kernels");
    v.add(Isa::kAvx512, &screen_avx512).add(Isa::kAvx2, &screen_avx2)
        .add(Isa::kGeneric, &screen_generic);
    return v;
  }();
  return all;
}

std::vector<std::string> screen_isas() { return screen_variants().names(); }

enum ExactMode : int64_t { kExactDense = 0, kExactOrdered = 1 };

constexpr int32_t kThreadCap = 1024;    // candidates one thread may hold before compacting
constexpr int64_t kMinBytesPerThread = int64_t(1) << 20;

bool is_half(const at::Tensor& t) { return t.scalar_type() == at::kBFloat16; }

double value(float v) { return v; }
double value(uint16_t v) { return bf16_to_f32(v); }

// v rounded up to float
float up(double v) {
  float f = static_cast<float>(v);
  if (static_cast<double>(f) < v) f = std::nextafter(f, __builtin_inff());
  return f;
}

// x as fp32 rows (bf16 widened exactly)
std::vector<float> rows_f32(const at::Tensor& x) {
  std::vector<float> out(x.numel());
  if (is_half(x)) {
    const auto* src = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
    for (int64_t i = 0; i < x.numel(); ++i) out[i] = bf16_to_f32(src[i]);
  } else {
    std::memcpy(out.data(), x.data_ptr<float>(), x.numel() * sizeof(float));
  }
  return out;
}

// The inputs' int16 codes and the margin's per-row coefficients (screen.h).
struct InputCodes {
  std::vector<int32_t> pairs;       // [M][Kp / 2]
  std::vector<float> t, c1, c2, c4;
  bool ok = true;                   // false: some row is not finite or could overflow
};

InputCodes input_codes(const std::vector<float>& x, int64_t M, int64_t K, int64_t pairs,
                       double w_max) {
  InputCodes c;
  c.pairs.assign(M * pairs, 0);
  c.t.resize(M), c.c1.resize(M), c.c2.resize(M), c.c4.resize(M);
  // |Σ q p| <= 127 · P · Kp < 2^31 in every partial sum
  const int64_t P = std::min<int64_t>(32767, (int64_t(1) << 31) / (127 * 2 * pairs) - 1);
  const double u = std::ldexp(1.0, -24), tiny = std::ldexp(1.0, -126), grow = 1.0 + 1e-9;
  const double depth = double(K + 16) * u;
  if (P < 1 || depth >= 0.5) {
    c.ok = false;
    return c;
  }
  const double gamma = depth / (1.0 - depth);
  std::vector<int32_t> p(2 * pairs);
  for (int64_t m = 0; m < M && c.ok; ++m) {
    const float* row = x.data() + m * K;
    double amax = 0.0, xx = 0.0;
    for (int64_t k = 0; k < K; ++k) {
      const double v = row[k];
      if (!std::isfinite(v)) c.ok = false;
      amax = std::max(amax, std::fabs(v));
      xx += v * v;
    }
    const float t = amax > 0.0 ? static_cast<float>(amax / double(P)) : 1.0f;
    if (!c.ok || !(t > 0.0f)) {
      c.ok = false;
      break;
    }
    double ff = 0.0;
    std::fill(p.begin(), p.end(), 0);
    for (int64_t k = 0; k < K; ++k) {
      const double q = std::nearbyint(double(row[k]) / double(t));
      p[k] = static_cast<int32_t>(std::max<double>(-P, std::min<double>(P, q)));
      const double f = double(row[k]) - double(t) * p[k];     // exact in double
      ff += f * f;
    }
    for (int64_t kp = 0; kp < pairs; ++kp) {       // (p[2kp], p[2kp+1]) as int16 low, high
      const uint32_t low = static_cast<uint16_t>(p[2 * kp]);
      const uint32_t high = static_cast<uint16_t>(p[2 * kp + 1]);
      c.pairs[m * pairs + kp] = static_cast<int32_t>(low | high << 16);
    }
    const double nx = std::sqrt(xx) * grow, nf = std::sqrt(ff) * grow;
    if (!(w_max * nx <= std::ldexp(1.0, 100))) c.ok = false;    // logits far from overflow
    c.t[m] = t;
    const double inflate = 1.0 + std::ldexp(1.0, -15);       // screen.h: G's rounding
    c.c1[m] = up(double(up((nf + gamma * nx + std::sqrt(double(K)) * tiny) * grow)) * inflate);
    c.c2[m] = up(double(up((nx + nf) * grow)) * inflate);
    c.c4[m] = up(double(up(2.0 * double(K + 16) * tiny + std::ldexp(1.0, -100))) * inflate);
  }
  return c;
}

// v >= 0 rounded up to bf16 (its bits): to float upward, then to bf16 upward.
uint16_t bf16_up(double v) {
  const float f = up(v);
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  return static_cast<uint16_t>((bits >> 16) + ((bits & 0xFFFFu) != 0));
}

// The int8 copy of rows [16 b0, 16 b1) of weight [N, K] (screen.h's layout): per row
// s = max|w| / 127 rounded up to bf16, q = round(w / s) in [-127, 127], W = ‖w‖ and
// E = ‖w - s q‖ in double (w - s q is exact there), rounded up; false where a weight is
// not finite.
template <class T>
bool quantize_blocks(const T* w, int64_t N, int64_t K, int64_t pairs, int64_t b0, int64_t b1,
                     int8_t* codes, uint16_t* facts) {
  constexpr int64_t L = kScreenLanes;
  const double grow = 1.0 + 1e-9;
  std::vector<int8_t> q(K);
  for (int64_t b = b0; b < b1; ++b) {
    for (int64_t i = 0; i < L; ++i) {
      const int64_t r = b * L + i;
      uint16_t* f = facts + b * 3 * L + i;
      int8_t* out = codes + b * pairs * 2 * L + 2 * i;     // step kp at + kp * 2 L
      f[0] = f[L] = f[2 * L] = 0;
      for (int64_t kp = 0; kp < pairs; ++kp) out[kp * 2 * L] = out[kp * 2 * L + 1] = 0;
      if (r >= N) continue;
      const T* row = w + r * K;
      double amax = 0.0, ww = 0.0;
      for (int64_t k = 0; k < K; ++k) {
        const double v = value(row[k]);
        if (!std::isfinite(v)) return false;
        amax = std::max(amax, std::fabs(v));
        ww += v * v;
      }
      const uint16_t sb = bf16_up(amax / 127.0);
      const double scale = bf16_to_f32(sb);
      double ee = 0.0;
      for (int64_t k = 0; k < K; ++k) {
        const double v = value(row[k]);
        const double c = scale > 0.0 ? std::max(-127.0, std::min(127.0, std::nearbyint(v / scale)))
                                     : 0.0;
        const double e = v - scale * c;                     // exact in double
        ee += e * e;
        q[k] = static_cast<int8_t>(c);
      }
      for (int64_t k = 0; k < K; ++k) out[(k / 2) * 2 * L + (k & 1)] = q[k];
      f[0] = sb;
      f[L] = bf16_up(std::sqrt(ww) * grow);
      f[2 * L] = bf16_up(std::sqrt(ee) * grow);
    }
  }
  return true;
}

std::tuple<at::Tensor, at::Tensor, double> screen_quantize(const at::Tensor& weight) {
  TORCH_CHECK(weight.device().is_cpu() && weight.dim() == 2 && weight.is_contiguous() &&
                  (weight.scalar_type() == at::kFloat || weight.scalar_type() == at::kBFloat16),
              "screen_quantize: weight must be a contiguous float32 or bfloat16 CPU [N, K]");
  const int64_t N = weight.size(0), K = weight.size(1);
  const int64_t blocks = (N + kScreenLanes - 1) / kScreenLanes, pairs = (K + 1) / 2;
  at::Tensor codes = at::empty({blocks, pairs, kScreenLanes, 2}, weight.options().dtype(at::kChar));
  at::Tensor facts = at::empty({blocks, 3, kScreenLanes}, weight.options().dtype(at::kBFloat16));
  int8_t* c = codes.data_ptr<int8_t>();
  auto* f = reinterpret_cast<uint16_t*>(facts.data_ptr<at::BFloat16>());
  std::atomic<bool> finite{true};
  parallel_items(blocks, threads_for(N * K * 8, blocks), 64, [&](int64_t b0, int64_t b1) {
    const bool ok = is_half(weight)
        ? quantize_blocks(reinterpret_cast<const uint16_t*>(weight.data_ptr<at::BFloat16>()), N,
                          K, pairs, b0, b1, c, f)
        : quantize_blocks(weight.data_ptr<float>(), N, K, pairs, b0, b1, c, f);
    if (!ok) finite = false;
  });
  float w_max = 0.0f;
  for (int64_t b = 0; b < blocks && finite; ++b)
    for (int64_t i = 0; i < kScreenLanes; ++i) {
      const float s = bf16_to_f32(f[b * 3 * kScreenLanes + i]);
      const float v = bf16_to_f32(f[(b * 3 + 1) * kScreenLanes + i]);
      if (!std::isfinite(v) || !std::isfinite(s)) finite = false;
      w_max = std::max(w_max, v);
    }
  return {codes, facts, finite ? double(w_max) : -1.0};
}

struct Screened {
  std::vector<std::vector<int64_t>> candidates;   // per row, in index order
  bool ok = true;
};

struct Copy {          // the int8 copy's tensors, checked
  const int8_t* codes;
  const uint16_t* facts;
  int64_t blocks, pairs;
};

Copy check_copy(const at::Tensor& codes, const at::Tensor& facts, int64_t N, int64_t K) {
  TORCH_CHECK(codes.scalar_type() == at::kChar && codes.dim() == 4 && codes.is_contiguous() &&
                  codes.size(2) == kScreenLanes && codes.size(3) == 2,
              "screen: codes must be a contiguous int8 [blocks, Kp / 2, 16, 2]");
  const int64_t blocks = codes.size(0), pairs = codes.size(1);
  TORCH_CHECK(blocks == (N + kScreenLanes - 1) / kScreenLanes && pairs == (K + 1) / 2,
              "screen: codes [", blocks, ", ", pairs, ", 16, 2] do not hold N = ", N, ", K = ", K);
  TORCH_CHECK(facts.element_size() == 2 && facts.dim() == 3 && facts.is_contiguous() &&
                  facts.size(0) == blocks && facts.size(1) == 3 && facts.size(2) == kScreenLanes,
              "screen: facts must be a contiguous 2-byte [blocks, 3, 16]");
  return {codes.data_ptr<int8_t>(), static_cast<const uint16_t*>(facts.data_ptr()), blocks,
          pairs};
}

void check_x(const at::Tensor& x, const char* op) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 &&
                  (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              op, ": x must be a float32 or bfloat16 CPU [M, K]");
  TORCH_CHECK(x.size(0) >= 1 && x.size(0) <= kScreenMaxRows, op, ": 1 to ", kScreenMaxRows,
              " rows, got ", x.size(0));
}

ScreenProblem problem(const Copy& copy, const InputCodes& in, int64_t M, int64_t N, bool rnd) {
  ScreenProblem p{};
  p.q = copy.codes;
  p.facts = copy.facts;
  p.x = in.pairs.data();
  p.t = in.t.data(), p.c1 = in.c1.data(), p.c2 = in.c2.data(), p.c4 = in.c4.data();
  p.M = M, p.N = N, p.pairs = copy.pairs;
  p.round_bf16 = rnd ? 1 : 0;
  return p;
}

// One state per thread (sized for the thread count the region may use); the candidate
// lists are left uninitialised (only their first `count` entries are ever read).
struct States {
  int64_t M;
  std::vector<float> lo_max, threshold;
  std::vector<int32_t> count, overflow;
  std::unique_ptr<float[]> hi;
  std::unique_ptr<int64_t[]> index;

  States(int64_t threads, int64_t M_)
      : M(M_), lo_max(threads * M_, -__builtin_inff()), threshold(threads * M_, -__builtin_inff()),
        count(threads * M_, 0), overflow(threads * M_, 0),
        hi(new float[threads * M_ * kThreadCap]), index(new int64_t[threads * M_ * kThreadCap]) {}

  ScreenState of(int64_t thread) {
    return {lo_max.data() + thread * M, threshold.data() + thread * M, count.data() + thread * M,
            overflow.data() + thread * M, index.get() + thread * M * kThreadCap,
            hi.get() + thread * M * kThreadCap, kThreadCap};
  }
};

Screened screen(const ScreenKernels& kernels, const ScreenProblem& p, int64_t blocks,
                int64_t max_candidates) {
  const int64_t block_bytes = p.pairs * 2 * kScreenLanes + 6 * kScreenLanes;
  const int64_t threads = std::min<int64_t>(
      {int64_t(at::get_num_threads()), blocks,
       std::max<int64_t>({int64_t(1), blocks * block_bytes / kMinBytesPerThread,
                          p.M * blocks * kScreenLanes * 2 * p.pairs / kMinMacsPerThread})});
  const int64_t chunk = std::max<int64_t>(1, (int64_t(256) << 10) / block_bytes);
  const int64_t slots = std::max<int64_t>(threads, at::get_num_threads());
  States states(slots, p.M);
  parallel_items(blocks, threads, chunk, [&](int64_t begin, int64_t end) {
    const int64_t slot = std::min<int64_t>(at::get_thread_num(), slots - 1);
    ScreenState s = states.of(slot);
    kernels.screen(p, begin, end, s);
  });
  Screened out;
  out.candidates.resize(p.M);
  for (int64_t m = 0; m < p.M; ++m) {
    float best = -__builtin_inff();
    for (int64_t s = 0; s < slots; ++s) {
      best = std::max(best, states.lo_max[s * p.M + m]);
      if (states.overflow[s * p.M + m]) out.ok = false;
    }
    const float threshold = screen_threshold(best, p.round_bf16);
    std::vector<int64_t>& rows = out.candidates[m];
    for (int64_t s = 0; s < slots; ++s) {
      const ScreenState st = states.of(s);
      for (int32_t i = 0; i < st.count[m]; ++i)
        if (st.hi[m * kThreadCap + i] >= threshold) rows.push_back(st.index[m * kThreadCap + i]);
    }
    std::sort(rows.begin(), rows.end());
    if (int64_t(rows.size()) > max_candidates || rows.empty()) out.ok = false;
  }
  return out;
}

// The exact path's outputs of chosen vocabulary rows, for every input row, computed by the
// dense kernels' own code on copies of those rows:
//   ordered  the ordered product on up to 16 rows packed as lanes of one block (each lane is
//            its own FMA chain: where a row sits does not change its bits);
//   dense    dense_linear's kernel on up to 8 aligned groups of 4 rows side by side (its work
//            items start at multiples of 8 and take columns 4 at a time — a column's sum
//            depends on its group of 4 and on nothing else; the last group of a vocabulary
//            not a multiple of 4 is computed where it lies, one column at a time as there).
class ExactRows {
 public:
  ExactRows(const at::Tensor& x, const at::Tensor& weight, int64_t mode, int64_t kc,
            const std::string& dense_isa)
      : kernels_(dense_kernels(dense_isa.c_str())), mode_(mode), M_(x.size(0)),
        N_(weight.size(0)), K_(weight.size(1)), esize_(weight.element_size()),
        w_(static_cast<const char*>(weight.data_ptr())), x32_(rows_f32(x)) {
    TORCH_CHECK(mode == kExactDense || mode == kExactOrdered, "screen: mode must be 0 or 1");
    wfmt_ = is_half(weight) ? kDenseBF16 : kDenseF32;
    round_ = is_half(x);
    bf16_dot_ = mode == kExactDense && kernels_.bf16_dot && is_half(weight) && is_half(x);
    if (bf16_dot_) x16_ = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
    kc_ = kc <= 0 || kc > K_ ? std::max<int64_t>(K_, 1) : kc;
  }

  int64_t rows() const { return M_; }

  // out[m * n + i] = the exact output of vocabulary row rows[i] (ascending, distinct) for
  // input row m; `wbuf`, `ybuf`: the caller's scratch (one per thread).
  void eval(const int64_t* rows, int64_t n, float* out, std::vector<char>& wbuf,
            std::vector<char>& ybuf) const {
    std::vector<float> part;
    int64_t i = 0;
    while (i < n) {
      const int64_t used = mode_ == kExactOrdered ? ordered(rows + i, n - i, part, wbuf)
                                                  : dense(rows + i, n - i, part, wbuf, ybuf);
      for (int64_t m = 0; m < M_; ++m)
        for (int64_t j = 0; j < used; ++j) out[m * n + i + j] = part[m * used + j];
      i += used;
    }
  }

 private:
  template <class T>
  void lane(const T* row, T* dst) const {                  // one row into a lane of [K][16]
    for (int64_t k = 0; k < K_; ++k) dst[k * kOrderedLanes] = row[k];
  }

  // The first up to 16 rows as lanes of one packed block; how many it took.
  int64_t ordered(const int64_t* rows, int64_t n, std::vector<float>& part,
                  std::vector<char>& wbuf) const {
    const int64_t lanes = std::min<int64_t>(n, kOrderedLanes);
    wbuf.assign(K_ * kOrderedLanes * esize_, 0);           // [K][16], unused lanes zero
    for (int64_t i = 0; i < lanes; ++i) {
      if (wfmt_ == kDenseBF16) lane(reinterpret_cast<const uint16_t*>(w_) + rows[i] * K_,
                                    reinterpret_cast<uint16_t*>(wbuf.data()) + i);
      else lane(reinterpret_cast<const float*>(w_) + rows[i] * K_,
                reinterpret_cast<float*>(wbuf.data()) + i);
    }
    part.resize(M_ * lanes);
    OrderedProblem p{x32_.data(), wbuf.data(), wfmt_, part.data(), M_, lanes, K_,
                     round_ ? 1 : 0, nullptr, kc_};
    kernels_.ordered(p, 0, 1);
    return lanes;
  }

  // The first rows' aligned groups of 4 (up to 8 groups), or the vocabulary's ragged last
  // group alone; how many of `rows` they cover. part[m * used + j]: rows[j]'s output.
  int64_t dense(const int64_t* rows, int64_t n, std::vector<float>& part,
                std::vector<char>& wbuf, std::vector<char>& ybuf) const {
    constexpr int64_t G = 4, kMaxGroups = 8;
    const int64_t row_bytes = K_ * esize_, full = N_ / G * G;
    std::vector<int64_t> first;                            // each group's first row
    int64_t used = 0;
    if (rows[0] >= full) {                                 // the ragged last group, in place
      first.push_back(full);
      while (used < n && rows[used] >= full) ++used;
    } else {
      while (used < n && rows[used] < full) {
        const int64_t g = rows[used] / G * G;
        if (first.empty() || first.back() != g) {
          if (int64_t(first.size()) == kMaxGroups) break;
          first.push_back(g);
        }
        ++used;
      }
    }
    const bool ragged = first.size() == 1 && first[0] == full;
    const int64_t width = ragged ? N_ - full : G * int64_t(first.size());
    DenseProblem p{};
    p.M = M_, p.N = width, p.K = K_;
    p.w_format = wfmt_;
    if (ragged) {
      p.w = w_ + full * row_bytes;
    } else {
      wbuf.resize(width * row_bytes);
      for (size_t j = 0; j < first.size(); ++j)
        std::memcpy(wbuf.data() + j * G * row_bytes, w_ + first[j] * row_bytes, G * row_bytes);
      p.w = wbuf.data();
    }
    if (bf16_dot_) p.x_bf16 = x16_;
    else p.x = x32_.data();
    p.y_format = round_ ? kDenseBF16 : kDenseF32;
    ybuf.resize(M_ * width * 4);
    p.y = ybuf.data();
    (bf16_dot_ ? kernels_.bf16_dot : kernels_.fma)(p, 0, width);
    part.resize(M_ * used);
    for (int64_t j = 0, slot = 0; j < used; ++j) {
      const int64_t g = rows[j] / G * G;
      while (!ragged && first[slot] != g) ++slot;
      const int64_t col = ragged ? rows[j] - full : slot * G + rows[j] - g;
      for (int64_t m = 0; m < M_; ++m) {
        const int64_t at = m * width + col;
        part[m * used + j] = round_ ? bf16_to_f32(reinterpret_cast<const uint16_t*>(ybuf.data())[at])
                                    : reinterpret_cast<const float*>(ybuf.data())[at];
      }
    }
    return used;
  }

  const DenseKernels& kernels_;
  int64_t mode_, M_, N_, K_, esize_, kc_ = 0;
  const char* w_;
  std::vector<float> x32_;
  const uint16_t* x16_ = nullptr;
  int32_t wfmt_ = kDenseF32;
  bool round_ = false, bf16_dot_ = false;
};

void check_weight(const at::Tensor& weight, int64_t K) {
  TORCH_CHECK(weight.device().is_cpu() && weight.dim() == 2 && weight.is_contiguous() &&
                  weight.size(0) >= 1 && weight.size(1) == K &&
                  (weight.scalar_type() == at::kFloat || weight.scalar_type() == at::kBFloat16),
              "screen: weight must be a contiguous float32 or bfloat16 [N >= 1, K]");
}

// Each row's first maximum among its candidates, in index order; false where an exact
// value is not finite (the screen's bound assumed finite logits). The union of the rows'
// candidates is computed once, for every input row.
bool exact_argmax(const ExactRows& exact, const Screened& s, int64_t* tokens) {
  const int64_t M = exact.rows();
  std::vector<int64_t> all;
  for (const auto& rows : s.candidates) all.insert(all.end(), rows.begin(), rows.end());
  std::sort(all.begin(), all.end());
  all.erase(std::unique(all.begin(), all.end()), all.end());
  const int64_t n = int64_t(all.size());
  std::vector<float> values(M * n);
  std::vector<char> wbuf, ybuf;
  exact.eval(all.data(), n, values.data(), wbuf, ybuf);
  for (int64_t m = 0; m < M; ++m) {
    tokens[m] = -1;
    float best = -__builtin_inff();
    size_t at = 0;
    for (int64_t r : s.candidates[m]) {                 // in index order: ties keep the first
      while (all[at] != r) ++at;
      const float v = values[m * n + int64_t(at)];
      if (!std::isfinite(v)) return false;
      if (tokens[m] < 0 || v > best) best = v, tokens[m] = r;
    }
  }
  return true;
}

std::tuple<at::Tensor, at::Tensor> screen_argmax(
    const at::Tensor& x_in, const at::Tensor& codes, const at::Tensor& facts, int64_t N,
    double w_max, const at::Tensor& weight, int64_t mode, int64_t kc, int64_t max_candidates,
    const std::string& isa, const std::string& dense_isa) {
  check_x(x_in, "screen_argmax");
  const at::Tensor x = x_in.contiguous();
  const int64_t M = x.size(0), K = x.size(1);
  check_weight(weight, K);
  TORCH_CHECK(weight.size(0) == N, "screen_argmax: weight has ", weight.size(0), " rows, N = ", N);
  const Copy copy = check_copy(codes, facts, N, K);
  at::Tensor tokens = at::empty({M}, x.options().dtype(at::kLong));
  at::Tensor counts = at::empty({M}, x.options().dtype(at::kLong));
  int64_t* tok = tokens.data_ptr<int64_t>();
  int64_t* cnt = counts.data_ptr<int64_t>();
  std::fill(tok, tok + M, -1);
  std::fill(cnt, cnt + M, -1);
  const InputCodes in = input_codes(rows_f32(x), M, K, copy.pairs, w_max);
  if (!in.ok) return {tokens, counts};
  const ScreenProblem p = problem(copy, in, M, N, is_half(x));
  const Screened s = screen(screen_variants().pick(isa), p, copy.blocks, max_candidates);
  for (int64_t m = 0; m < M; ++m) cnt[m] = int64_t(s.candidates[m].size());
  if (!s.ok) return {tokens, counts};
  const ExactRows exact(x, weight, mode, kc, dense_isa);
  if (!exact_argmax(exact, s, tok)) std::fill(tok, tok + M, -1);
  return {tokens, counts};
}

at::Tensor screen_exact_rows(const at::Tensor& x_in, const at::Tensor& weight, int64_t mode,
                             int64_t kc, const std::string& dense_isa) {
  check_x(x_in, "screen_exact_rows");
  const at::Tensor x = x_in.contiguous();
  check_weight(weight, x.size(1));
  const ExactRows exact(x, weight, mode, kc, dense_isa);
  const int64_t M = x.size(0), N = weight.size(0);
  at::Tensor y = at::empty({M, N}, x.options().dtype(at::kFloat));
  float* out = y.data_ptr<float>();
  constexpr int64_t kSpan = 256;                 // rows per work item, as candidates are
  const int64_t items = (N + kSpan - 1) / kSpan;
  parallel_items(items, threads_for(M * N * x.size(1), items), 1, [&](int64_t b, int64_t e) {
    std::vector<int64_t> rows;
    std::vector<float> values;
    std::vector<char> wbuf, ybuf;
    for (int64_t item = b; item < e; ++item) {
      const int64_t r0 = item * kSpan, n = std::min(kSpan, N - r0);
      rows.resize(n);
      for (int64_t i = 0; i < n; ++i) rows[i] = r0 + i;
      values.resize(M * n);
      exact.eval(rows.data(), n, values.data(), wbuf, ybuf);
      for (int64_t m = 0; m < M; ++m)
        std::memcpy(out + m * N + r0, values.data() + m * n, n * sizeof(float));
    }
  });
  return y;
}

std::tuple<at::Tensor, at::Tensor> screen_bounds(const at::Tensor& x_in, const at::Tensor& codes,
                                                 const at::Tensor& facts, int64_t N,
                                                 const std::string& isa) {
  check_x(x_in, "screen_bounds");
  const at::Tensor x = x_in.contiguous();
  const int64_t M = x.size(0), K = x.size(1);
  const Copy copy = check_copy(codes, facts, N, K);
  const InputCodes in = input_codes(rows_f32(x), M, K, copy.pairs, 0.0);
  TORCH_CHECK(in.ok, "screen_bounds: x must be finite");
  at::Tensor lo = at::empty({M, N}, x.options().dtype(at::kFloat));
  at::Tensor hi = at::empty({M, N}, x.options().dtype(at::kFloat));
  ScreenProblem p = problem(copy, in, M, N, is_half(x));
  p.lo_out = lo.data_ptr<float>();
  p.hi_out = hi.data_ptr<float>();
  States states(1, M);
  ScreenState s = states.of(0);
  screen_variants().pick(isa).screen(p, 0, copy.blocks, s);
  return {lo, hi};
}

}  // namespace
}  // namespace kvrelay

TORCH_LIBRARY_FRAGMENT(kvrelay_kernels, m) {
  m.def("screen_isas() -> str[]", &kvrelay::screen_isas);
  m.def("screen_quantize(Tensor weight) -> (Tensor, Tensor, float)");
  m.def("screen_argmax(Tensor x, Tensor codes, Tensor facts, int N, float w_max, Tensor weight, "
        "int mode, int kc, int max_candidates, str isa=\"\", str dense_isa=\"\") -> "
        "(Tensor, Tensor)");
  m.def("screen_exact_rows(Tensor x, Tensor weight, int mode, int kc, str dense_isa=\"\") -> "
        "Tensor");
  m.def("screen_bounds(Tensor x, Tensor codes, Tensor facts, int N, str isa=\"\") -> "
        "(Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(kvrelay_kernels, CPU, m) {
  m.impl("screen_quantize", &kvrelay::screen_quantize);
  m.impl("screen_argmax", &kvrelay::screen_argmax);
  m.impl("screen_exact_rows", &kvrelay::screen_exact_rows);
  m.impl("screen_bounds", &kvrelay::screen_bounds);
}
