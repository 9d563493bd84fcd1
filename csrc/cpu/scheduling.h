// The grouped GEMM family's shared scheduling (grouped_gemm.cpp, grouped_gemm_act.cpp,
// grouped_gemm_backward.cpp, decode.cpp): row ranges from the plan's slot_ids / slot_rows, the
// work split into parts shared out over the threads, each thread's kept scratch, and the fused
// kernels' tile sizes. The definitions that are not templates live in scheduling.cpp; the
// templates stay here, so that each kernel file inlines them as the one file did before the split.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/ThreadLocalState.h>

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <utility>
#include <vector>

namespace minagi {

// The fused kernels' tile sizes in bytes, read at each call (the tile_bytes op in scheduling.cpp
// reads and sets them: tests force the unfused paths with 0).
//   gather: gather_mm_act keeps a chunk's gathered rows and their h in a thread's tile, small
//     enough to stay in cache between the copy and the GEMM; a slot whose rows pass it is
//     gathered whole and multiplied by one GEMM.
//   fused: scatter_mm_backward keeps one slot's rows of the output gradient in a tile.
extern std::atomic<int64_t> g_gather_tile_bytes;
extern std::atomic<int64_t> g_fused_tile_bytes;

// Validates slot_ids / slot_rows against a [E, ...] and returns each range's first row.
std::vector<int64_t> range_starts(const at::Tensor& slot_ids, const at::Tensor& slot_rows,
                                  int64_t E, int64_t n_slots, const char* op, bool unique,
                                  const char* rows_of = "the input");

// Rows from r0 on own no slot (an exact plan's dropped pairs): their outputs are zeros.
void zero_tail(at::Tensor& t, int64_t r0);

// The most rows any listed range holds.
int64_t busiest_range(const std::vector<int64_t>& start);

// Work split for the per-slot GEMMs. Each slot's range is one GEMM on one thread (the BLAS runs
// single-threaded inside a parallel region); a range too large for an even share is cut into up
// to `threads` parts (rows for grouped_mm, output columns for the weight gradient). Threads pull
// parts largest first from a shared counter, so a sink slot cannot leave a thread idle, and the
// many ~100-row ranges of a uniform load do not pay the BLAS's own thread start-up per GEMM.
struct Part {
  int64_t slot, r0, nr;  // slot id and its row range
  int64_t part, parts;   // which of the range's equal parts
};

std::vector<Part> plan_parts(const at::Tensor& slot_ids, const std::vector<int64_t>& start,
                             int64_t threads);

// n elements of scratch for this thread, kept for its next call: a fresh block of a tile's size
// (hundreds of KiB) would be mapped and faulted in page by page for every slot. Past kMaxKept
// bytes the caller's own (freed) buffer is used instead, so a thread holds at most that much.
// Each use has its own buffer: a GEMM kernel packs its weights (kPack) while the caller's gathered
// rows (kTile) are its input, and slot_mm's widened product its float32 copies (kWiden).
constexpr size_t kMaxKept = size_t{4} << 20;
enum class Scratch { kTile, kPack, kWiden };

template <typename T, Scratch use = Scratch::kTile>
T* thread_scratch(int64_t n, std::vector<T>& own) {
  thread_local std::vector<T> kept;
  std::vector<T>& buf = static_cast<size_t>(n) * sizeof(T) <= kMaxKept ? kept : own;
  if (static_cast<int64_t>(buf.size()) < n) buf.resize(n);
  return buf.data();
}

namespace {

// [lo, hi) of `size` for part p of n, in multiples of `align` so SIMD tiles stay whole.
inline std::pair<int64_t, int64_t> part_range(int64_t size, int64_t p, int64_t n, int64_t align) {
  int64_t step = (size + n - 1) / n;
  step = ((step + align - 1) / align) * align;
  return {std::min(size, p * step), std::min(size, (p + 1) * step)};
}

template <typename P, typename F>
void run_parts(const std::vector<P>& parts, F&& fn) {
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), static_cast<int64_t>(parts.size()));
  if (threads <= 1 || at::in_parallel_region()) {
    for (const P& part : parts) fn(part);
    return;
  }
  // Worker threads need the caller's dispatch state (autograd is excluded below this kernel).
  const at::ThreadLocalState tls;
  std::atomic<int64_t> next{0};
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    at::ThreadLocalStateGuard guard(tls);
    for (int64_t i = next++; i < static_cast<int64_t>(parts.size()); i = next++) fn(parts[i]);
  });
}

// nr rows of D into tile: for each, the row of src (one row per character) of its pair's character,
// or zeros for a padding row (pair < 0). k pairs per character.
template <typename scalar_t>
void gather_pair_rows(scalar_t* tile, const scalar_t* src, const int64_t* row_pair, int64_t nr, int64_t k,
                      int64_t D) {
  for (int64_t i = 0; i < nr; ++i) {
    const int64_t pair = row_pair[i];
    scalar_t* t = tile + i * D;
    if (pair < 0) {
      std::fill(t, t + D, scalar_t(0));
    } else {
      std::copy(src + (pair / k) * D, src + (pair / k + 1) * D, t);
    }
  }
}

}  // namespace
}  // namespace minagi
