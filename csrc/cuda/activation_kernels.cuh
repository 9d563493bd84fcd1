// The expert forms' kernels (csrc/activation.h holds the math): the first layer's bias and
// activation over its GEMM's output, the activation's backward, and the bias's gradient as
// per-slot column sums. Elementwise and one writer per element, so the bits are the same every
// run. A row's slot comes from the ranges' ends on the device (grouped_gemm_kernels.cuh's
// group_offsets_kernel), never from the host. Launched from activation.cu.
#pragma once

#include "../activation.h"
#include "grouped_gemm_kernels.cuh"
#include "kernel_prelude.cuh"

namespace minagi {
namespace gpu {

// h [E, M] (bias added in place, for the backward), out [E, W]: W = M / 2 for the gated forms.
// bias [S, M] (null without one): row e takes its listed slot's, slot_ids[i] for the range
// row_end [A] puts it in; rows past the listed ranges take none.
template <typename scalar_t>
__global__ void bias_act_kernel(scalar_t* __restrict__ h, const scalar_t* __restrict__ bias,
                                const int64_t* __restrict__ slot_ids, const int64_t* __restrict__ row_end, int64_t A,
                                scalar_t* __restrict__ out, int64_t E, int64_t M, int act_id,
                                opmath_t<scalar_t> alpha, opmath_t<scalar_t> limit) {
  using acc_t = opmath_t<scalar_t>;
  const Act act = static_cast<Act>(act_id);
  const bool gated = act_gated(act);
  const int64_t W = gated ? M / 2 : M;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < E * W;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t e = i / W, j = i - e * W;
    scalar_t* hr = h + e * M;
    const int64_t s = bias == nullptr ? A : find_range(row_end, A, e);
    const scalar_t* br = s < A ? bias + slot_ids[s] * M : nullptr;
    if (!gated) {
      acc_t v = static_cast<acc_t>(hr[j]);
      if (br != nullptr) {
        hr[j] = static_cast<scalar_t>(v + static_cast<acc_t>(br[j]));
        v = static_cast<acc_t>(hr[j]);
      }
      out[i] = static_cast<scalar_t>(act_plain<acc_t>(act, v));
      continue;
    }
    int64_t g, u;
    gated_cols(act, j, W, &g, &u);
    if (br != nullptr) {  // each h column belongs to one output column: one writer
      hr[g] = static_cast<scalar_t>(static_cast<acc_t>(hr[g]) + static_cast<acc_t>(br[g]));
      hr[u] = static_cast<scalar_t>(static_cast<acc_t>(hr[u]) + static_cast<acc_t>(br[u]));
    }
    out[i] = static_cast<scalar_t>(
        act_gated_fwd<acc_t>(act, static_cast<acc_t>(hr[g]), static_cast<acc_t>(hr[u]), alpha, limit));
  }
}

// grad_h [E, M] from out's gradient grad [E, W] and h.
template <typename scalar_t>
__global__ void act_backward_kernel(const scalar_t* __restrict__ grad, const scalar_t* __restrict__ h,
                                    scalar_t* __restrict__ grad_h, int64_t E, int64_t M, int act_id,
                                    opmath_t<scalar_t> alpha, opmath_t<scalar_t> limit) {
  using acc_t = opmath_t<scalar_t>;
  const Act act = static_cast<Act>(act_id);
  const bool gated = act_gated(act);
  const int64_t W = gated ? M / 2 : M;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < E * W;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t e = i / W, j = i - e * W;
    const scalar_t* hr = h + e * M;
    scalar_t* o = grad_h + e * M;
    const acc_t gr = static_cast<acc_t>(grad[i]);
    if (!gated) {
      o[j] = static_cast<scalar_t>(gr * act_plain_grad<acc_t>(act, static_cast<acc_t>(hr[j])));
      continue;
    }
    int64_t g, u;
    gated_cols(act, j, W, &g, &u);
    acc_t dg, du;
    act_gated_bwd<acc_t>(act, static_cast<acc_t>(hr[g]), static_cast<acc_t>(hr[u]), alpha, limit, gr, &dg, &du);
    o[g] = static_cast<scalar_t>(dg);
    o[u] = static_cast<scalar_t>(du);
  }
}

// grad_bias[slot_ids[i], m] = sum of grad_h[r, m] over listed slot i's rows (row_end [A] ends
// them), in row order: a fixed order, no atomics, so the bits are the same every run. Block
// (x, i) takes blockDim.x columns of listed slot i, a thread per column; grid-stride over i.
template <typename scalar_t>
__global__ void bias_grad_kernel(const scalar_t* __restrict__ grad_h, const int64_t* __restrict__ slot_ids,
                                 const int64_t* __restrict__ row_end, int64_t A, int64_t M, int64_t S,
                                 scalar_t* __restrict__ grad_bias) {
  using acc_t = opmath_t<scalar_t>;
  const int64_t m = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (m >= M) return;
  for (int64_t i = blockIdx.y; i < A; i += gridDim.y) {
    const int64_t slot = slot_ids[i];
    CUDA_KERNEL_ASSERT(slot >= 0 && slot < S && "minagi.expert_act_backward: slot_ids outside [0, n_slots)");
    acc_t acc = 0;
    for (int64_t r = i > 0 ? row_end[i - 1] : 0; r < row_end[i]; ++r) acc += static_cast<acc_t>(grad_h[r * M + m]);
    grad_bias[slot * M + m] = static_cast<scalar_t>(acc);
  }
}

}  // namespace gpu
}  // namespace minagi
