// Plain-C++ contract between the torch-facing ops (moe_op.cpp, paged_decode_op.cpp)
// and the per-ISA builds (moe_generic.cpp, moe_avx2.cpp, moe_avx512.cpp,
// moe_avx512_bf16.cpp). No torch or
// STL here: the ISA files are compiled with `#pragma GCC target(...)` and must not
// instantiate inline library code that the linker could hand to generic callers.
#pragma once
#include <stdint.h>

#include "paged_decode.h"

namespace kvrelay {

enum WeightFormat : int32_t { kF32 = 0, kBF16 = 1, kMXFP4 = 2 };

// One projection of every local expert, weights [E, rows, cols] like nn.Linear.
struct Projection {
  int32_t format;
  const void* data;       // f32/bf16 [E, rows, cols] or MXFP4 codes [E, rows, cols/32, 16]
  const uint8_t* scales;  // MXFP4 E8M0 exponents [E, rows, cols/32]; null otherwise
  const float* bias;      // [E, rows] or null
  int64_t rows, cols;
};

// The (token, expert) choices of this rank, sorted by expert:
// expert e owns sorted rows [offsets[e], offsets[e+1]).
//
// The input of an MXFP4 projection (x for gate_up, act for down) is stored with each
// group of 32 columns deinterleaved, even columns first — the order in which a group's
// 16 code bytes hold them (low nibbles = even columns, high nibbles = odd):
//
//   natural   c0 c1 c2 c3 ... c30 c31      stored   c0 c2 ... c30 | c1 c3 ... c31
//
// so the kernels decode low and high nibbles straight into matching lanes.
struct MoeProblem {
  Projection gate_up;        // rows 2I (gate/up interleaved), cols H
  Projection down;           // rows H, cols I
  const int64_t* offsets;    // [E + 1]
  const float* x;            // [n + kPadRows, H] token rows in sorted order
  float* act;                // [n + kPadRows, I] swiglu output
  float* y;                  // [n, H] weighted expert outputs
  const float* route_weight; // [n]
  const float* half_scales;  // [256]: 2^(s - 128) for each E8M0 byte s (see moe_impl.h)
  float alpha, limit;
};

// A unit of parallel work: rows [row0, row1) of one expert's projection for the expert's
// sorted token rows [tok0, tok1) (relative to offsets[expert]). tok0 is a multiple of
// kTokenChunk, so tokens fall into the same blocks of V::NB (and the same summation
// order) however an expert's tokens are cut.
struct Tile {
  int32_t expert, row0, row1, tok0, tok1;
};

// Token rows are processed in blocks of up to 8; reading up to 7 rows past the last
// expert's rows must stay inside the buffers (their results are discarded).
constexpr int64_t kPadRows = 8;
constexpr int32_t kMaxTileRows = 64;
constexpr int32_t kTokenChunk = 64;   // a multiple of every V::NB

// MXFP4 decode reads a block of R weight rows side by side, R streams; as the R rows are one
// contiguous range of codes (and of scales), the kernels prefetch that range once, in
// order, this far ahead of the block's start, so memory sees one sequential stream
// (moe_impl.h prefetch_block_step, moe_avx512_bf16.cpp bf16_block).
constexpr int64_t kFp4SeqAhead = 12288;

// Where column j of an MXFP4 projection's input is stored (see above).
inline int64_t fp4_column(int64_t j) {
  const int64_t i = j % 32;
  return j - i + (i % 2) * 16 + i / 2;
}

using TileFn = void (*)(const MoeProblem&, const Tile*, int64_t);

struct IsaKernels {
  const char* name;
  TileFn gate_up;  // fills act for the given gate_up tiles
  TileFn down;     // fills y for the given down tiles
  DecodeFn decode; // paged decode attention work items (paged_decode.h)
};

// The build for ISA `name` ("" or null: the best this CPU supports); throws if the CPU
// lacks it. Defined in moe_op.cpp, shared by every op of the extension.
const IsaKernels& isa_kernels(const char* name);

bool generic_kernels(IsaKernels* out);
bool avx2_kernels(IsaKernels* out);    // false where not compiled (non-x86)
bool avx512_kernels(IsaKernels* out);
bool avx512_bf16_kernels(IsaKernels* out);   // avx512 + bf16 dot products for MXFP4

}  // namespace kvrelay
