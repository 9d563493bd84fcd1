// Bucketed gather, weighted scatter and gate_grad on the GPU. Deterministic by construction:
// every output element is written by one thread (or reduced by one block in a fixed order), so
// the combine has no atomics and the same inputs give the same bits.
#include <torch/library.h>

#include "launch.cuh"

namespace minagi {
namespace {

template <typename scalar_t>
__global__ void gather_kernel(const scalar_t* __restrict__ x, const int64_t* __restrict__ row_pair,
                              const scalar_t* __restrict__ gates, int64_t E, int64_t D, int64_t k,
                              int64_t NK, scalar_t* __restrict__ out) {
  using acc_t = at::opmath_type<scalar_t>;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < E * D;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t e = i / D, c = i - e * D;
    const int64_t p = row_pair[e];
    CUDA_KERNEL_ASSERT(p >= -1 && p < NK);
    if (p < 0) {
      out[i] = scalar_t(0);
    } else if (gates == nullptr) {
      out[i] = x[(p / k) * D + c];
    } else {
      out[i] = static_cast<scalar_t>(static_cast<acc_t>(gates[p]) * static_cast<acc_t>(x[(p / k) * D + c]));
    }
  }
}

template <typename scalar_t>
__global__ void scatter_kernel(const scalar_t* __restrict__ rows, const int64_t* __restrict__ dest,
                               const scalar_t* __restrict__ gates, int64_t N, int64_t D, int64_t k,
                               int64_t E, scalar_t* __restrict__ out) {
  using acc_t = at::opmath_type<scalar_t>;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < N * D;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t n = i / D, c = i - n * D;
    acc_t acc = 0;
    for (int64_t j = 0; j < k; ++j) {  // fixed order: the same sum every time
      const int64_t r = dest[n * k + j];
      CUDA_KERNEL_ASSERT(r >= -1 && r < E);
      if (r < 0) continue;
      const acc_t g = gates == nullptr ? acc_t(1) : static_cast<acc_t>(gates[n * k + j]);
      acc += g * static_cast<acc_t>(rows[r * D + c]);
    }
    out[i] = static_cast<scalar_t>(acc);
  }
}

// One block per (character, k) pair: a strided partial dot per thread, then a shared-memory tree.
template <typename scalar_t>
__global__ void gate_grad_kernel(const scalar_t* __restrict__ a, const scalar_t* __restrict__ rows,
                                 const int64_t* __restrict__ dest, int64_t NK, int64_t D, int64_t k,
                                 int64_t E, scalar_t* __restrict__ out) {
  using acc_t = at::opmath_type<scalar_t>;
  extern __shared__ __align__(sizeof(double)) unsigned char smem[];
  acc_t* part = reinterpret_cast<acc_t*>(smem);
  for (int64_t p = blockIdx.x; p < NK; p += gridDim.x) {
    const int64_t r = dest[p];
    CUDA_KERNEL_ASSERT(r >= -1 && r < E);
    acc_t acc = 0;
    if (r >= 0) {
      const scalar_t* x = a + (p / k) * D;
      const scalar_t* y = rows + r * D;
      for (int64_t c = threadIdx.x; c < D; c += blockDim.x) acc += static_cast<acc_t>(x[c]) * static_cast<acc_t>(y[c]);
    }
    part[threadIdx.x] = acc;
    __syncthreads();
    for (int half = blockDim.x / 2; half > 0; half >>= 1) {
      if (static_cast<int>(threadIdx.x) < half) part[threadIdx.x] += part[threadIdx.x + half];
      __syncthreads();
    }
    if (threadIdx.x == 0) out[p] = static_cast<scalar_t>(part[0]);
    __syncthreads();
  }
}

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
    gather_kernel<scalar_t><<<gpu::blocks_for(E * D), gpu::kThreads, 0, at::cuda::getCurrentCUDAStream()>>>(
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
    scatter_kernel<scalar_t><<<gpu::blocks_for(N * D), gpu::kThreads, 0, at::cuda::getCurrentCUDAStream()>>>(
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
    gate_grad_kernel<scalar_t><<<gpu::blocks_for(N * k, 1), threads, threads * sizeof(acc_t),
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
