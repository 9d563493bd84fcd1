// Sizes defined once: bucket(), the rows of a buffer allocated for n (the CPU kernels, the GPU
// kernels and the emulator), and kSmallRows, the rows per slot up to which the CPU's grouped
// GEMM takes its few-row kernels. No torch here, so the GPU kernel headers can take it in every
// build (torch, emulator, HIP alone), as they take csrc/activation.h. Python's twin of bucket() is
// minagi/reference.py's; tests/test_ops.py checks the two agree.
#pragma once

#include <cstdint>

#if defined(__CUDACC__) || defined(__HIPCC__)
#define MINAGI_SIZES_HD __host__ __device__
#else
#define MINAGI_SIZES_HD
#endif

namespace minagi {

// _bucket(n): powers of two up to 128, then multiples of 128 (0 for n <= 0). A few dozen buffer
// sizes over a run, so a caching allocator reuses its blocks instead of fragmenting.
MINAGI_SIZES_HD inline int64_t bucket(int64_t n) {
  if (n <= 0) return 0;
  if (n <= 128) {
    int64_t b = 1;
    while (b < n) b <<= 1;
    return b;
  }
  return ((n + 127) / 128) * 128;
}

// A grouped GEMM's ranges of at most this many rows (writing one character puts one row in each
// of its top_k slots) take the CPU's few-row kernels (csrc/cpu/slot_gemm.h), which read each
// slot's weights once, in place. Python's dispatch reads it (DECODE_MAX_CHARS): a call of at most
// this many characters puts at most this many rows in any slot.
constexpr int64_t kSmallRows = 4;

}  // namespace minagi
