// The one runtime rule for which ISA variant (isa.h) a CPU runs, and the per-family list
// the torch ops pick from. Included by the `*_op.cpp` files only (generic code, STL).
//
//   Variants<K> v("grammar_rows");             an op family's kernels of type K
//   v.add(Isa::kAvx2, &build_avx2);            kept where the CPU runs AVX2 and the build
//                                              has the variant (false: not compiled here)
//   v.pick("")  → the best (first added);  v.pick("avx2") → that one, or an error naming
//   the op and the variant;  v.names() → the op's list for Python, best first.
//
// Families add their variants in isa.py's preference order; `Variants` keeps them so.
#pragma once
#include <c10/util/Exception.h>

#include <string>
#include <vector>

namespace kvrelay {

enum class Isa { kAvx512Bf16, kAvx512, kAvx2, kGeneric };

inline const char* isa_name(Isa isa) {
  switch (isa) {
    case Isa::kAvx512Bf16: return "avx512_bf16";
    case Isa::kAvx512: return "avx512";
    case Isa::kAvx2: return "avx2";
    case Isa::kGeneric: return "generic";
  }
  return "generic";
}

// Whether this CPU executes the instructions isa.h lists for `isa` (and the OS saves
// their registers: __builtin_cpu_supports checks both).
inline bool cpu_runs(Isa isa) {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_cpu_init();
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                    __builtin_cpu_supports("f16c") && __builtin_cpu_supports("popcnt");
  const bool avx512 = avx2 && __builtin_cpu_supports("avx512f") &&
                      __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512dq") &&
                      __builtin_cpu_supports("avx512vl");
  switch (isa) {
    case Isa::kAvx512Bf16: return avx512 && __builtin_cpu_supports("avx512bf16");
    case Isa::kAvx512: return avx512;
    case Isa::kAvx2: return avx2;
    case Isa::kGeneric: return true;
  }
  return false;
#else
  return isa == Isa::kGeneric;
#endif
}

template <class K>
class Variants {
 public:
  using Build = bool (*)(K*);   // fills the kernels; false where not compiled (non-x86)

  explicit Variants(const char* op) : op_(op) {}

  Variants& add(Isa isa, Build build) {
    K k{};
    if (cpu_runs(isa) && build(&k)) entries_.push_back({isa_name(isa), k});
    return *this;
  }

  // "" → the best this CPU runs
  const K& pick(const std::string& name) const {
    TORCH_CHECK(!entries_.empty(), op_, ": no ISA variant runs on this CPU");
    if (name.empty()) return entries_.front().kernels;
    for (const Entry& e : entries_)
      if (name == e.name) return e.kernels;
    TORCH_CHECK(false, op_, ": ISA '", name, "' is not supported on this CPU");
  }

  bool empty() const { return entries_.empty(); }

  std::vector<std::string> names() const {
    std::vector<std::string> out;
    for (const Entry& e : entries_) out.emplace_back(e.name);
    return out;
  }

 private:
  struct Entry {
    const char* name;
    K kernels;
  };
  const char* op_;
  std::vector<Entry> entries_;
};

}  // namespace kvrelay
