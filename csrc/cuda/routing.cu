// Routing on the GPU: one block per character row. The row's logits sit in shared memory (NaN
// keyed as -inf, so indices are always valid); each of the k picks is one block-wide argmax
// (ties to the lower slot) through a shared-memory tree, and the softmax over the k chosen
// logits follows torch's: a NaN or all -inf choice gives NaN gates. The load per slot is an
// integer atomic count, exact whatever the order.
#include <torch/library.h>

#include <limits>

#include "launch.cuh"

namespace minagi {
namespace {

template <typename acc_t>
__device__ inline bool better(acc_t v, int i, acc_t w, int j) {
  return v > w || (v == w && i < j);
}

template <typename scalar_t>
__global__ void routing_kernel(const scalar_t* __restrict__ logits, int64_t N, int S, int k,
                               int64_t* __restrict__ idx, scalar_t* __restrict__ gates,
                               unsigned long long* __restrict__ load) {
  using acc_t = at::opmath_type<scalar_t>;
  extern __shared__ __align__(sizeof(double)) unsigned char smem[];
  acc_t* key = reinterpret_cast<acc_t*>(smem);       // [S]
  acc_t* red_v = key + S;                             // [blockDim]
  acc_t* pick_v = red_v + blockDim.x;                 // [k]
  int* red_i = reinterpret_cast<int*>(pick_v + k);    // [blockDim]
  int* pick_i = red_i + blockDim.x;                   // [k]
  unsigned char* taken = reinterpret_cast<unsigned char*>(pick_i + k);  // [S]
  const int tid = threadIdx.x;
  const acc_t neg_inf = -std::numeric_limits<acc_t>::infinity();

  for (int64_t n = blockIdx.x; n < N; n += gridDim.x) {
    const scalar_t* row = logits + n * S;
    for (int s = tid; s < S; s += blockDim.x) {
      const acc_t v = static_cast<acc_t>(row[s]);
      key[s] = isnan(v) ? neg_inf : v;
      taken[s] = 0;
    }
    __syncthreads();
    for (int j = 0; j < k; ++j) {
      acc_t bv = neg_inf;
      int bi = S;  // "none yet": any real slot, even at -inf, beats it
      for (int s = tid; s < S; s += blockDim.x) {
        if (!taken[s] && better(key[s], s, bv, bi)) {
          bv = key[s];
          bi = s;
        }
      }
      red_v[tid] = bv;
      red_i[tid] = bi;
      __syncthreads();
      for (int half = blockDim.x / 2; half > 0; half >>= 1) {
        if (tid < half && better(red_v[tid + half], red_i[tid + half], red_v[tid], red_i[tid])) {
          red_v[tid] = red_v[tid + half];
          red_i[tid] = red_i[tid + half];
        }
        __syncthreads();
      }
      if (tid == 0) {
        const int c = red_i[0];
        taken[c] = 1;
        pick_i[j] = c;
        pick_v[j] = static_cast<acc_t>(row[c]);
      }
      __syncthreads();
    }
    if (tid == 0) {
      acc_t m = neg_inf;
      for (int j = 0; j < k; ++j) m = pick_v[j] > m ? pick_v[j] : m;
      acc_t sum = 0;
      for (int j = 0; j < k; ++j) {
        pick_v[j] = exp(pick_v[j] - m);
        sum += pick_v[j];
      }
      for (int j = 0; j < k; ++j) {
        idx[n * k + j] = pick_i[j];
        gates[n * k + j] = static_cast<scalar_t>(pick_v[j] / sum);
        atomicAdd(load + pick_i[j], 1ULL);
      }
    }
    __syncthreads();
  }
}

template <typename scalar_t>
__global__ void routing_backward_kernel(const scalar_t* __restrict__ grad, const scalar_t* __restrict__ gates,
                                        const int64_t* __restrict__ idx, int64_t N, int k, int64_t S,
                                        scalar_t* __restrict__ out) {
  using acc_t = at::opmath_type<scalar_t>;
  for (int64_t n = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; n < N;
       n += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    acc_t dot = 0;
    for (int j = 0; j < k; ++j)
      dot += static_cast<acc_t>(gates[n * k + j]) * static_cast<acc_t>(grad[n * k + j]);
    for (int j = 0; j < k; ++j) {
      const int64_t s = idx[n * k + j];
      CUDA_KERNEL_ASSERT(s >= 0 && s < S);
      scalar_t& o = out[n * S + s];
      o = static_cast<scalar_t>(static_cast<acc_t>(o) + static_cast<acc_t>(gates[n * k + j]) *
                                                             (static_cast<acc_t>(grad[n * k + j]) - dot));
    }
  }
}

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
    const size_t smem = (S + threads + top_k) * sizeof(acc_t) + (threads + top_k) * sizeof(int) + S;
    TORCH_INTERNAL_ASSERT(smem <= 48 * 1024, "minagi.routing: ", smem, " bytes of shared memory at ", S,
                          " slots: kMaxGpuSlots is too high for this kernel");
    routing_kernel<scalar_t><<<gpu::blocks_for(N, 1), threads, smem, at::cuda::getCurrentCUDAStream()>>>(
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
    routing_backward_kernel<scalar_t><<<gpu::blocks_for(N), gpu::kThreads, 0, at::cuda::getCurrentCUDAStream()>>>(
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
