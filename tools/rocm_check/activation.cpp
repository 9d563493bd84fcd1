// activation.cu's kernel launches without torch, for tools/rocm_build_check.sh (clang -x hip): the
// expert forms' bias + activation, their backward and the bias gradient, for every dtype, with
// the launcher's geometry.
#define MINAGI_NO_TORCH 1  // the kernels' plain prelude: no torch headers here

#include <hip/hip_runtime.h>

#include "../../csrc/cuda/activation_kernels.cuh"
#include "../../csrc/cuda/launch_geometry.h"

namespace minagi {
namespace gpu {

template <typename scalar_t>
void forms(scalar_t* h, const scalar_t* bias, scalar_t* out, const scalar_t* grad, scalar_t* grad_h,
           const int64_t* slot_ids, const int64_t* row_end, scalar_t* grad_bias, int64_t E, int64_t M, int64_t A,
           int64_t S, int act, hipStream_t stream) {
  using acc_t = opmath_t<scalar_t>;
  const int64_t W = act >= static_cast<int>(Act::Swiglu) ? M / 2 : M;
  bias_act_kernel<scalar_t><<<blocks_for(E * W), kThreads, 0, stream>>>(h, bias, slot_ids, row_end, A, out, E,
                                                                         M, act, acc_t(1.702), acc_t(7));
  act_backward_kernel<scalar_t><<<blocks_for(E * W), kThreads, 0, stream>>>(grad, h, grad_h, E, M, act,
                                                                             acc_t(1.702), acc_t(7));
  const dim3 grid(static_cast<unsigned>((M + kThreads - 1) / kThreads), static_cast<unsigned>(A > 0 ? A : 1));
  bias_grad_kernel<scalar_t><<<grid, kThreads, 0, stream>>>(grad_h, slot_ids, row_end, A, M, S, grad_bias);
}

#define MINAGI_INSTANTIATE(T)                                                                                   \
  template void forms<T>(T*, const T*, T*, const T*, T*, const int64_t*, const int64_t*, T*, int64_t, int64_t, \
                         int64_t, int64_t, int, hipStream_t);
MINAGI_INSTANTIATE(float)
MINAGI_INSTANTIATE(double)
MINAGI_INSTANTIATE(Half)
MINAGI_INSTANTIATE(BFloat16)

}  // namespace gpu
}  // namespace minagi
