// The grouped GEMM's own kernel: the decode case (a handful of rows per slot: one character puts
// one row in each of its top_k slots), which reads each listed slot's weights in place, once,
// like the CPU's small_rows_mm. Larger groups go through ATen's batched matmul (grouped_gemm.cu).
// Run on the CPU by the emulator test (tests/emu/).
#pragma once

#include "kernel_prelude.cuh"

namespace minagi {
namespace gpu {

using ::minagi::kSmallRows;  // csrc/sizes.h: rows per slot up to which the in-place kernel runs (as on the CPU)

// out[row0[i] + r] = a[row0[i] + r] @ b[slot_ids[i]] for r < nrows[i] <= kSmallRows: block (x, i)
// computes blockDim.x output columns of listed slot i, each thread reading its column of the
// slot's weights once, in place (coalesced across the block), accumulating in opmath (fp32 for
// bf16 / fp16).
template <typename scalar_t>
__global__ void small_rows_kernel(const scalar_t* __restrict__ a, const scalar_t* __restrict__ b, int64_t b_s0,
                                  int64_t b_s1, int64_t b_s2, const int64_t* __restrict__ slot_ids,
                                  const int64_t* __restrict__ row0, const int64_t* __restrict__ nrows, int64_t K,
                                  int64_t M, int64_t S, scalar_t* __restrict__ out) {
  using acc_t = opmath_t<scalar_t>;
  const int64_t i = blockIdx.y;
  const int64_t m = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  const int64_t nr = nrows[i];
  if (m >= M || nr == 0) return;
  CUDA_KERNEL_ASSERT(nr <= kSmallRows);
  const int64_t slot = slot_ids[i];
  CUDA_KERNEL_ASSERT(slot >= 0 && slot < S && "minagi.grouped_mm: slot_ids outside [0, n_slots)");
  const scalar_t* w = b + slot * b_s0 + m * b_s2;
  const scalar_t* x = a + row0[i] * K;
  acc_t y[kSmallRows] = {};
  for (int64_t k = 0; k < K; ++k) {
    const acc_t wk = static_cast<acc_t>(w[k * b_s1]);
#pragma unroll
    for (int r = 0; r < kSmallRows; ++r) {
      if (r < nr) y[r] += static_cast<acc_t>(x[r * K + k]) * wk;
    }
  }
  for (int r = 0; r < nr; ++r) out[(row0[i] + r) * M + m] = static_cast<scalar_t>(y[r]);
}

}  // namespace gpu
}  // namespace minagi
