// grouped_gemm.cu's own kernel launch without torch, for tools/rocm_build_check.sh (clang -x hip):
// the decode kernel of grouped_gemm_kernels.cuh for every dtype, with the launcher's geometry.
// (The other grouped GEMM paths are ATen batched matmuls: hipBLASLt's, not this project's code.)
#define MINAGI_NO_TORCH 1  // the kernels' plain prelude: no torch headers here

#include <hip/hip_runtime.h>

#include "../../csrc/cuda/grouped_gemm_kernels.cuh"
#include "../../csrc/cuda/launch_geometry.h"

namespace minagi {
namespace gpu {

template <typename scalar_t>
void small_rows_mm(const scalar_t* a, const scalar_t* b, int64_t b_s0, int64_t b_s1, int64_t b_s2,
                   const int64_t* slot_ids, const int64_t* row0, const int64_t* nrows, int64_t A, int64_t K, int64_t M,
                   int64_t S, scalar_t* out, hipStream_t stream) {
  const dim3 grid(static_cast<unsigned>((M + kThreads - 1) / kThreads), static_cast<unsigned>(A));
  small_rows_kernel<scalar_t><<<grid, kThreads, 0, stream>>>(a, b, b_s0, b_s1, b_s2, slot_ids, row0, nrows, K, M, S,
                                                              out);
}

#define MINAGI_INSTANTIATE(T)                                                                                   \
  template void small_rows_mm<T>(const T*, const T*, int64_t, int64_t, int64_t, const int64_t*, const int64_t*, \
                                 const int64_t*, int64_t, int64_t, int64_t, int64_t, T*, hipStream_t);
MINAGI_INSTANTIATE(float)
MINAGI_INSTANTIATE(double)
MINAGI_INSTANTIATE(Half)
MINAGI_INSTANTIATE(BFloat16)

}  // namespace gpu
}  // namespace minagi
