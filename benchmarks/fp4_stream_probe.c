// How the MXFP4 bf16-route decode loop streams its weights, outside the extension: the same
// per-block work as moe_avx512_bf16.cpp's bf16_block (vpshufb e2m1 -> bf16, four vdpbf16ps,
// the group scales) over 20b-shaped rows (90 groups: 1440 code bytes), four rows side by side,
// with three prefetch patterns, against a plain read of the same bytes:
//
//   read      a sequential read of the buffer (the memory ceiling of this many threads)
//   none      the decode loop without software prefetches
//   per-row   each row prefetches 8 KiB past itself: four streams (the kernels before session 8)
//   in-order  the block's prefetches walk its contiguous range once, 12 KiB ahead (kernels now)
//
// Each pattern runs over 512 MB (DRAM) and over a 256 KiB slice per thread read again and
// again (L2: the compute rate). Needs AVX512-BF16 (Zen 4, Sapphire Rapids and later).
//
//   gcc -O2 -fopenmp benchmarks/fp4_stream_probe.c -o fp4_stream_probe
//   OMP_NUM_THREADS=1 ./fp4_stream_probe; OMP_NUM_THREADS=2 ./fp4_stream_probe
#define _GNU_SOURCE
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

enum { kGroups = 90, kRowBytes = kGroups * 16, kRows = 4, kBlockBytes = kRows * kRowBytes };
enum { kRead, kNone, kPerRow, kInOrder };
static const char* kNames[] = {"read", "none", "per-row", "in-order"};

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}

__attribute__((target("avx512f"))) static float read_all(const char* p, size_t n) {
  __m512i a = _mm512_setzero_si512(), b = a;
  for (size_t i = 0; i + 128 <= n; i += 128) {
    __builtin_prefetch(p + i + 8192);
    __builtin_prefetch(p + i + 8192 + 64);
    a = _mm512_add_epi32(a, _mm512_load_si512(p + i));
    b = _mm512_add_epi32(b, _mm512_load_si512(p + i + 64));
  }
  return (float)_mm512_reduce_add_epi32(_mm512_add_epi32(a, b));
}

__attribute__((target("avx512f,avx512bw"))) static __m512 group_scales(uint32_t s4) {
  const __m512i spread = _mm512_set_epi32(
      0x80038080, 0x80038080, 0x80038080, 0x80038080, 0x80028080, 0x80028080, 0x80028080,
      0x80028080, 0x80018080, 0x80018080, 0x80018080, 0x80018080, 0x80008080, 0x80008080,
      0x80008080, 0x80008080);
  const __m512i bytes = _mm512_shuffle_epi8(_mm512_set1_epi32((int)s4), spread);
  return _mm512_castsi512_ps(
      _mm512_max_epu32(_mm512_slli_epi32(bytes, 7), _mm512_set1_epi32(0x00400000)));
}

// Blocks of four rows over [p, p + n); scales are read from the codes themselves (a stand-in
// stream of the same 1/16 size would only add a second prefetch per block).
__attribute__((target("avx512f,avx512bw,avx512bf16"))) static float decode(
    const char* p, size_t n, const uint16_t* x, int pattern) {
  const __m512i low = _mm512_broadcast_i32x4(_mm_setr_epi8(
      0, 0, (char)0x80, (char)0xC0, 0, 0x40, (char)0x80, (char)0xC0, 0, 0, (char)0x80,
      (char)0xC0, 0, 0x40, (char)0x80, (char)0xC0));
  const __m512i high = _mm512_broadcast_i32x4(_mm_setr_epi8(
      0, 0x3F, 0x3F, 0x3F, 0x40, 0x40, 0x40, 0x40, (char)0x80, (char)0xBF, (char)0xBF,
      (char)0xBF, (char)0xC0, (char)0xC0, (char)0xC0, (char)0xC0));
  const __m512i nibble = _mm512_set1_epi8(0x0F);
  float total = 0;
  for (size_t base = 0; base + kBlockBytes <= n; base += kBlockBytes) {
    const char* block = p + base;
    __m512 acc[kRows];
    for (int r = 0; r < kRows; ++r) acc[r] = _mm512_setzero_ps();
    for (int b = 0; b < kGroups / 4; ++b) {
      for (int r = 0; r < kRows; ++r) {
        const char* codes = block + r * kRowBytes + b * 64;
        if (pattern == kPerRow) __builtin_prefetch(codes + 8192);
        if (pattern == kInOrder) __builtin_prefetch(block + 12288 + (b * kRows + r) * 64);
        const __m512i c = _mm512_loadu_si512(codes);
        uint32_t s4;
        memcpy(&s4, codes, 4);
        const __m512i lo = _mm512_and_si512(c, nibble);
        const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(c, 4), nibble);
        const __m512i ll = _mm512_shuffle_epi8(low, lo), lh = _mm512_shuffle_epi8(high, lo);
        const __m512i hl = _mm512_shuffle_epi8(low, hi), hh = _mm512_shuffle_epi8(high, hi);
        const __m512i w[4] = {_mm512_unpacklo_epi8(ll, lh), _mm512_unpackhi_epi8(ll, lh),
                              _mm512_unpacklo_epi8(hl, hh), _mm512_unpackhi_epi8(hl, hh)};
        __m512 d = _mm512_setzero_ps();
        for (int k = 0; k < 4; ++k)
          d = _mm512_dpbf16_ps(d, (__m512bh)w[k], (__m512bh)_mm512_loadu_si512(x + 32 * k));
        acc[r] = _mm512_fmadd_ps(d, group_scales(s4 & 0x7F7F7F7F), acc[r]);
      }
    }
    for (int r = 0; r < kRows; ++r) total += _mm512_reduce_add_ps(acc[r]);
  }
  return total;
}

int main(void) {
  const size_t big = (size_t)512 << 20, slice = (size_t)256 << 10;
  const int threads = omp_get_max_threads();
  char* buf = aligned_alloc(64, big);
  for (size_t i = 0; i < big; ++i) buf[i] = (char)(i * 2654435761u >> 13);
  uint16_t x[128];
  for (int i = 0; i < 128; ++i) x[i] = 0x3F80;  // 1.0 in bf16
  printf("threads %d; GB/s of code bytes, best of 5\n", threads);
  for (int pattern = kRead; pattern <= kInOrder; ++pattern) {
    for (int resident = 0; resident < 2; ++resident) {
      double best = 1e30;
      float sink = 0;
      for (int rep = 0; rep < 5; ++rep) {
        const double t0 = now();
#pragma omp parallel reduction(+ : sink)
        {
          const int id = omp_get_thread_num();
          const size_t part = big / threads;
          const size_t n = resident ? slice : part;
          const char* p = buf + id * part;
          const int passes = resident ? (int)(part / slice) : 1;
          for (int i = 0; i < passes; ++i)
            sink += pattern == kRead ? read_all(p, n) : decode(p, n, x, pattern);
        }
        const double t = now() - t0;
        if (t < best) best = t;
      }
      printf("%-9s %-5s %6.1f   (%g)\n", kNames[pattern], resident ? "L2" : "DRAM",
             big / best / 1e9, sink);
    }
  }
  free(buf);
  return 0;
}
