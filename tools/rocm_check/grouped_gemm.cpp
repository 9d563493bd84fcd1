// grouped_gemm.cu's own kernel launches without torch, for tools/rocm_build_check.sh (clang -x
// hip): the ranges' offsets, the tiled grouped GEMM, the decode kernel and the weight gradient of
// grouped_gemm_kernels.cuh for every dtype, with the launcher's geometry.
#define MINAGI_NO_TORCH 1  // the kernels' plain prelude: no torch headers here

#include <hip/hip_runtime.h>

#include <algorithm>

#include "../../csrc/cuda/grouped_gemm_kernels.cuh"
#include "../../csrc/cuda/launch_geometry.h"

namespace minagi {
namespace gpu {

void offsets(const int64_t* slot_rows, int64_t A, int64_t E, int64_t* row_end, int64_t* tile_end, int* offs32,
             hipStream_t stream) {
  group_offsets_kernel<kOffsetThreads><<<1, kOffsetThreads, 0, stream>>>(slot_rows, A, E, row_end, tile_end, offs32);
}

template <typename scalar_t>
void grouped_mm(const scalar_t* a, const scalar_t* b, int64_t b_s0, int64_t b_s1, int64_t b_s2,
                const int64_t* slot_ids, const int64_t* row_end, const int64_t* tile_end, int64_t A, int64_t E,
                int64_t K, int64_t M, int64_t S, scalar_t* out, scalar_t* grad_b, hipStream_t stream) {
  const dim3 tiled((M + kTileN - 1) / kTileN, std::min<int64_t>(row_tile_bound(E, A), kMaxBlocks));
  grouped_gemm_kernel<scalar_t><<<tiled, kTileThreads, 0, stream>>>(a, b, b_s0, b_s1, b_s2, slot_ids, row_end,
                                                                     tile_end, A, E, K, M, S, false, out);
  const dim3 small((M + kTileThreads - 1) / kTileThreads, std::clamp<int64_t>(A, 1, kMaxBlocks));
  small_rows_kernel<scalar_t><<<small, kTileThreads, 0, stream>>>(a, b, b_s0, b_s1, b_s2, slot_ids, row_end, A, E,
                                                                   K, M, S, out);
  const dim3 wgrad((M + kTileN - 1) / kTileN, (K + kTileM - 1) / kTileM, std::min<int64_t>(A, kMaxBlocks));
  wgrad_kernel<scalar_t><<<wgrad, kTileThreads, 0, stream>>>(a, out, slot_ids, row_end, A, K, M, S, grad_b);
}

#define MINAGI_INSTANTIATE(T)                                                                                  \
  template void grouped_mm<T>(const T*, const T*, int64_t, int64_t, int64_t, const int64_t*, const int64_t*,   \
                              const int64_t*, int64_t, int64_t, int64_t, int64_t, int64_t, T*, T*, hipStream_t);
MINAGI_INSTANTIATE(float)
MINAGI_INSTANTIATE(double)
MINAGI_INSTANTIATE(Half)
MINAGI_INSTANTIATE(BFloat16)

}  // namespace gpu
}  // namespace minagi
