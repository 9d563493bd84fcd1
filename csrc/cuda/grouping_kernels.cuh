// Load grouping's kernels: slot_idx [N, k] -> the dispatch plan (see the schema in ops.cpp), a
// stable counting sort in chunks of kChunk pairs:
//   1. chunk_hist: per chunk, pairs per slot (shared-memory integer atomics: exact counts);
//   2. slot_scan:  per slot, the pairs of earlier chunks (so ranks stay in character order);
//   3. plan:       one block: load (capped), slots sorted by load (bucketed) or all in id order
//                  (exact), their rows, their starts;
//   4. fill:       each pair's rank = its slot's earlier-chunk count + same-slot pairs before it
//                  in its chunk; kept pairs get their buffer row.
// Launched from grouping.cu; run on the CPU by the emulator test (tests/emu/).
#pragma once

#include "kernel_prelude.cuh"

namespace minagi {
namespace gpu {

constexpr int kChunk = 256;  // pairs per chunk = threads per block of chunk_hist and fill

__global__ void chunk_hist_kernel(const int64_t* __restrict__ idx, int64_t R, int S, int64_t n_chunks,
                                  int* __restrict__ chunk_count) {
  int* hist = dynamic_smem<int>();  // [S]
  for (int s = threadIdx.x; s < S; s += blockDim.x) hist[s] = 0;
  __syncthreads();
  const int64_t i = blockIdx.x * static_cast<int64_t>(kChunk) + threadIdx.x;
  if (i < R) {
    const int64_t s = idx[i];
    if (s >= 0 && s < S) atomicAdd(hist + s, 1);  // out of range: dropped (checked by slot_range_kernel unless skipped)
  }
  __syncthreads();
  // Slot-major, so each slot's scan over chunks reads one contiguous run.
  for (int s = threadIdx.x; s < S; s += blockDim.x) chunk_count[s * n_chunks + blockIdx.x] = hist[s];
}

// Without skip_invalid every slot id must be in [0, S): a device assert, as the other kernels'.
__global__ void slot_range_kernel(const int64_t* __restrict__ idx, int64_t R, int S) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < R;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    CUDA_KERNEL_ASSERT(idx[i] >= 0 && idx[i] < S && "minagi.group_plan: slot_idx outside [0, n_slots)");
  }
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

// One block. meta = [A, E, rows of the A listed slots in plan order] (E: the listed rows; an
// exact plan's buffer has a row per pair, its dropped pairs' rows at the end).
__global__ void plan_kernel(const int64_t* __restrict__ total, int S, int64_t capacity, bool bucketed,
                            int64_t* __restrict__ load, int64_t* __restrict__ slot_order,
                            int64_t* __restrict__ start, int64_t* __restrict__ meta) {
  int64_t* load_sh = dynamic_smem<int64_t>();  // [S]
  int64_t* rows_sh = load_sh + S;              // [S], by plan position; then their starts
  for (int s = threadIdx.x; s < S; s += blockDim.x) {
    const int64_t t = total[s];
    load_sh[s] = capacity > 0 && t > capacity ? capacity : t;
    load[s] = load_sh[s];
  }
  __syncthreads();
  // Plan position of an active slot: active slots with a smaller load, or an equal load and a
  // lower slot, come first (the CPU's stable sort by load).
  // An exact plan lists every slot in id order (sizes from the input's shape only).
  for (int s = threadIdx.x; s < S; s += blockDim.x) {
    const int64_t l = load_sh[s];
    if (l == 0 && bucketed) {
      start[s] = -1;
      continue;
    }
    int64_t pos = 0;
    for (int o = 0; o < S && bucketed; ++o) {
      const int64_t lo = load_sh[o];
      pos += lo > 0 && (lo < l || (lo == l && o < s));
    }
    if (!bucketed) pos = s;
    slot_order[pos] = s;
    rows_sh[pos] = bucketed ? bucket(l) : l;
    start[s] = pos;  // for now the position; the row start below
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    int64_t A = 0;
    for (int s = 0; s < S; ++s) A += load_sh[s] > 0 || !bucketed;
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

__global__ void fill_kernel(const int64_t* __restrict__ idx, int64_t R, int S, int64_t n_chunks,
                            const int* __restrict__ chunk_offset, const int64_t* __restrict__ load,
                            const int64_t* __restrict__ start, int64_t* __restrict__ dest,
                            int64_t* __restrict__ row_pair) {
  MINAGI_SHARED_ARRAY(int64_t, slots, kChunk);
  const int64_t i = blockIdx.x * static_cast<int64_t>(kChunk) + threadIdx.x;
  slots[threadIdx.x] = i < R ? idx[i] : -1;
  __syncthreads();
  if (i >= R) return;
  const int64_t s = slots[threadIdx.x];
  if (s < 0 || s >= S) {  // a skipped id (skip_invalid): a dropped pair
    dest[i] = -1;
    return;
  }
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

}  // namespace gpu
}  // namespace minagi
