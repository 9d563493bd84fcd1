// Launch geometry of the GPU kernels: plain C++, shared by the torch launchers (*.cu) and the
// emulator test (tests/emu/), so the kernels run on the CPU with the grids and blocks the GPU gets.
#pragma once

#include <algorithm>
#include <cstdint>

namespace minagi {
namespace gpu {

constexpr int kThreads = 256;
// Grid-stride loops cover any size; more blocks than this only queue.
constexpr int64_t kMaxBlocks = 65535;
// Blocks of at least 64 threads: a whole wave64 (CDNA) as well as two warps / wave32s.
constexpr int kMinThreads = 64;

// max_blocks below kMaxBlocks only in tests: it sends small inputs through the grid-stride loops.
inline int64_t blocks_for(int64_t n, int threads = kThreads, int64_t max_blocks = kMaxBlocks) {
  return std::max<int64_t>(1, std::min<int64_t>((n + threads - 1) / threads, max_blocks));
}

// The smallest power of two >= n, clamped to [lo, hi]: block sizes for tree reductions.
inline int pow2_threads(int64_t n, int lo, int hi) {
  int t = lo;
  while (t < n && t < hi) t <<= 1;
  return t;
}

}  // namespace gpu
}  // namespace minagi
