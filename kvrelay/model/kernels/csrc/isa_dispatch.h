// The one runtime rule for which ISA variant (isa.h) a CPU runs (capped by KVRELAY_CPU_ISA),
// and the per-family list the torch ops pick from. Included by the `*_op.cpp` files only
// (generic code, STL).
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

#include <cstdlib>
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

// KVRELAY_CPU_ISA (kvrelay/envs.py): the best variant any family may pick, so that a lesser
// CPU's kernels can be measured on this one; unset, "" or "native": no cap. Read once, when
// the first family lists its variants. Python checks the value before it loads this library
// (isa.py `cap`: an unknown name, or one this CPU cannot run, is an error there).
inline Isa isa_cap() {
  static const Isa cap = [] {
    const char* raw = std::getenv("KVRELAY_CPU_ISA");
    const std::string name = raw ? raw : "";
    for (Isa isa : {Isa::kAvx512Bf16, Isa::kAvx512, Isa::kAvx2, Isa::kGeneric})
      if (name == isa_name(isa)) return isa;
    TORCH_CHECK(name.empty() || name == "native", "KVRELAY_CPU_ISA: expected native, generic, "
                "avx2, avx512 or avx512_bf16, got '", name, "'");
    return Isa::kAvx512Bf16;
  }();
  return cap;
}

// Whether this process runs `isa`: not above the cap (the enum is best first), and this CPU
// executes the instructions isa.h lists for it (and the OS saves their registers:
// __builtin_cpu_supports checks both).
inline bool cpu_runs(Isa isa) {
  if (static_cast<int>(isa) < static_cast<int>(isa_cap())) return false;
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
