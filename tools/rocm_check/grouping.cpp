// grouping.cu's launches without torch, for tools/rocm_build_check.sh (clang -x hip): the four
// kernels of grouping_kernels.cuh with the launcher's geometry.
#define MINAGI_NO_TORCH 1  // the kernels' plain prelude: no torch headers here

#include <hip/hip_runtime.h>

#include "../../csrc/cuda/grouping_kernels.cuh"
#include "../../csrc/cuda/launch_geometry.h"

namespace minagi {
namespace gpu {

void group_plan(const int64_t* idx, int64_t R, int S, int64_t capacity, bool bucketed, int* chunk_count,
                int64_t* total, int64_t* load, int64_t* order, int64_t* start, int64_t* meta, int64_t* dest,
                int64_t* row_pair, hipStream_t stream) {
  const int64_t n_chunks = (R + kChunk - 1) / kChunk;
  slot_range_kernel<<<blocks_for(R), kThreads, 0, stream>>>(idx, R, S);
  chunk_hist_kernel<<<n_chunks, kChunk, S * sizeof(int), stream>>>(idx, R, S, n_chunks, chunk_count);
  slot_scan_kernel<<<(S + 127) / 128, 128, 0, stream>>>(chunk_count, S, n_chunks, total);
  plan_kernel<<<1, pow2_threads(S, kMinThreads, 1024), 2 * S * sizeof(int64_t), stream>>>(
      total, S, capacity, bucketed, load, order, start, meta);
  fill_kernel<<<n_chunks, kChunk, 0, stream>>>(idx, R, S, n_chunks, chunk_count, load, start, dest, row_pair);
}

}  // namespace gpu
}  // namespace minagi
