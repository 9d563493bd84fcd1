// Routing on the GPU: the torch launchers of routing_kernels.cuh (one block per character row,
// k block-wide argmaxes, integer-atomic load counts).
#include <torch/library.h>

#include "launch.cuh"
#include "routing_kernels.cuh"

namespace minagi {
namespace {

std::tuple<at::Tensor, at::Tensor, at::Tensor> routing_cuda(const at::Tensor& logits_in, int64_t top_k) {
  check_routing_args(logits_in, top_k);
  check_gpu_slots(logits_in.size(1), "routing");
  const int64_t N = logits_in.size(0), S = logits_in.size(1);
  const c10::cuda::CUDAGuard guard(logits_in.device());
  const at::Tensor logits = logits_in.contiguous();
  at::Tensor idx = at::empty({N, top_k}, logits.options().dtype(at::kLong));
  at::Tensor gates = at::empty({N, top_k}, logits.options());
  at::Tensor load = at::zeros({S}, logits.options().dtype(at::kLong));
  if (N == 0) return {idx, gates, load};
  const int threads = gpu::pow2_threads(S, gpu::kMinThreads, 256);
  MINAGI_DISPATCH_FLOATING(logits.scalar_type(), "minagi_routing_cuda", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const size_t smem = gpu::routing_smem_bytes<acc_t>(S, threads, top_k);
    TORCH_INTERNAL_ASSERT(smem <= 48 * 1024, "minagi.routing: ", smem, " bytes of shared memory at ", S,
                          " slots: kMaxGpuSlots is too high for this kernel");
    gpu::routing_kernel<scalar_t><<<gpu::blocks_for(N, 1), threads, smem, at::cuda::getCurrentCUDAStream()>>>(
        logits.data_ptr<scalar_t>(), N, static_cast<int>(S), static_cast<int>(top_k), idx.data_ptr<int64_t>(),
        gates.data_ptr<scalar_t>(), reinterpret_cast<unsigned long long*>(load.data_ptr<int64_t>()));
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return {idx, gates, load};
}

at::Tensor routing_backward_cuda(const at::Tensor& grad_gates_in, const at::Tensor& gates_in,
                                 const at::Tensor& slot_idx_in, int64_t n_slots) {
  check_routing_backward_args(grad_gates_in, gates_in, slot_idx_in, n_slots);
  const c10::cuda::CUDAGuard guard(gates_in.device());
  const at::Tensor gg = grad_gates_in.contiguous(), g = gates_in.contiguous(), idx = slot_idx_in.contiguous();
  const int64_t N = g.size(0), k = g.size(1);
  at::Tensor out = at::zeros({N, n_slots}, g.options());
  if (N == 0) return out;
  MINAGI_DISPATCH_FLOATING(g.scalar_type(), "minagi_routing_backward_cuda", [&] {
    gpu::routing_backward_kernel<scalar_t><<<gpu::blocks_for(N), gpu::kThreads, 0, at::cuda::getCurrentCUDAStream()>>>(
        gg.data_ptr<scalar_t>(), g.data_ptr<scalar_t>(), idx.data_ptr<int64_t>(), N, static_cast<int>(k),
        n_slots, out.data_ptr<scalar_t>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(minagi, CUDA, m) {
  m.impl("routing", &routing_cuda);
  m.impl("routing_backward", &routing_backward_cuda);
}

}  // namespace minagi
