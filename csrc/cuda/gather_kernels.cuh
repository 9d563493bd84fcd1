// Bucketed gather, weighted scatter and gate_grad kernels. Deterministic by construction: every
// output element is written by one thread (or reduced by one block in a fixed order), so the
// combine has no atomics and the same inputs give the same bits. Launched from gather.cu; run on
// the CPU by the emulator test (tests/emu/).
#pragma once

#include "kernel_prelude.cuh"

namespace minagi {
namespace gpu {

template <typename scalar_t>
__global__ void gather_kernel(const scalar_t* __restrict__ x, const int64_t* __restrict__ row_pair,
                              const scalar_t* __restrict__ gates, int64_t E, int64_t D, int64_t k,
                              int64_t NK, scalar_t* __restrict__ out) {
  using acc_t = opmath_t<scalar_t>;
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
  using acc_t = opmath_t<scalar_t>;
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
  using acc_t = opmath_t<scalar_t>;
  acc_t* part = dynamic_smem<acc_t>();  // [blockDim]
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

}  // namespace gpu
}  // namespace minagi
