// Shared host pieces of the GPU launchers (*.cu; CUDA dialect, torch hipifies them for ROCm).
// The kernels themselves are in *_kernels.cuh. No kernel assumes a warp size: every reduction
// goes through shared memory with __syncthreads, so the same code is right on wave32 (RDNA,
// NVIDIA) and wave64 (CDNA).
#pragma once

#include <ATen/cuda/CUDAContext.h>
#include <ATen/core/LegacyTypeDispatch.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/macros/Macros.h>

#include <algorithm>
#include <cstdint>

#include "../common.h"
#include "launch_geometry.h"

namespace minagi {
namespace gpu {

// A [rows, cols] output whose allocation is rounded up to _bucket(rows) rows: over a run of
// varying routings the caching allocator sees a few dozen block sizes, not one per step, so
// memory_reserved() stops growing once they are cached. The tensor itself is [rows, cols].
// Narrowed below the view-tracking layer, so the result is a plain tensor (as on the CPU), not an
// autograd view that an in-place op under grad would trip on.
inline at::Tensor bucketed_empty(int64_t rows, at::IntArrayRef inner, const at::TensorOptions& options) {
  std::vector<int64_t> sizes{bucket(rows)};
  sizes.insert(sizes.end(), inner.begin(), inner.end());
  at::AutoDispatchBelowADInplaceOrView below;
  return at::empty(sizes, options).narrow(0, 0, rows);
}

// The first n rows of t, as a plain tensor (see bucketed_empty).
inline at::Tensor plain_rows(const at::Tensor& t, int64_t n) {
  at::AutoDispatchBelowADInplaceOrView below;
  return t.narrow(0, 0, n);
}

inline void check_cuda(const at::Tensor& t, const char* op, const char* name) {
  TORCH_CHECK(t.is_cuda(), "minagi.", op, ": ", name, " must be on the GPU with the other inputs, got ",
              t.device());
}

}  // namespace gpu
}  // namespace minagi
