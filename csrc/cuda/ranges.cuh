// The listed slots' row ranges on the device, for the grouped GEMMs and the expert forms'
// kernels: slot_ids and slot_rows moved to the GPU (a no-op for an exact plan's, which live
// there), and their running sums from group_offsets_kernel. Nothing is read on the host.
#pragma once

#include "grouped_gemm_kernels.cuh"
#include "launch.cuh"

namespace minagi {
namespace gpu {

struct Ranges {
  at::Tensor ids;       // slot_ids [A], int64, contiguous, on the device
  at::Tensor row_end;   // [A]: rows of listed slots 0..i
  at::Tensor tile_end;  // [A]: their kTileM-row tiles
  at::Tensor offs32;    // [A] int32 row_end, torch._grouped_mm's offsets (undefined unless asked)
};

// slot_rows' values (>= 0, summing to at most E) are checked by device asserts in the kernel.
inline Ranges device_ranges(const at::Tensor& slot_ids, const at::Tensor& slot_rows, int64_t E,
                            const at::Device& device, const char* op, bool with_offs32) {
  check_ranges_args(slot_ids, slot_rows, op);
  const int64_t A = slot_ids.size(0);
  const auto lopt = at::TensorOptions().dtype(at::kLong).device(device);
  Ranges r{slot_ids.to(device).contiguous(), at::empty({A}, lopt), at::empty({A}, lopt), at::Tensor()};
  if (with_offs32) r.offs32 = at::empty({A}, lopt.dtype(at::kInt));
  if (A == 0) return r;
  const at::Tensor rows = slot_rows.to(device).contiguous();
  group_offsets_kernel<kOffsetThreads><<<1, kOffsetThreads, 0, at::cuda::getCurrentCUDAStream()>>>(
      rows.data_ptr<int64_t>(), A, E, r.row_end.data_ptr<int64_t>(), r.tile_end.data_ptr<int64_t>(),
      with_offs32 ? r.offs32.data_ptr<int>() : nullptr);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return r;
}

}  // namespace gpu
}  // namespace minagi
