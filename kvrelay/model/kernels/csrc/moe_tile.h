// Plain-C++ contract between the torch op `moe_tiles` (moe_tile_op.cpp) and its
// AVX512-BF16 build (moe_tile_avx512_bf16.cpp): the MoE experts of a bf16 model at many
// token rows per expert (offline decode batches, prefill), as bf16 × bf16 products summed
// in fp32 by vdpbf16ps (the f32 swiglu output split into three bf16 parts whose sum is
// exact, so the down projection's products are exact too). No torch or STL here (the ISA file is compiled with its own
// `#pragma GCC target`).
//
// Layout. The token rows routed to expert e (sorted by expert: rows [offsets[e],
// offsets[e+1])) are stored "pair-packed" for vdpbf16ps: for a [M, K] bf16 block,
// element (m, k) sits at ((k / 2) · Mp + m) · 2 + k % 2, Mp = M rounded up to 16 — so one
// 64-byte load holds columns (2j, 2j+1) of 16 consecutive token rows, and a broadcast
// weight pair (w[n][2j], w[n][2j+1]) multiplies all 16 at once. Expert e's block starts
// at element padded[e] · K (padded: offsets rounded up to 16 per expert); pad rows are 0.
// The weights stay as stored ([E, out, in] bf16, or MXFP4 decoded to bf16 — exactly —
// one row block at a time), so nothing is repacked or copied per model.
#pragma once
#include <stdint.h>

namespace kvrelay {

struct TileWeights {
  const uint16_t* bf16;    // [E, rows, cols] bf16, or null for MXFP4
  const uint8_t* codes;    // MXFP4 codes [E, rows, cols/32, 16] (low nibble: even column)
  const uint8_t* scales;   // MXFP4 E8M0 exponents [E, rows, cols/32]
  const float* bias;       // [E, rows] or null
  int64_t rows, cols;
};

struct TileProblem {
  TileWeights gate_up;        // rows 2I (gate, up interleaved), cols H
  TileWeights down;           // rows H, cols I
  const int64_t* offsets;     // [E + 1] sorted token rows per expert
  const int64_t* padded;      // [E + 1] the same, each expert's count rounded up to 16
  const uint16_t* x;          // pair-packed x rows, H columns
  uint16_t* act;              // pair-packed swiglu output, I columns, as three bf16 planes
                              // (hi, mid, lo: hi + mid + lo is the f32 value exactly)
  int64_t act_plane;          // elements from one plane to the next
  float* y;                   // [n, H] expert outputs × routing weight, sorted rows
  const float* route_weight;  // [n]
  const float* scale_table;   // [256]: 2^(s - 127), the MXFP4 scale of E8M0 byte s
  float alpha, limit;
};

// A unit of parallel work: weight rows [row0, row1) of one expert against its token rows
// [tok0, tok1) (relative to the expert's first row; tok0 a multiple of 16).
struct TileItem {
  int32_t expert, row0, row1, tok0, tok1;
};

using TileItemsFn = void (*)(const TileProblem&, const TileItem*, int64_t);

struct TileKernels {
  const char* name;
  TileItemsFn gate_up;  // fills act
  TileItemsFn down;     // fills y
};

// False where not compiled (non-x86); the op also checks the CPU at run time.
bool tile_avx512_bf16(TileKernels* out);

}  // namespace kvrelay
