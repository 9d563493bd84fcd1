// Load grouping on the GPU: slot_idx [N, k] -> the dispatch plan (see the schema in ops.cpp),
// computed on the device by the four kernels of grouping_kernels.cuh (a stable counting sort in
// chunks of kChunk pairs).
// An exact plan (bucketed=False) lists every slot in id order and has a row per pair: its sizes
// come from the shapes, so it reads nothing on the host and its slot_rows stays on the device
// (the grouped GEMMs sum the ranges there). A bucketed plan's sizes depend on the routing: its
// one device-to-host copy brings them (active slots, buffer rows, rows per slot) to the host, and
// its slot_rows comes back on the CPU.
#include <torch/library.h>

#include "grouping_kernels.cuh"
#include "launch.cuh"

namespace minagi {
namespace {

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> group_plan_cuda(
    const at::Tensor& slot_idx_in, int64_t n_slots, int64_t capacity, bool bucketed, bool skip_invalid) {
  check_group_plan_args(slot_idx_in, n_slots, capacity, skip_invalid);
  check_gpu_slots(n_slots, "group_plan");
  const c10::cuda::CUDAGuard guard(slot_idx_in.device());
  const at::Tensor idx = slot_idx_in.contiguous();
  const int64_t N = idx.size(0), k = idx.size(1), R = N * k;
  TORCH_CHECK(R < (int64_t{1} << 31), "minagi.group_plan: ", R, " pairs exceed the GPU plan's 2^31");
  const int S = static_cast<int>(n_slots);
  const auto lopt = idx.options();
  const auto stream = at::cuda::getCurrentCUDAStream();
  const int64_t n_chunks = (R + gpu::kChunk - 1) / gpu::kChunk;

  at::Tensor chunk_count = gpu::bucketed_empty(std::max<int64_t>(1, S * n_chunks), {}, lopt.dtype(at::kInt));
  at::Tensor total = at::zeros({S}, lopt);
  if (R > 0 && !skip_invalid) {
    gpu::slot_range_kernel<<<gpu::blocks_for(R), gpu::kThreads, 0, stream>>>(idx.data_ptr<int64_t>(), R, S);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  if (R > 0) {
    gpu::chunk_hist_kernel<<<n_chunks, gpu::kChunk, S * sizeof(int), stream>>>(idx.data_ptr<int64_t>(), R, S, n_chunks,
                                                                     chunk_count.data_ptr<int>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    gpu::slot_scan_kernel<<<(S + 127) / 128, 128, 0, stream>>>(chunk_count.data_ptr<int>(), S, n_chunks,
                                                          total.data_ptr<int64_t>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  at::Tensor load = at::empty({S}, lopt);
  at::Tensor order_buf = at::empty({S}, lopt);
  at::Tensor start = at::empty({S}, lopt);
  at::Tensor meta = at::empty({2 + S}, lopt);
  gpu::plan_kernel<<<1, gpu::pow2_threads(S, gpu::kMinThreads, 1024), 2 * S * sizeof(int64_t), stream>>>(
      total.data_ptr<int64_t>(), S, capacity, bucketed, load.data_ptr<int64_t>(), order_buf.data_ptr<int64_t>(),
      start.data_ptr<int64_t>(), meta.data_ptr<int64_t>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();

  int64_t A = S, E = R;
  at::Tensor slot_rows, slot_order;
  if (bucketed) {  // the one synchronisation: the plan's data-dependent sizes
    const at::Tensor meta_host = meta.to(at::kCPU);
    A = meta_host.data_ptr<int64_t>()[0];
    E = meta_host.data_ptr<int64_t>()[1];
    slot_rows = meta_host.narrow(0, 2, A).clone();
    slot_order = gpu::plain_rows(order_buf, A);
  } else {  // every slot in id order, its kept load as its rows
    slot_rows = load.clone();
    slot_order = order_buf;
  }
  at::Tensor row_pair = gpu::bucketed_empty(E, {}, lopt).fill_(-1);
  at::Tensor dest = at::empty({N, k}, lopt);
  if (R > 0) {
    gpu::fill_kernel<<<n_chunks, gpu::kChunk, 0, stream>>>(idx.data_ptr<int64_t>(), R, S, n_chunks, chunk_count.data_ptr<int>(),
                                                 load.data_ptr<int64_t>(), start.data_ptr<int64_t>(),
                                                 dest.data_ptr<int64_t>(), row_pair.data_ptr<int64_t>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  return {load, slot_order, slot_rows, row_pair, dest};
}

}  // namespace

TORCH_LIBRARY_IMPL(minagi, CUDA, m) { m.impl("group_plan", &group_plan_cuda); }

}  // namespace minagi
