// The ISA variants of the native kernels: the instruction sets each one is compiled for.
// One list for every kernel family, so a name means the same CPU everywhere ("avx512" is
// F + BW + DQ + VL in the MoE, dense, prefill, argmax and grammar builds alike). The
// runtime check that the CPU runs a variant is isa_dispatch.h's `cpu_runs`, which tests
// exactly these features; kvrelay/model/kernels/isa.py is the same table for Python
// (tests/model/test_kernel_isa.py keeps the three in step).
//
// A per-ISA source selects its variant's instructions with one line after its includes:
//     KVRELAY_TARGET(KVRELAY_ISA_AVX2)
// and a function compiled for one variant inside a generic file takes
//     __attribute__((target(KVRELAY_ISA_AVX2)))
// No code here: per-ISA sources include it too.
#pragma once

// GCC's names (isa.py maps avx512bf16 to Linux's avx512_bf16)
#define KVRELAY_ISA_AVX2 "avx2,fma,f16c,popcnt"
#define KVRELAY_ISA_AVX512 "avx2,fma,f16c,popcnt,avx512f,avx512bw,avx512dq,avx512vl"
#define KVRELAY_ISA_AVX512_BF16 \
  "avx2,fma,f16c,popcnt,avx512f,avx512bw,avx512dq,avx512vl,avx512bf16"

// `#pragma GCC target` does not expand macros; _Pragma of a stringised argument does.
#define KVRELAY_PRAGMA_STRING(x) #x
#define KVRELAY_TARGET(isa) _Pragma(KVRELAY_PRAGMA_STRING(GCC target(isa)))
