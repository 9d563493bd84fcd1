// Load grouping on the GPU: slot_idx [N, k] -> the dispatch plan (see the schema in ops.cpp),
// computed on the device as a stable counting sort in chunks of kChunk pairs:
//   1. chunk_hist: per chunk, pairs per slot (shared-memory integer atomics: exact counts);
//   2. slot_scan:  per slot, the pairs of earlier chunks (so ranks stay in character order);
//   3. plan:       one block: load (capped), slots sorted by load, their rows, their starts;
//   4. fill:       each pair's rank = its slot's earlier-chunk count + same-slot pairs before it
//                  in its chunk; kept pairs get their buffer row.
// The one device-to-host copy brings the plan's sizes (active slots, buffer rows, rows per
// slot) to the host, where the grouped GEMM needs them to size its batched matmuls; so
// slot_rows comes back on the CPU. Nothing else synchronises.
#include <torch/library.h>

#include "launch.cuh"

namespace minagi {
namespace {

constexpr int kChunk = 256;  // pairs per chunk = threads per block of chunk_hist and fill

__global__ void chunk_hist_kernel(const int64_t* __restrict__ idx, int64_t R, int S, int64_t n_chunks,
                                  int* __restrict__ chunk_count) {
  extern __shared__ int hist[];  // [S]
  for (int s = threadIdx.x; s < S; s += blockDim.x) hist[s] = 0;
  __syncthreads();
  const int64_t i = blockIdx.x * static_cast<int64_t>(kChunk) + threadIdx.x;
  if (i < R) {
    const int64_t s = idx[i];
    CUDA_KERNEL_ASSERT(s >= 0 && s < S && "minagi.group_plan: slot_idx outside [0, n_slots)");
    atomicAdd(hist + s, 1);
  }
  __syncthreads();
  // Slot-major, so each slot's scan over chunks reads one contiguous run.
  for (int s = threadIdx.x; s < S; s += blockDim.x) chunk_count[s * n_chunks + blockIdx.x] = hist[s];
}

__global__ void slot_scan_kernel(int* __restrict__ chunk_count, int S, int64_t n_chunks, int64_t* __restrict__ total) {
  const int s = blockIdx.x * blockDim.x + threadIdx.x;
  if (s >= S) return;
  int* c = chunk_count + s * n_chunks;
  int64_t run = 0;
  for (int64_t b = 0; b < n_chunks; ++b) {
    const int v = c[b];
    c[b] = static_cast<int>(run);
    run += v;
  }
  total[s] = run;
}

// One block. meta = [A, E, rows of the A active slots in plan order].
__global__ void plan_kernel(const int64_t* __restrict__ total, int S, int64_t capacity, bool bucketed,
                            int64_t* __restrict__ load, int64_t* __restrict__ slot_order,
                            int64_t* __restrict__ start, int64_t* __restrict__ meta) {
  extern __shared__ int64_t sh[];
  int64_t* load_sh = sh;      // [S]
  int64_t* rows_sh = sh + S;  // [S], by plan position; then their starts
  for (int s = threadIdx.x; s < S; s += blockDim.x) {
    const int64_t t = total[s];
    load_sh[s] = capacity > 0 && t > capacity ? capacity : t;
    load[s] = load_sh[s];
  }
  __syncthreads();
  // Plan position of an active slot: active slots with a smaller load, or an equal load and a
  // lower slot, come first (the CPU's stable sort by load).
  for (int s = threadIdx.x; s < S; s += blockDim.x) {
    const int64_t l = load_sh[s];
    if (l == 0) {
      start[s] = -1;
      continue;
    }
    int64_t pos = 0;
    for (int o = 0; o < S; ++o) {
      const int64_t lo = load_sh[o];
      pos += lo > 0 && (lo < l || (lo == l && o < s));
    }
    slot_order[pos] = s;
    rows_sh[pos] = bucketed ? bucket(l) : l;
    start[s] = pos;  // for now the position; the row start below
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    int64_t A = 0;
    for (int s = 0; s < S; ++s) A += load_sh[s] > 0;
    int64_t E = 0;
    for (int64_t a = 0; a < A; ++a) {
      meta[2 + a] = rows_sh[a];
      const int64_t r = rows_sh[a];
      rows_sh[a] = E;
      E += r;
    }
    meta[0] = A;
    meta[1] = E;
  }
  __syncthreads();
  for (int s = threadIdx.x; s < S; s += blockDim.x) {
    if (load_sh[s] > 0) start[s] = rows_sh[start[s]];
  }
}

__global__ void fill_kernel(const int64_t* __restrict__ idx, int64_t R, int64_t n_chunks,
                            const int* __restrict__ chunk_offset, const int64_t* __restrict__ load,
                            const int64_t* __restrict__ start, int64_t* __restrict__ dest,
                            int64_t* __restrict__ row_pair) {
  __shared__ int64_t slots[kChunk];
  const int64_t i = blockIdx.x * static_cast<int64_t>(kChunk) + threadIdx.x;
  slots[threadIdx.x] = i < R ? idx[i] : -1;
  __syncthreads();
  if (i >= R) return;
  const int64_t s = slots[threadIdx.x];
  int64_t rank = chunk_offset[s * n_chunks + blockIdx.x];
  for (int t = 0; t < static_cast<int>(threadIdx.x); ++t) rank += slots[t] == s;
  if (rank < load[s]) {
    const int64_t d = start[s] + rank;
    dest[i] = d;
    row_pair[d] = i;
  } else {
    dest[i] = -1;
  }
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> group_plan_cuda(
    const at::Tensor& slot_idx_in, int64_t n_slots, int64_t capacity, bool bucketed) {
  check_group_plan_args(slot_idx_in, n_slots, capacity);
  check_gpu_slots(n_slots, "group_plan");
  const c10::cuda::CUDAGuard guard(slot_idx_in.device());
  const at::Tensor idx = slot_idx_in.contiguous();
  const int64_t N = idx.size(0), k = idx.size(1), R = N * k;
  TORCH_CHECK(R < (int64_t{1} << 31), "minagi.group_plan: ", R, " pairs exceed the GPU plan's 2^31");
  const int S = static_cast<int>(n_slots);
  const auto lopt = idx.options();
  const auto stream = at::cuda::getCurrentCUDAStream();
  const int64_t n_chunks = (R + kChunk - 1) / kChunk;

  at::Tensor chunk_count = gpu::bucketed_empty(std::max<int64_t>(1, S * n_chunks), {}, lopt.dtype(at::kInt));
  at::Tensor total = at::zeros({S}, lopt);
  if (R > 0) {
    chunk_hist_kernel<<<n_chunks, kChunk, S * sizeof(int), stream>>>(idx.data_ptr<int64_t>(), R, S, n_chunks,
                                                                     chunk_count.data_ptr<int>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    slot_scan_kernel<<<(S + 127) / 128, 128, 0, stream>>>(chunk_count.data_ptr<int>(), S, n_chunks,
                                                          total.data_ptr<int64_t>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  at::Tensor load = at::empty({S}, lopt);
  at::Tensor order_buf = at::empty({S}, lopt);
  at::Tensor start = at::empty({S}, lopt);
  at::Tensor meta = at::empty({2 + S}, lopt);
  plan_kernel<<<1, gpu::pow2_threads(S, gpu::kMinThreads, 1024), 2 * S * sizeof(int64_t), stream>>>(
      total.data_ptr<int64_t>(), S, capacity, bucketed, load.data_ptr<int64_t>(), order_buf.data_ptr<int64_t>(),
      start.data_ptr<int64_t>(), meta.data_ptr<int64_t>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();

  // The one synchronisation: the plan's sizes, for the host that sizes the batched matmuls.
  const at::Tensor meta_host = meta.to(at::kCPU);
  const int64_t A = meta_host.data_ptr<int64_t>()[0], E = meta_host.data_ptr<int64_t>()[1];
  at::Tensor slot_rows = meta_host.narrow(0, 2, A).clone();
  at::Tensor slot_order = gpu::plain_rows(order_buf, A);
  at::Tensor row_pair = gpu::bucketed_empty(E, {}, lopt).fill_(-1);
  at::Tensor dest = at::empty({N, k}, lopt);
  if (R > 0) {
    fill_kernel<<<n_chunks, kChunk, 0, stream>>>(idx.data_ptr<int64_t>(), R, n_chunks, chunk_count.data_ptr<int>(),
                                                 load.data_ptr<int64_t>(), start.data_ptr<int64_t>(),
                                                 dest.data_ptr<int64_t>(), row_pair.data_ptr<int64_t>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  return {load, slot_order, slot_rows, row_pair, dest};
}

}  // namespace

TORCH_LIBRARY_IMPL(minagi, CUDA, m) { m.impl("group_plan", &group_plan_cuda); }

}  // namespace minagi
