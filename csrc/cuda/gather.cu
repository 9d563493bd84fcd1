// Bucketed gather, weighted scatter and gate_grad on the GPU: the torch launchers of
// gather_kernels.cuh (deterministic: no atomics, one writer per output element).
#include <torch/library.h>

#include "gather_kernels.cuh"
#include "launch.cuh"

namespace minagi {
namespace {

at::Tensor bucketed_gather_cuda(const at::Tensor& x_in, const at::Tensor& row_pair_in, const at::Tensor& dest_in,
                                const c10::optional<at::Tensor>& gates_in) {
  check_gather_args(x_in, row_pair_in, dest_in, gates_in);
  const c10::cuda::CUDAGuard guard(x_in.device());
  const at::Tensor x = x_in.contiguous(), row_pair = row_pair_in.contiguous();
  const at::Tensor gates = gates_in.has_value() ? gates_in->contiguous() : at::Tensor();
  const int64_t N = x.size(0), D = x.size(1), k = dest_in.size(1), E = row_pair.size(0);
  at::Tensor out = gpu::bucketed_empty(E, {D}, x.options());
  if (E * D == 0) return out;
  MINAGI_DISPATCH_FLOATING(x.scalar_type(), "minagi_bucketed_gather_cuda", [&] {
    gpu::gather_kernel<scalar_t><<<gpu::blocks_for(E * D), gpu::kThreads, 0, at::cuda::getCurrentCUDAStream()>>>(
        x.data_ptr<scalar_t>(), row_pair.data_ptr<int64_t>(),
        gates.defined() ? gates.data_ptr<scalar_t>() : nullptr, E, D, k, N * k, out.data_ptr<scalar_t>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return out;
}

at::Tensor weighted_scatter_cuda(const at::Tensor& rows_in, const at::Tensor& dest_in, const at::Tensor& row_pair_in,
                                 const c10::optional<at::Tensor>& gates_in) {
  check_scatter_args(rows_in, dest_in, row_pair_in, gates_in);
  const c10::cuda::CUDAGuard guard(rows_in.device());
  const at::Tensor rows = rows_in.contiguous(), dest = dest_in.contiguous();
  const at::Tensor gates = gates_in.has_value() ? gates_in->contiguous() : at::Tensor();
  const int64_t E = rows.size(0), D = rows.size(1), N = dest.size(0), k = dest.size(1);
  at::Tensor out = at::empty({N, D}, rows.options());
  if (N * D == 0) return out;
  MINAGI_DISPATCH_FLOATING(rows.scalar_type(), "minagi_weighted_scatter_cuda", [&] {
    gpu::scatter_kernel<scalar_t><<<gpu::blocks_for(N * D), gpu::kThreads, 0, at::cuda::getCurrentCUDAStream()>>>(
        rows.data_ptr<scalar_t>(), dest.data_ptr<int64_t>(), gates.defined() ? gates.data_ptr<scalar_t>() : nullptr,
        N, D, k, E, out.data_ptr<scalar_t>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return out;
}

at::Tensor gate_grad_cuda(const at::Tensor& a_in, const at::Tensor& rows_in, const at::Tensor& dest_in,
                          const at::Tensor& row_pair_in) {
  check_gate_grad_args(a_in, rows_in, dest_in, row_pair_in);
  const c10::cuda::CUDAGuard guard(a_in.device());
  const at::Tensor a = a_in.contiguous(), rows = rows_in.contiguous(), dest = dest_in.contiguous();
  const int64_t N = a.size(0), D = a.size(1), k = dest.size(1), E = rows.size(0);
  at::Tensor out = at::empty({N, k}, a.options());
  if (N * k == 0) return out;
  const int threads = gpu::pow2_threads(D, gpu::kMinThreads, 256);
  MINAGI_DISPATCH_FLOATING(a.scalar_type(), "minagi_gate_grad_cuda", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    gpu::gate_grad_kernel<scalar_t><<<gpu::blocks_for(N * k, 1), threads, threads * sizeof(acc_t),
                                 at::cuda::getCurrentCUDAStream()>>>(
        a.data_ptr<scalar_t>(), rows.data_ptr<scalar_t>(), dest.data_ptr<int64_t>(), N * k, D, k, E,
        out.data_ptr<scalar_t>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(minagi, CUDA, m) {
  m.impl("bucketed_gather", &bucketed_gather_cuda);
  m.impl("weighted_scatter", &weighted_scatter_cuda);
  m.impl("gate_grad", &gate_grad_cuda);
}

}  // namespace minagi
