// gather.cu's launches without torch, for tools/rocm_build_check.sh (clang -x hip): every kernel
// of gather_kernels.cuh for every dtype the launchers dispatch, with their geometry.
#define MINAGI_NO_TORCH 1  // the kernels' plain prelude: no torch headers here

#include <hip/hip_runtime.h>

#include "../../csrc/cuda/gather_kernels.cuh"
#include "../../csrc/cuda/launch_geometry.h"

namespace minagi {
namespace gpu {

template <typename scalar_t>
void gather(const scalar_t* x, const int64_t* row_pair, const scalar_t* gates, int64_t E, int64_t D, int64_t k,
            int64_t NK, scalar_t* out, hipStream_t stream) {
  gather_kernel<scalar_t><<<blocks_for(E * D), kThreads, 0, stream>>>(x, row_pair, gates, E, D, k, NK, out);
}

template <typename scalar_t>
void scatter(const scalar_t* rows, const int64_t* dest, const scalar_t* gates, int64_t N, int64_t D, int64_t k,
             int64_t E, scalar_t* out, hipStream_t stream) {
  scatter_kernel<scalar_t><<<blocks_for(N * D), kThreads, 0, stream>>>(rows, dest, gates, N, D, k, E, out);
}

template <typename scalar_t>
void gate_grad(const scalar_t* a, const scalar_t* rows, const int64_t* dest, int64_t NK, int64_t D, int64_t k,
               int64_t E, scalar_t* out, hipStream_t stream) {
  const int threads = pow2_threads(D, kMinThreads, 256);
  gate_grad_kernel<scalar_t><<<blocks_for(NK, 1), threads, threads * sizeof(opmath_t<scalar_t>), stream>>>(
      a, rows, dest, NK, D, k, E, out);
}

#define MINAGI_INSTANTIATE(T)                                                                                      \
  template void gather<T>(const T*, const int64_t*, const T*, int64_t, int64_t, int64_t, int64_t, T*, hipStream_t); \
  template void scatter<T>(const T*, const int64_t*, const T*, int64_t, int64_t, int64_t, int64_t, T*, hipStream_t); \
  template void gate_grad<T>(const T*, const T*, const int64_t*, int64_t, int64_t, int64_t, int64_t, T*, hipStream_t);
MINAGI_INSTANTIATE(float)
MINAGI_INSTANTIATE(double)
MINAGI_INSTANTIATE(Half)
MINAGI_INSTANTIATE(BFloat16)

}  // namespace gpu
}  // namespace minagi
