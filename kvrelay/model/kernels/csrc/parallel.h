// How the torch-facing ops (moe_op.cpp, paged_decode_op.cpp) spread their work items over
// torch's intra-op threads. The extension is built with -fopenmp, so at::parallel_for opens
// an OpenMP region in the same runtime (libgomp) and thread pool as torch's own ops, sized
// by torch.set_num_threads (the engine drops small steps to one thread).
//
// Work items are independent and each writes its own outputs, computed the same way
// whichever thread takes it: results are bitwise identical for any thread count.
#pragma once
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>

namespace kvrelay {

// A thread is worth waking only for this many multiply-adds of work (~20-50 us here):
// below it the fork/join barrier costs more than the split saves, and on shared cores a
// preempted partner stalls the barrier.
constexpr int64_t kMinMacsPerThread = int64_t(1) << 20;

// Threads to use for `macs` multiply-adds over `items` work items.
inline int64_t threads_for(int64_t macs, int64_t items) {
  const int64_t by_work = std::max<int64_t>(1, macs / kMinMacsPerThread);
  return std::min<int64_t>({int64_t(at::get_num_threads()), by_work, items});
}

// fn(begin, end) over [0, items) in chunks of `chunk`, taken dynamically by `threads`
// threads (items of uneven cost balance themselves; put the costly ones first).
template <class F>
void parallel_items(int64_t items, int64_t threads, int64_t chunk, const F& fn) {
  if (threads <= 1) {
    if (items > 0) fn(int64_t(0), items);
    return;
  }
  std::atomic<int64_t> next{0};
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    for (;;) {
      const int64_t begin = next.fetch_add(chunk, std::memory_order_relaxed);
      if (begin >= items) break;
      fn(begin, std::min(items, begin + chunk));
    }
  });
}

}  // namespace kvrelay
