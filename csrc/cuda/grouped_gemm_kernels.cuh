// The grouped GEMM's kernels. Every listed slot's rows of `a` are contiguous, in slot_ids order
// (slot_rows [A] of them each); rows past the listed ranges (an exact plan's dropped pairs) own no
// slot and come out zero. Nothing here is sized from the data: the launcher sizes every grid from
// the shapes (E rows, A listed slots), and each block finds its slot from the device offsets that
// group_offsets_kernel writes, exiting where the ranges end. Weights are read in place from
// b[slot_ids[i]], in either layout (b [S, K, M] contiguous, or the .mT view of [S, M, K]): the
// loads follow b's unit stride, so a warp reads consecutive addresses in both.
//   group_offsets_kernel: slot_rows -> the ranges' ends (and torch._grouped_mm's int32 offsets);
//   grouped_gemm_kernel:  64 x 64 output tiles, a tile's rows within one slot;
//   small_rows_kernel:    decoding's few rows per slot, a block per 256 columns of a slot;
//   wgrad_kernel:         each listed slot's a^T @ grad over its rows, in row order.
// Launched from grouped_gemm.cu; run on the CPU by the emulator test (tests/emu/).
#pragma once

#include "kernel_prelude.cuh"

namespace minagi {
namespace gpu {

constexpr int kOffsetThreads = 256;
constexpr int kTileM = 64, kTileN = 64, kTileK = 16;  // 256 threads, 4 x 4 outputs each
constexpr int kTileThreads = 256;
constexpr int64_t kPassRows = 4;      // rows the decode kernel keeps in registers per pass
constexpr int kPassBytes = 128;      // bytes of one column's k staged per pass: a cache line

// The row tiles the tiled kernels may need: each slot's rows round up to whole tiles, so at most
// one partial tile per listed slot beyond ceil(E / kTileM) (and the same bound covers the tail
// past the listed rows). From the shapes only.
MINAGI_HOST_DEVICE inline int64_t row_tile_bound(int64_t E, int64_t A) { return (E + kTileM - 1) / kTileM + A; }

// The first listed slot whose range ends past `t` in ends [A] (non-decreasing), or A.
MINAGI_HOST_DEVICE inline int64_t find_range(const int64_t* __restrict__ ends, int64_t A, int64_t t) {
  int64_t lo = 0, hi = A;
  while (lo < hi) {
    const int64_t mid = (lo + hi) / 2;
    if (ends[mid] > t) {
      hi = mid;
    } else {
      lo = mid + 1;
    }
  }
  return lo;
}

// One block of Threads (kOffsetThreads; a template, so a translation unit that includes this
// header without launching it emits no copy). row_end[i] = rows of listed slots 0..i; tile_end[i]
// = their kTileM-row tiles; offs32 (optional) = row_end as int32, torch._grouped_mm's offsets.
// Each thread sums a contiguous chunk, then the chunks' totals are scanned in shared memory.
template <int Threads>
__global__ void group_offsets_kernel(const int64_t* __restrict__ slot_rows, int64_t A, int64_t E,
                                     int64_t* __restrict__ row_end, int64_t* __restrict__ tile_end,
                                     int* __restrict__ offs32) {
  MINAGI_SHARED_ARRAY(int64_t, rows_sh, Threads);
  MINAGI_SHARED_ARRAY(int64_t, tiles_sh, Threads);
  const int64_t chunk = (A + Threads - 1) / Threads;
  const int64_t lo = threadIdx.x * chunk, hi = lo + chunk < A ? lo + chunk : A;
  int64_t rows = 0, tiles = 0;
  for (int64_t i = lo; i < hi; ++i) {
    const int64_t r = slot_rows[i];
    CUDA_KERNEL_ASSERT(r >= 0 && "minagi.grouped_mm: slot_rows holds a negative row count");
    rows += r;
    tiles += (r + kTileM - 1) / kTileM;
  }
  rows_sh[threadIdx.x] = rows;
  tiles_sh[threadIdx.x] = tiles;
  __syncthreads();
  int64_t row0 = 0, tile0 = 0;
  for (unsigned t = 0; t < threadIdx.x; ++t) {
    row0 += rows_sh[t];
    tile0 += tiles_sh[t];
  }
  for (int64_t i = lo; i < hi; ++i) {
    row0 += slot_rows[i];
    tile0 += (slot_rows[i] + kTileM - 1) / kTileM;
    row_end[i] = row0;
    tile_end[i] = tile0;
    if (offs32 != nullptr) offs32[i] = static_cast<int>(row0);
  }
  if (hi == A && lo < hi) CUDA_KERNEL_ASSERT(row0 <= E && "minagi.grouped_mm: slot_rows sums past a's rows");
}

// acc[i][j] += sum over k < kTileK of a_sh[k][ty + 16 i] * b_sh[k][tx + 16 j]: a thread's 4 x 4
// outputs of a 64 x 64 tile, both operands staged k-major in shared memory (pitch one past the
// tile's width, against bank conflicts).
template <typename acc_t>
__device__ inline void tile_fma(acc_t (&acc)[4][4], const acc_t* a_sh, const acc_t* b_sh, int ty, int tx) {
  for (int k = 0; k < kTileK; ++k) {
    acc_t av[4], bv[4];
    for (int i = 0; i < 4; ++i) av[i] = a_sh[k * (kTileM + 1) + ty + 16 * i];
    for (int j = 0; j < 4; ++j) bv[j] = b_sh[k * (kTileN + 1) + tx + 16 * j];
    for (int i = 0; i < 4; ++i)
      for (int j = 0; j < 4; ++j) acc[i][j] += av[i] * bv[j];
  }
}

// Loads a kTileK x cols tile of one slot's weights w (strides s1 along k, s2 along columns) into
// sh[k * pitch + n], zeros past K and M. The threads walk b's unit-stride dimension fastest.
template <typename scalar_t, typename sh_t>
__device__ inline void load_w_tile(const scalar_t* __restrict__ w, int64_t s1, int64_t s2, int64_t k0, int64_t n0,
                                   int64_t K, int64_t M, int tk, int cols, int pitch, sh_t* sh) {
  const bool k_fast = s1 == 1 && s2 != 1;
  for (int idx = threadIdx.x; idx < tk * cols; idx += blockDim.x) {
    const int k = k_fast ? idx % tk : idx / cols, n = k_fast ? idx / tk : idx % cols;
    const bool in = k0 + k < K && n0 + n < M;
    sh[k * pitch + n] = in ? static_cast<sh_t>(w[(k0 + k) * s1 + (n0 + n) * s2]) : static_cast<sh_t>(0.0f);
  }
}

// One 64 x 64 output tile: rows [r0, r_hi) of a [., K] (contiguous) times w's columns
// [n0, n0 + 64), each thread 4 x 4 outputs (rows ty + 16 i, columns tx + 16 j), in opmath.
template <typename scalar_t>
__device__ inline void gemm_tile(const scalar_t* __restrict__ a, const scalar_t* __restrict__ w, int64_t s1,
                                 int64_t s2, int64_t r0, int64_t r_hi, int64_t n0, int64_t K, int64_t M,
                                 opmath_t<scalar_t>* a_sh, opmath_t<scalar_t>* w_sh, scalar_t* __restrict__ out) {
  using acc_t = opmath_t<scalar_t>;
  const int tx = threadIdx.x % 16, ty = threadIdx.x / 16;
  acc_t acc[4][4] = {};
  for (int64_t k0 = 0; k0 < K; k0 += kTileK) {
    __syncthreads();  // the previous step's readers are done with the tiles
    for (int idx = threadIdx.x; idx < kTileM * kTileK; idx += blockDim.x) {
      const int k = idx % kTileK, m = idx / kTileK;  // consecutive threads: consecutive k of one row
      const bool in = r0 + m < r_hi && k0 + k < K;
      a_sh[k * (kTileM + 1) + m] = in ? static_cast<acc_t>(a[(r0 + m) * K + k0 + k]) : acc_t(0);
    }
    load_w_tile(w, s1, s2, k0, n0, K, M, kTileK, kTileN, kTileN + 1, w_sh);
    __syncthreads();
    tile_fma(acc, a_sh, w_sh, ty, tx);
  }
  for (int i = 0; i < 4; ++i) {
    const int64_t r = r0 + ty + 16 * i;
    if (r >= r_hi) continue;
    for (int j = 0; j < 4; ++j) {
      const int64_t n = n0 + tx + 16 * j;
      if (n < M) out[r * M + n] = static_cast<scalar_t>(acc[i][j]);
    }
  }
}

// out [E, M]: listed slot i's rows times b[slot_ids[i]]; zero rows past the listed ranges.
// Grid (ceil(M / kTileN), up to row_tile_bound(E, A)), kTileThreads threads; row tile t belongs to
// the slot whose tile range holds it, and the tiles past the last slot's zero the tail.
// skip_identity: listed slots with slot_ids[i] == i are left alone (torch._grouped_mm wrote them).
template <typename scalar_t>
__global__ void grouped_gemm_kernel(const scalar_t* __restrict__ a, const scalar_t* __restrict__ b, int64_t b_s0,
                                    int64_t b_s1, int64_t b_s2, const int64_t* __restrict__ slot_ids,
                                    const int64_t* __restrict__ row_end, const int64_t* __restrict__ tile_end,
                                    int64_t A, int64_t E, int64_t K, int64_t M, int64_t S, bool skip_identity,
                                    scalar_t* __restrict__ out) {
  using acc_t = opmath_t<scalar_t>;
  MINAGI_SHARED_ARRAY(acc_t, a_sh, kTileK * (kTileM + 1));
  MINAGI_SHARED_ARRAY(acc_t, w_sh, kTileK * (kTileN + 1));
  const int64_t n0 = blockIdx.x * static_cast<int64_t>(kTileN);
  const int64_t listed = A > 0 ? row_end[A - 1] : 0, tiles = A > 0 ? tile_end[A - 1] : 0;
  for (int64_t t = blockIdx.y; t < row_tile_bound(E, A); t += gridDim.y) {
    if (t >= tiles) {  // the tail: rows past the listed ranges own no slot
      const int64_t r0 = listed + (t - tiles) * kTileM;
      if (r0 >= E) break;
      for (int idx = threadIdx.x; idx < kTileM * kTileN; idx += blockDim.x) {
        const int64_t r = r0 + idx / kTileN, n = n0 + idx % kTileN;
        if (r < E && n < M) out[r * M + n] = static_cast<scalar_t>(0.0f);
      }
      continue;
    }
    const int64_t s = find_range(tile_end, A, t);
    const int64_t slot = slot_ids[s];
    CUDA_KERNEL_ASSERT(slot >= 0 && slot < S && "minagi.grouped_mm: slot_ids outside [0, n_slots)");
    if (skip_identity && slot == s) continue;
    const int64_t first_row = s > 0 ? row_end[s - 1] : 0, first_tile = s > 0 ? tile_end[s - 1] : 0;
    const int64_t r0 = first_row + (t - first_tile) * kTileM;
    gemm_tile(a, b + slot * b_s0, b_s1, b_s2, r0, row_end[s], n0, K, M, a_sh, w_sh, out);
  }
}

// Decoding: a handful of rows per listed slot. Block (x, i) computes kTileThreads columns of slot
// i's rows, kPassRows rows per pass; the slot's weights are staged through shared memory a
// cache line of k per column at a time, loaded along b's unit stride (coalesced for .mT weights as
// for contiguous ones), and each thread then reads its column from there. opmath accumulation
// (fp32 for bf16 / fp16). Block (x, 0) also zeroes the rows past the listed ranges.
template <typename scalar_t>
__global__ void small_rows_kernel(const scalar_t* __restrict__ a, const scalar_t* __restrict__ b, int64_t b_s0,
                                  int64_t b_s1, int64_t b_s2, const int64_t* __restrict__ slot_ids,
                                  const int64_t* __restrict__ row_end, int64_t A, int64_t E, int64_t K, int64_t M,
                                  int64_t S, scalar_t* __restrict__ out) {
  using acc_t = opmath_t<scalar_t>;
  constexpr int TK = kPassBytes / static_cast<int>(sizeof(scalar_t));
  constexpr int pitch = kTileThreads + 1;
  MINAGI_SHARED_ARRAY(scalar_t, w_sh, TK * pitch);
  MINAGI_SHARED_ARRAY(acc_t, x_sh, kPassRows * TK);
  const int64_t n0 = blockIdx.x * static_cast<int64_t>(kTileThreads), m = n0 + threadIdx.x;
  for (int64_t i = blockIdx.y; i < A; i += gridDim.y) {
    const int64_t r_lo = i > 0 ? row_end[i - 1] : 0, r_hi = row_end[i];
    if (r_hi <= r_lo) continue;
    const int64_t slot = slot_ids[i];
    CUDA_KERNEL_ASSERT(slot >= 0 && slot < S && "minagi.grouped_mm: slot_ids outside [0, n_slots)");
    const scalar_t* w = b + slot * b_s0;
    for (int64_t r0 = r_lo; r0 < r_hi; r0 += kPassRows) {
      const int64_t nr = r_hi - r0 < kPassRows ? r_hi - r0 : kPassRows;
      acc_t y[kPassRows] = {};
      for (int64_t k0 = 0; k0 < K; k0 += TK) {
        const int tk = K - k0 < TK ? static_cast<int>(K - k0) : TK;
        __syncthreads();  // the previous pass's readers are done with the tiles
        load_w_tile(w, b_s1, b_s2, k0, n0, K, M, tk, kTileThreads, pitch, w_sh);
        for (int idx = threadIdx.x; idx < kPassRows * TK; idx += blockDim.x) {
          const int r = idx / TK, k = idx % TK;
          x_sh[idx] = r < nr && k < tk ? static_cast<acc_t>(a[(r0 + r) * K + k0 + k]) : acc_t(0);
        }
        __syncthreads();
        if (m >= M) continue;
        for (int k = 0; k < tk; ++k) {
          const acc_t wk = static_cast<acc_t>(w_sh[k * pitch + threadIdx.x]);
#pragma unroll
          for (int r = 0; r < kPassRows; ++r) y[r] += x_sh[r * TK + k] * wk;
        }
      }
      if (m < M)
        for (int64_t r = 0; r < nr; ++r) out[(r0 + r) * M + m] = static_cast<scalar_t>(y[r]);
    }
  }
  if (blockIdx.y == 0 && m < M) {
    for (int64_t r = A > 0 ? row_end[A - 1] : 0; r < E; ++r) out[r * M + m] = static_cast<scalar_t>(0.0f);
  }
}

// out[slot_ids[i]] [K, M] = a[rows of i]^T @ grad[rows of i], summed in row order (bit-stable).
// Grid (ceil(M / kTileN), ceil(K / kTileM), up to A), kTileThreads threads; a and grad
// contiguous. Slots not listed are left as they are (the launcher zeroes out); a listed slot with
// no rows gets zeros. Each slot must be listed once (one writer per output).
template <typename scalar_t>
__global__ void wgrad_kernel(const scalar_t* __restrict__ a, const scalar_t* __restrict__ grad,
                             const int64_t* __restrict__ slot_ids, const int64_t* __restrict__ row_end, int64_t A,
                             int64_t K, int64_t M, int64_t S, scalar_t* __restrict__ out) {
  using acc_t = opmath_t<scalar_t>;
  MINAGI_SHARED_ARRAY(acc_t, a_sh, kTileK * (kTileM + 1));  // [row][k of the tile]
  MINAGI_SHARED_ARRAY(acc_t, g_sh, kTileK * (kTileN + 1));  // [row][column of the tile]
  const int tx = threadIdx.x % 16, ty = threadIdx.x / 16;
  const int64_t n0 = blockIdx.x * static_cast<int64_t>(kTileN), k0 = blockIdx.y * static_cast<int64_t>(kTileM);
  for (int64_t i = blockIdx.z; i < A; i += gridDim.z) {
    const int64_t slot = slot_ids[i];
    CUDA_KERNEL_ASSERT(slot >= 0 && slot < S && "minagi.grouped_mm_wgrad: slot_ids outside [0, n_slots)");
    const int64_t r_hi = row_end[i];
    acc_t acc[4][4] = {};
    for (int64_t r0 = i > 0 ? row_end[i - 1] : 0; r0 < r_hi; r0 += kTileK) {
      __syncthreads();
      for (int idx = threadIdx.x; idx < kTileK * kTileM; idx += blockDim.x) {
        const int r = idx / kTileM, k = idx % kTileM;  // consecutive threads: consecutive k of one row
        const bool in = r0 + r < r_hi && k0 + k < K;
        a_sh[r * (kTileM + 1) + k] = in ? static_cast<acc_t>(a[(r0 + r) * K + k0 + k]) : acc_t(0);
      }
      for (int idx = threadIdx.x; idx < kTileK * kTileN; idx += blockDim.x) {
        const int r = idx / kTileN, n = idx % kTileN;
        const bool in = r0 + r < r_hi && n0 + n < M;
        g_sh[r * (kTileN + 1) + n] = in ? static_cast<acc_t>(grad[(r0 + r) * M + n0 + n]) : acc_t(0);
      }
      __syncthreads();
      tile_fma(acc, a_sh, g_sh, ty, tx);
    }
    scalar_t* o = out + slot * K * M;
    for (int p = 0; p < 4; ++p) {
      const int64_t k = k0 + ty + 16 * p;
      if (k >= K) continue;
      for (int q = 0; q < 4; ++q) {
        const int64_t n = n0 + tx + 16 * q;
        if (n < M) o[k * M + n] = static_cast<scalar_t>(acc[p][q]);
      }
    }
  }
}

}  // namespace gpu
}  // namespace minagi
