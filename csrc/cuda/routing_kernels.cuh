// Routing's kernels: one block per character row. The row's logits sit in shared memory (NaN
// keyed as -inf, so indices are always valid); each of the k picks is one block-wide argmax
// (ties to the lower slot) through a shared-memory tree, and the softmax over the k chosen
// logits follows torch's: a NaN or all -inf choice gives NaN gates. The load per slot is an
// integer atomic count, exact whatever the order. Launched from routing.cu; run on the CPU by
// the emulator test (tests/emu/).
#pragma once

#include <cstddef>
#include <limits>

#include "kernel_prelude.cuh"

namespace minagi {
namespace gpu {

// Bytes of dynamic shared memory routing_kernel takes for S slots, `threads` threads, top k.
template <typename acc_t>
MINAGI_HOST_DEVICE constexpr size_t routing_smem_bytes(int64_t S, int threads, int64_t k) {
  return (S + threads + k) * sizeof(acc_t) + (threads + k) * sizeof(int) + S;
}

template <typename acc_t>
__device__ inline bool better(acc_t v, int i, acc_t w, int j) {
  return v > w || (v == w && i < j);
}

template <typename scalar_t>
__global__ void routing_kernel(const scalar_t* __restrict__ logits, int64_t N, int S, int k,
                               int64_t* __restrict__ idx, scalar_t* __restrict__ gates,
                               unsigned long long* __restrict__ load) {
  using acc_t = opmath_t<scalar_t>;
  acc_t* key = dynamic_smem<acc_t>();                 // [S]
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
      key[s] = is_nan(v) ? neg_inf : v;
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
  using acc_t = opmath_t<scalar_t>;
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

}  // namespace gpu
}  // namespace minagi
