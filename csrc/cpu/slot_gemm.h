// One slot's GEMM on the CPU, and grouped_mm_into, which runs a plan's row ranges through it:
// the few-row kernels (decode: a handful of rows per slot, the weights streamed once), the own
// AVX-512 kernels (f32_gemm.h, bf16_gemm.h), half-precision products widened to float32 and
// ATen's mm. Templates, in this header so that the
// kernel files (grouped_gemm.cpp, grouped_gemm_act.cpp, grouped_gemm_backward.cpp, decode.cpp)
// each inline them into their loops, as the one file did before the split. Below them, the
// family's few functions that more than one of those files calls.
#pragma once

#include <ATen/ATen.h>
#include <ATen/ops/mm_cpu_dispatch.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "../common.h"
#include "../sizes.h"  // kSmallRows
#include "bf16_gemm.h"
#include "rows.h"
#include "scheduling.h"
#include "small_rows.h"

namespace minagi {
namespace {

// A range of at most kSmallRows rows times one slot's row-major weights, streaming the weights
// once. Writing one character puts one row in each of its top_k slots, and there a BLAS call
// (which packs or re-reads b) reached about half the memory bandwidth of a plain pass over b;
// the weights' bytes are the whole cost of such a product.
constexpr int64_t kSmallCols = 1024;  // the accumulators stay in L1

template <typename scalar_t>
MINAGI_SIMD_CLONES void small_rows_mm(const scalar_t* __restrict a, int64_t lda, const scalar_t* __restrict b,
                                      int64_t ldb, scalar_t* __restrict out, int64_t ldo, int64_t nr, int64_t K,
                                      int64_t M) {
  using acc_t = at::opmath_type<scalar_t>;
  alignas(64) acc_t y[kSmallRows][kSmallCols];
  for (int64_t c0 = 0; c0 < M; c0 += kSmallCols) {
    const int64_t nc = std::min(kSmallCols, M - c0);
    for (int64_t r = 0; r < nr; ++r) std::fill(y[r], y[r] + nc, acc_t(0));
    int64_t i = 0;
    for (; i + 8 <= K; i += 8) {  // eight rows of b per pass over the accumulators
      const scalar_t* w = b + i * ldb + c0;
      for (int64_t r = 0; r < nr; ++r) {
        const scalar_t* x = a + r * lda + i;
        const acc_t x0 = x[0], x1 = x[1], x2 = x[2], x3 = x[3], x4 = x[4], x5 = x[5], x6 = x[6], x7 = x[7];
        acc_t* __restrict yr = y[r];
#pragma omp simd
        for (int64_t c = 0; c < nc; ++c) {
          yr[c] += x0 * static_cast<acc_t>(w[c]) + x1 * static_cast<acc_t>(w[ldb + c]) +
                   x2 * static_cast<acc_t>(w[2 * ldb + c]) + x3 * static_cast<acc_t>(w[3 * ldb + c]) +
                   x4 * static_cast<acc_t>(w[4 * ldb + c]) + x5 * static_cast<acc_t>(w[5 * ldb + c]) +
                   x6 * static_cast<acc_t>(w[6 * ldb + c]) + x7 * static_cast<acc_t>(w[7 * ldb + c]);
        }
      }
    }
    for (; i < K; ++i) {
      const scalar_t* w = b + i * ldb + c0;
      for (int64_t r = 0; r < nr; ++r) {
        const acc_t xi = a[r * lda + i];
        acc_t* yr = y[r];
        for (int64_t c = 0; c < nc; ++c) yr[c] += xi * static_cast<acc_t>(w[c]);
      }
    }
    for (int64_t r = 0; r < nr; ++r) {
      scalar_t* o = out + r * ldo + c0;
      for (int64_t c = 0; c < nc; ++c) o[c] = static_cast<scalar_t>(y[r][c]);
    }
  }
}

// small_rows_mm for a slot's weights stored column-major ([K, M] with unit stride along K: the
// .mT view of an nn.Linear-style [M, K] weight): each output column is one contiguous dot per
// row, so the weights are still read once, in place.
template <typename scalar_t>
MINAGI_SIMD_CLONES void small_rows_mm_cols(const scalar_t* __restrict a, int64_t lda, const scalar_t* __restrict b,
                                           int64_t ldc, scalar_t* __restrict out, int64_t ldo, int64_t nr, int64_t K,
                                           int64_t M) {
  using acc_t = at::opmath_type<scalar_t>;
  for (int64_t m = 0; m < M; ++m) {
    const scalar_t* w = b + m * ldc;
    acc_t y[kSmallRows] = {};
    for (int64_t r = 0; r < nr; ++r) {
      const scalar_t* x = a + r * lda;
      acc_t acc = 0;
#pragma omp simd reduction(+ : acc)
      for (int64_t k = 0; k < K; ++k) acc += static_cast<acc_t>(x[k]) * static_cast<acc_t>(w[k]);
      y[r] = acc;
    }
    for (int64_t r = 0; r < nr; ++r) out[r * ldo + m] = static_cast<scalar_t>(y[r]);
  }
}

// nr <= kSmallRows rows times a slot's weights b[k, m] at b + k * sk + m * sn (sk == 1 or sn == 1):
// small_rows.h's AVX-512 kernels where the CPU has them, else the portable loops above.
template <typename scalar_t>
void few_rows_mm(const scalar_t* a, int64_t lda, const scalar_t* b, int64_t sk, int64_t sn, scalar_t* out,
                 int64_t ldo, int64_t nr, int64_t K, int64_t M) {
  static_assert(kSmallRows <= small_rows::kMaxRows);
  if (small_rows::run<scalar_t>(a, lda, b, sk, sn, out, ldo, nr, K, M)) return;
  if (sn == 1) return small_rows_mm<scalar_t>(a, lda, b, sk, out, ldo, nr, K, M);
  small_rows_mm_cols<scalar_t>(a, lda, b, sn, out, ldo, nr, K, M);
}

// Whether slot_mm's own AVX-512 kernels take a slot of this dtype (float32: f32_gemm.h; bfloat16:
// bf16_gemm.h): weights with a unit stride in one of their two dimensions, an inner size they do
// not need to block over, and the CPU's instructions (CPUID, checked once).
template <typename scalar_t>
bool own_kernel_takes(const at::Tensor& b) {
  if (b.stride(1) != 1 && b.stride(2) != 1) return false;
  if constexpr (std::is_same_v<scalar_t, float>) return b.size(1) <= kF32MaxInner && avx512_available();
  if constexpr (std::is_same_v<scalar_t, at::BFloat16>) return b.size(1) <= kBf16DotMaxInner && bf16_dot_available();
  return false;
}

// The own kernel with this thread's packing scratch; only reached where own_kernel_takes.
template <typename scalar_t>
void own_slot_mm(const scalar_t* a, int64_t lda, const scalar_t* b, int64_t sk, int64_t sn, scalar_t* out,
                 int64_t ldo, int64_t nr, int64_t K, int64_t M, const scalar_t* bias) {
#ifdef MINAGI_BF16_DOT
  if constexpr (std::is_same_v<scalar_t, at::BFloat16>) {
    std::vector<uint16_t> own;
    uint16_t* scratch = thread_scratch<uint16_t, Scratch::kPack>(bf16_dot::block_elems(K), own);
    bf16_dot_gemm(reinterpret_cast<const uint16_t*>(a), lda, reinterpret_cast<const uint16_t*>(b), sk, sn,
                  reinterpret_cast<uint16_t*>(out), ldo, nr, K, M, scratch, reinterpret_cast<const uint16_t*>(bias));
    return;
  }
#endif
#ifdef MINAGI_AVX512
  if constexpr (std::is_same_v<scalar_t, float>) {
    std::vector<float> own;
    float* scratch = thread_scratch<float, Scratch::kPack>(K * f32_fma::kCols, own);
    f32_gemm(a, lda, 1, b, sk, sn, out, ldo, nr, K, M, scratch, false, bias);
    return;
  }
#endif
  TORCH_INTERNAL_ASSERT(false, "own_slot_mm without its AVX-512 kernel");
}

// bfloat16 and float16 products of more than a few rows on CPUs without AVX-512, where ATen's mm
// has no fast kernel for them: slot_mm widens them instead (widened_mm).
template <typename scalar_t>
constexpr bool kHalfPrecision = std::is_same_v<scalar_t, at::BFloat16> || std::is_same_v<scalar_t, at::Half>;

template <typename scalar_t>
bool widens(const at::Tensor& b) {
  if constexpr (kHalfPrecision<scalar_t>) {
    static const bool slow_half_mm = cpu_isa() < CpuIsa::kAvx512;
    return slow_half_mm && b.size(1) > 0;
  }
  return false;
}

inline void to_float(const at::BFloat16* x, float* y, int64_t n) {
  bf16_to_float(reinterpret_cast<const uint16_t*>(x), y, n);
}
inline void to_float(const at::Half* x, float* y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] = static_cast<float>(x[i]);
}
inline void from_float(const float* y, at::BFloat16* x, int64_t n) {
  float_to_bf16(y, reinterpret_cast<uint16_t*>(x), n);
}
inline void from_float(const float* y, at::Half* x, int64_t n) {
  for (int64_t i = 0; i < n; ++i) x[i] = static_cast<at::Half>(y[i]);
}

// out[nr, M] (rows M apart) = a[nr, K] x b[k, m] (at b + k * sk + m * sn) in float32: the weights
// a block of columns at a time into a float32 tile that stays in the cache, the rows widened a
// chunk at a time (so the scratch stays a few MiB whatever the rows), each chunk multiplied by
// the tile with ATen's float32 mm (the BLAS) and rounded once, as a bfloat16 or float16 GEMM
// rounds its float32 sums.
template <typename scalar_t>
void widened_mm(const scalar_t* a, int64_t nr, int64_t K, const scalar_t* b, int64_t sk, int64_t sn, scalar_t* out,
                int64_t M) {
  const int64_t cols = (int64_t{256} << 10) / (K * static_cast<int64_t>(sizeof(float)));
  const int64_t nc = std::min(M, std::max<int64_t>(16, cols / 16 * 16));
  const int64_t chunk = std::min(nr, std::max<int64_t>(16, (int64_t{1} << 18) / K));  // 1 MiB of float32 rows
  std::vector<float> own;
  float* buf = thread_scratch<float, Scratch::kWiden>(K * nc + chunk * K + chunk * nc, own);
  float *tile = buf, *a32 = tile + K * nc, *y = a32 + chunk * K;
  const auto opts = at::TensorOptions().dtype(at::kFloat);
  for (int64_t c0 = 0; c0 < M; c0 += nc) {
    const int64_t n = std::min(nc, M - c0);
    at::Tensor w = at::from_blob(tile, {K, n}, opts);
    if (sk == 1) {  // column-major: each column's K values contiguous
      for (int64_t c = 0; c < n; ++c) to_float(b + (c0 + c) * sn, tile + c * K, K);
      w = at::from_blob(tile, {n, K}, opts).t();
    } else if (sn == 1) {
      for (int64_t k = 0; k < K; ++k) to_float(b + k * sk + c0, tile + k * n, n);
    } else {
      for (int64_t k = 0; k < K; ++k)
        for (int64_t c = 0; c < n; ++c) tile[k * n + c] = static_cast<float>(b[k * sk + (c0 + c) * sn]);
    }
    for (int64_t r0 = 0; r0 < nr; r0 += chunk) {
      const int64_t m = std::min(chunk, nr - r0);
      to_float(a + r0 * K, a32, m * K);
      at::Tensor yt = at::from_blob(y, {m, n}, opts);
      at::cpu::mm_out(yt, at::from_blob(a32, {m, K}, opts), w);
      for (int64_t r = 0; r < m; ++r) from_float(y + r * n, out + (r0 + r) * M + c0, n);
    }
  }
}

// out[nr, M] (rows M apart) = a[nr, K] (rows K apart) times slot `slot` of b ([S, K, M], any
// strides), plus bias (M values) where given: a few rows through the streaming kernels above, more
// through the own AVX-512 kernels (float32, bfloat16; the bias starts their sums) where the CPU
// has them, bfloat16 and float16 widened to float32 on CPUs without AVX-512, else ATen's mm (the
// BLAS).
template <typename scalar_t>
void slot_mm(const scalar_t* a, const at::Tensor& b, int64_t slot, scalar_t* out, int64_t nr,
             const scalar_t* bias = nullptr) {
  const int64_t K = b.size(1), M = b.size(2);
  const scalar_t* bp = b.data_ptr<scalar_t>() + slot * b.stride(0);
  if (nr <= kSmallRows && (b.stride(2) == 1 || b.stride(1) == 1)) {
    few_rows_mm<scalar_t>(a, K, bp, b.stride(1), b.stride(2), out, M, nr, K, M);
  } else if (own_kernel_takes<scalar_t>(b)) {
    return own_slot_mm(a, K, bp, b.stride(1), b.stride(2), out, M, nr, K, M, bias);  // the bias starts its sums
  } else if (widens<scalar_t>(b)) {
    if constexpr (kHalfPrecision<scalar_t>) widened_mm<scalar_t>(a, nr, K, bp, b.stride(1), b.stride(2), out, M);
  } else {
    at::Tensor o = at::from_blob(out, {nr, M}, b.options());
    at::cpu::mm_out(o, at::from_blob(const_cast<scalar_t*>(a), {nr, K}, b.options()), b.select(0, slot));
  }
  if (bias) at::from_blob(out, {nr, M}, b.options()).add_(at::from_blob(const_cast<scalar_t*>(bias), {M}, b.options()));
}

// One range's output columns [c0, c1): a part of small_ranges_by_columns.
struct ColumnPart {
  int64_t slot, r0, nr, c0, c1;
};

// Whether every range is a few rows (writing a handful of characters) and b's layout is one the
// small-row kernels read in place, so that small_ranges_by_columns takes the call.
bool ranges_all_small(const std::vector<int64_t>& start, const at::Tensor& b) {
  for (size_t i = 0; i + 1 < start.size(); ++i) {
    if (start[i + 1] - start[i] > kSmallRows) return false;
  }
  return b.stride(2) == 1 || b.stride(1) == 1;
}

// out = a's few-row ranges times their slots' weights, plus bias: the weights' bytes are the whole
// cost there, and one part per range would leave threads idle where the ranges are fewer than the
// threads, and uneven where the threads do not divide them (5 experts' weights on 2 threads take
// 3 experts' time). So where the ranges are fewer than 4 a thread, each range's output columns are
// cut into parts, aiming at 4 parts a thread with at most one per thread per range; with more
// ranges a range is one part, and a thread streams a slot's weights whole (cut into columns there,
// GPT-OSS-like decode at 4 characters took 1.2-1.4x the time). Each output is still one sum over
// K, whatever the cut.
template <typename scalar_t>
void small_ranges_by_columns(const at::Tensor& a, const at::Tensor& b, const at::Tensor& bias,
                             const at::Tensor& slot_ids, const std::vector<int64_t>& start, at::Tensor& out,
                             int64_t threads) {
  using acc_t = at::opmath_type<scalar_t>;
  const int64_t K = b.size(1), M = b.size(2);
  const int64_t* ip = slot_ids.data_ptr<int64_t>();
  int64_t ranges = 0;
  for (size_t i = 0; i + 1 < start.size(); ++i) ranges += start[i + 1] > start[i];
  const int64_t n = std::min<int64_t>(threads, (4 * threads + ranges - 1) / std::max<int64_t>(ranges, 1));
  std::vector<ColumnPart> parts;
  for (size_t i = 0; i + 1 < start.size(); ++i) {
    for (int64_t t = 0; t < n && start[i + 1] > start[i]; ++t) {
      const auto [c0, c1] = part_range(M, t, n, 16);
      if (c1 > c0) parts.push_back({ip[i], start[i], start[i + 1] - start[i], c0, c1});
    }
  }
  run_parts(parts, [&](const ColumnPart& p) {
    const scalar_t* x = a.data_ptr<scalar_t>() + p.r0 * K;
    const scalar_t* w = b.data_ptr<scalar_t>() + p.slot * b.stride(0);
    scalar_t* o = out.data_ptr<scalar_t>() + p.r0 * M + p.c0;
    few_rows_mm<scalar_t>(x, K, w + p.c0 * b.stride(2), b.stride(1), b.stride(2), o, M, p.nr, K, p.c1 - p.c0);
    if (!bias.defined()) return;
    const scalar_t* bs = bias.data_ptr<scalar_t>() + p.slot * M + p.c0;
    for (int64_t r = 0; r < p.nr; ++r) {  // as slot_mm's add_: the rounded product plus the bias, rounded
      for (int64_t c = 0; c < p.c1 - p.c0; ++c) {
        o[r * M + c] = static_cast<scalar_t>(static_cast<acc_t>(o[r * M + c]) + static_cast<acc_t>(bs[c]));
      }
    }
  });
}

// out = a's row ranges times their slots' weights (b read in place, any strides), plus their slots'
// rows of bias ([S, M], contiguous) where defined, one part at a time; epilogue(row0, rows) runs
// right after each part's GEMM on the same thread, while the part's output rows are still in
// cache. Where every range is a few rows (ranges_all_small: at most kSmallRows rows, weights with a
// unit stride) and there are several threads outside a parallel region, small_ranges_by_columns
// shares the ranges out instead, and the epilogue runs once over all rows after them.
template <typename Epilogue>
void grouped_mm_into(const at::Tensor& a, const at::Tensor& b, const at::Tensor& bias, const at::Tensor& slot_ids,
                     const std::vector<int64_t>& start, at::Tensor& out, Epilogue&& epilogue) {
  const int64_t threads = at::get_num_threads();
  const int64_t K = a.size(1), M = b.size(2);
  if (threads > 1 && !at::in_parallel_region() && ranges_all_small(start, b)) {
    MINAGI_DISPATCH_FLOATING(a.scalar_type(), "minagi_grouped_mm", [&] {
      small_ranges_by_columns<scalar_t>(a, b, bias, slot_ids.contiguous(), start, out, threads);
    });
    if (start.back() > 0) epilogue(0, start.back());
    return;
  }
  const auto parts = plan_parts(slot_ids.contiguous(), start, threads);
  MINAGI_DISPATCH_FLOATING(a.scalar_type(), "minagi_grouped_mm", [&] {
    run_parts(parts, [&](const Part& p) {
      const auto [lo, hi] = part_range(p.nr, p.part, p.parts, 8);
      if (hi <= lo) return;
      slot_mm<scalar_t>(a.data_ptr<scalar_t>() + (p.r0 + lo) * K, b, p.slot,
                        out.data_ptr<scalar_t>() + (p.r0 + lo) * M, hi - lo,
                        bias.defined() ? bias.data_ptr<scalar_t>() + p.slot * M : nullptr);
      epilogue(p.r0 + lo, hi - lo);
    });
  });
}

}  // namespace

// grouped_mm (grouped_gemm.cpp): the unfused scatter_mm_backward runs its grad_y b^T through it.
at::Tensor grouped_mm_cpu(const at::Tensor& a_in, const at::Tensor& b, const at::Tensor& slot_ids,
                          const at::Tensor& slot_rows);

// [E, D]: for each row, the row of src [N, D] of its pair's character (zeros for padding).
// grouped_gemm_act.cpp; gather_mm_act's path for a slot too large for a tile, and the unfused
// scatter_mm_backward's gather.
at::Tensor gathered_rows(const at::Tensor& src, const at::Tensor& row_pair, int64_t k);

// The activation of h's rows into out's (grouped_gemm_act.cpp): grouped_mm_act's, gather_mm_act's
// and decode_experts'.
void act_forward(Act act, const at::Tensor& h, at::Tensor out, double alpha, double limit);

}  // namespace minagi
