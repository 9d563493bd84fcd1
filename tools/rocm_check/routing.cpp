// routing.cu's launches without torch, for tools/rocm_build_check.sh (clang -x hip): every kernel
// of routing_kernels.cuh for every dtype the launcher dispatches, with the launcher's geometry.
#define MINAGI_NO_TORCH 1  // the kernels' plain prelude: no torch headers here

#include <hip/hip_runtime.h>

#include "../../csrc/cuda/launch_geometry.h"
#include "../../csrc/cuda/routing_kernels.cuh"

namespace minagi {
namespace gpu {

template <typename scalar_t>
void routing(const scalar_t* logits, int64_t N, int64_t S, int64_t k, int64_t* idx, scalar_t* gates,
             unsigned long long* load, hipStream_t stream) {
  const int threads = pow2_threads(S, kMinThreads, 256);
  const size_t smem = routing_smem_bytes<opmath_t<scalar_t>>(S, threads, k);
  routing_kernel<scalar_t><<<blocks_for(N, 1), threads, smem, stream>>>(logits, N, static_cast<int>(S),
                                                                        static_cast<int>(k), idx, gates, load);
}

template <typename scalar_t>
void routing_backward(const scalar_t* grad, const scalar_t* gates, const int64_t* idx, int64_t N, int64_t k,
                      int64_t S, scalar_t* out, hipStream_t stream) {
  routing_backward_kernel<scalar_t><<<blocks_for(N), kThreads, 0, stream>>>(grad, gates, idx, N, static_cast<int>(k),
                                                                              S, out);
}

#define MINAGI_INSTANTIATE(T)                                                                                   \
  template void routing<T>(const T*, int64_t, int64_t, int64_t, int64_t*, T*, unsigned long long*, hipStream_t); \
  template void routing_backward<T>(const T*, const T*, const int64_t*, int64_t, int64_t, int64_t, T*, hipStream_t);
MINAGI_INSTANTIATE(float)
MINAGI_INSTANTIATE(double)
MINAGI_INSTANTIATE(Half)
MINAGI_INSTANTIATE(BFloat16)

}  // namespace gpu
}  // namespace minagi
