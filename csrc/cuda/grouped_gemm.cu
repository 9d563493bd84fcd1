// Grouped GEMM on the GPU, with no host read of the plan and no copy of the weights: the listed
// slots' row ranges are summed on the device (ranges.cuh), every grid is sized from the shapes,
// and the kernels (grouped_gemm_kernels.cuh) read each slot's weights in place from b[slot_ids[i]].
//   - torch._grouped_mm where torch has a native kernel for it (CUDA sm90 / sm100, bfloat16,
//     16-byte aligned operands) and every slot of b is listed (A == S, as in the exact plan, which
//     lists them in id order): its offsets are the ranges' ends, and b is passed as it is. A
//     listed slot whose id is not its position (possible in a plan of another order) is then
//     recomputed by the own kernel, which also zeroes the rows past the ranges.
//   - Up to kSmallRowsMaxE rows in all (decoding): small_rows_kernel, a few rows per slot.
//   - Otherwise grouped_gemm_kernel's 64 x 64 tiles.
// The weight gradient is wgrad_kernel's, each listed slot's sum in row order.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <torch/library.h>

#include <cstdint>

#include "grouped_gemm_kernels.cuh"
#include "launch.cuh"
#include "ranges.cuh"

namespace minagi {
namespace {

constexpr int64_t kSmallRowsMaxE = 64;  // rows of a call up to which the decode kernel runs

bool aligned16(const at::Tensor& t) { return reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0; }

// A 16-byte aligned row- or column-major matrix of bfloat16 in its last two dims (torch._grouped_mm's rule).
bool grouped_mm_layout(const at::Tensor& t) {
  const int64_t d = t.dim(), rows = t.size(d - 2), cols = t.size(d - 1), s_r = t.stride(d - 2), s_c = t.stride(d - 1);
  const bool row_major = s_c == 1 && s_r >= std::max<int64_t>(1, cols) && s_r % 8 == 0;
  const bool col_major = s_r == 1 && s_c >= std::max<int64_t>(1, rows) && s_c % 8 == 0;
  return (row_major || col_major) && aligned16(t) && (d == 2 || t.stride(0) % 8 == 0);
}

// Whether torch._grouped_mm computes this call without a copy of b: decided from the device's
// architecture, the dtype and the shapes, never from the plan's values.
bool native_grouped_mm(const at::Tensor& a, const at::Tensor& b, int64_t A) {
#if defined(USE_ROCM)
  (void)a, (void)b, (void)A;
  return false;
#else
  if (a.scalar_type() != at::kBFloat16 || A != b.size(0) || a.size(0) == 0 || a.size(1) == 0 || b.size(2) == 0) {
    return false;
  }
  if (!grouped_mm_layout(a) || !grouped_mm_layout(b) || b.size(2) % 8 != 0) return false;
  const int major = at::cuda::getDeviceProperties(a.get_device())->major;
  return major == 9 || major == 10;  // CUTLASS grouped kernels with device offsets
#endif
}

void launch_tiled(const at::Tensor& a, const at::Tensor& b, const gpu::Ranges& r, bool skip_identity,
                  at::Tensor& out) {
  const int64_t E = a.size(0), K = a.size(1), M = b.size(2), A = r.ids.size(0);
  const dim3 grid(static_cast<unsigned>((M + gpu::kTileN - 1) / gpu::kTileN),
                  static_cast<unsigned>(std::min<int64_t>(gpu::row_tile_bound(E, A), gpu::kMaxBlocks)));
  MINAGI_DISPATCH_FLOATING(a.scalar_type(), "minagi_grouped_gemm_cuda", [&] {
    gpu::grouped_gemm_kernel<scalar_t><<<grid, gpu::kTileThreads, 0, at::cuda::getCurrentCUDAStream()>>>(
        a.data_ptr<scalar_t>(), b.data_ptr<scalar_t>(), b.stride(0), b.stride(1), b.stride(2),
        r.ids.data_ptr<int64_t>(), r.row_end.data_ptr<int64_t>(), r.tile_end.data_ptr<int64_t>(), A, E, K, M,
        b.size(0), skip_identity, out.data_ptr<scalar_t>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

void launch_small_rows(const at::Tensor& a, const at::Tensor& b, const gpu::Ranges& r, at::Tensor& out) {
  const int64_t E = a.size(0), K = a.size(1), M = b.size(2), A = r.ids.size(0);
  const dim3 grid(static_cast<unsigned>((M + gpu::kTileThreads - 1) / gpu::kTileThreads),
                  static_cast<unsigned>(std::clamp<int64_t>(A, 1, gpu::kMaxBlocks)));
  MINAGI_DISPATCH_FLOATING(a.scalar_type(), "minagi_small_rows_mm_cuda", [&] {
    gpu::small_rows_kernel<scalar_t><<<grid, gpu::kTileThreads, 0, at::cuda::getCurrentCUDAStream()>>>(
        a.data_ptr<scalar_t>(), b.data_ptr<scalar_t>(), b.stride(0), b.stride(1), b.stride(2),
        r.ids.data_ptr<int64_t>(), r.row_end.data_ptr<int64_t>(), A, E, K, M, b.size(0), out.data_ptr<scalar_t>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

void check_ids(const at::Tensor& slot_ids, int64_t S, const char* op) {
  if (slot_ids.device().is_cpu()) {
    check_range_cpu(slot_ids.contiguous(), 0, S, op, "slot_ids");
  } else {
    debug_check_range(slot_ids, 0, S, op, "slot_ids");  // else the kernels' device asserts
  }
}

at::Tensor grouped_mm_cuda(const at::Tensor& a_in, const at::Tensor& b, const at::Tensor& slot_ids,
                           const at::Tensor& slot_rows) {
  const char* op = "grouped_mm";
  check_grouped_mm_args(a_in, b);
  gpu::check_cuda(a_in, op, "a");
  const c10::cuda::CUDAGuard guard(a_in.device());
  const at::Tensor a = a_in.contiguous();
  const int64_t E = a.size(0), M = b.size(2);
  const bool native = native_grouped_mm(a, b, slot_ids.dim() == 1 ? slot_ids.size(0) : -1);
  const gpu::Ranges r = gpu::device_ranges(slot_ids, slot_rows, E, a.device(), op, native);
  check_ids(slot_ids, b.size(0), op);
  if (E == 0 || M == 0) return gpu::bucketed_empty(E, {M}, a.options());
  if (native) {
    at::Tensor out = at::_grouped_mm(a, b, r.offs32);
    launch_tiled(a, b, r, /*skip_identity=*/true, out);
    return out;
  }
  at::Tensor out = gpu::bucketed_empty(E, {M}, a.options());
  if (E <= kSmallRowsMaxE) {
    launch_small_rows(a, b, r, out);
  } else {
    launch_tiled(a, b, r, /*skip_identity=*/false, out);
  }
  return out;
}

at::Tensor grouped_mm_wgrad_cuda(const at::Tensor& a_in, const at::Tensor& grad_in, const at::Tensor& slot_ids,
                                 const at::Tensor& slot_rows, int64_t n_slots) {
  const char* op = "grouped_mm_wgrad";
  check_wgrad_args(a_in, grad_in, n_slots);
  gpu::check_cuda(a_in, op, "a");
  const c10::cuda::CUDAGuard guard(a_in.device());
  const at::Tensor a = a_in.contiguous(), grad = grad_in.contiguous();
  const int64_t E = a.size(0), K = a.size(1), M = grad.size(1);
  const gpu::Ranges r = gpu::device_ranges(slot_ids, slot_rows, E, a.device(), op, false);
  const int64_t A = r.ids.size(0);
  // Unique and in range, as the CPU kernel requires: a slot listed twice would have two writers.
  // Checked on the host where the ids are (a plan's are on the device: there
  // MINAGI_DEBUG_CHECKS=1 copies them over; else the kernel's device assert checks the range).
  if (slot_ids.device().is_cpu() || debug_checks()) check_unique_slots_cpu(slot_ids.to(at::kCPU), n_slots, op);
  at::Tensor out = at::zeros({n_slots, K, M}, a.options());
  if (A == 0 || K == 0 || M == 0) return out;
  const int64_t k_tiles = (K + gpu::kTileM - 1) / gpu::kTileM;
  TORCH_CHECK(k_tiles <= gpu::kMaxBlocks, "minagi.", op, ": a has too many columns (", K, ")");
  const dim3 grid(static_cast<unsigned>((M + gpu::kTileN - 1) / gpu::kTileN), static_cast<unsigned>(k_tiles),
                  static_cast<unsigned>(std::min<int64_t>(A, gpu::kMaxBlocks)));
  MINAGI_DISPATCH_FLOATING(a.scalar_type(), "minagi_grouped_mm_wgrad_cuda", [&] {
    gpu::wgrad_kernel<scalar_t><<<grid, gpu::kTileThreads, 0, at::cuda::getCurrentCUDAStream()>>>(
        a.data_ptr<scalar_t>(), grad.data_ptr<scalar_t>(), r.ids.data_ptr<int64_t>(), r.row_end.data_ptr<int64_t>(),
        A, K, M, n_slots, out.data_ptr<scalar_t>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(minagi, CUDA, m) {
  m.impl("grouped_mm", &grouped_mm_cuda);
  m.impl("grouped_mm_wgrad", &grouped_mm_wgrad_cuda);
}

}  // namespace minagi
