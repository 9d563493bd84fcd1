// Grouped GEMM on the CPU. Rows of `a` come in consecutive ranges, one per listed slot; each
// range is multiplied by its slot's weights read in place from the card (no weight gather, no
// copy of transposed views: the BLAS takes the strides). With exact ranges (an unbucketed plan)
// no padding row is multiplied at all.
#include <torch/library.h>

#include <ATen/ThreadLocalState.h>
#include <ATen/ops/mm_cpu_dispatch.h>
#include <ATen/ATen.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <limits>
#include <numeric>
#include <type_traits>
#include <utility>
#include <vector>

#include "../common.h"
#include "bf16_gemm.h"
#include "rows.h"
#include "small_rows.h"
#include "swiglu_avx512.h"

namespace minagi {
namespace {

// The fused kernels' tile sizes in bytes, read at each call (tile_bytes below reads and sets
// them: tests force the unfused paths with 0).
//   gather: gather_mm_act keeps a chunk's gathered rows and their h in a thread's tile, small
//     enough to stay in cache between the copy and the GEMM; a slot whose rows pass it is
//     gathered whole and multiplied by one GEMM.
//   fused: scatter_mm_backward keeps one slot's rows of the output gradient in a tile.
std::atomic<int64_t> g_gather_tile_bytes{int64_t{2} << 20};
std::atomic<int64_t> g_fused_tile_bytes{int64_t{1} << 20};

// Validates slot_ids / slot_rows against a [E, ...] and returns each range's first row.
std::vector<int64_t> range_starts(const at::Tensor& slot_ids, const at::Tensor& slot_rows,
                                  int64_t E, int64_t n_slots, const char* op, bool unique,
                                  const char* rows_of = "the input") {
  check_dim(slot_ids, 1, op, "slot_ids");
  check_dim(slot_rows, 1, op, "slot_rows");
  check_index(slot_ids, op, "slot_ids");
  check_index(slot_rows, op, "slot_rows");
  TORCH_CHECK(slot_ids.size(0) == slot_rows.size(0), "minagi.", op, ": slot_ids (", slot_ids.size(0),
              ") and slot_rows (", slot_rows.size(0), ") must have one length");
  TORCH_CHECK(slot_ids.device().is_cpu() && slot_rows.device().is_cpu(), "minagi.", op,
              ": slot_ids and slot_rows must be on the CPU with the other inputs");
  const at::Tensor ids = slot_ids.contiguous(), rows = slot_rows.contiguous();
  const int64_t A = ids.size(0);
  const int64_t* ip = ids.data_ptr<int64_t>();
  const int64_t* rp = rows.data_ptr<int64_t>();
  std::vector<int64_t> start(A + 1, 0);
  std::vector<char> seen(unique ? n_slots : 0, 0);
  for (int64_t i = 0; i < A; ++i) {
    TORCH_CHECK(ip[i] >= 0 && ip[i] < n_slots, "minagi.", op, ": slot_ids holds ", ip[i],
                " at position ", i, ", outside [0, n_slots=", n_slots, ")");
    TORCH_CHECK(rp[i] >= 0, "minagi.", op, ": slot_rows holds ", rp[i], " at position ", i,
                "; row counts must be >= 0");
    if (unique) {
      TORCH_CHECK(!seen[ip[i]], "minagi.", op, ": slot_ids lists slot ", ip[i],
                  " twice; each slot may own one row range");
      seen[ip[i]] = 1;
    }
    start[i + 1] = start[i] + rp[i];
  }
  TORCH_CHECK(start[A] <= E, "minagi.", op, ": slot_rows sums to ", start[A],
              " rows but ", rows_of, " has only ", E, " rows");
  return start;
}

// Rows from r0 on own no slot (an exact plan's dropped pairs): their outputs are zeros.
void zero_tail(at::Tensor& t, int64_t r0) {
  if (r0 < t.size(0)) t.narrow(0, r0, t.size(0) - r0).zero_();
}

// The most rows any listed range holds.
int64_t busiest_range(const std::vector<int64_t>& start) {
  int64_t busiest = 0;
  for (size_t i = 0; i + 1 < start.size(); ++i) busiest = std::max(busiest, start[i + 1] - start[i]);
  return busiest;
}

// Work split for the per-slot GEMMs. Each slot's range is one GEMM on one thread (the BLAS runs
// single-threaded inside a parallel region); a range too large for an even share is cut into up
// to `threads` parts (rows for grouped_mm, output columns for the weight gradient). Threads pull
// parts largest first from a shared counter, so a sink slot cannot leave a thread idle, and the
// many ~100-row ranges of a uniform load do not pay the BLAS's own thread start-up per GEMM.
struct Part {
  int64_t slot, r0, nr;  // slot id and its row range
  int64_t part, parts;   // which of the range's equal parts
};

std::vector<Part> plan_parts(const at::Tensor& slot_ids, const std::vector<int64_t>& start,
                             int64_t threads) {
  const int64_t* ip = slot_ids.data_ptr<int64_t>();
  const int64_t A = static_cast<int64_t>(start.size()) - 1;
  const int64_t E = start[A];
  std::vector<Part> parts;
  for (int64_t i = 0; i < A; ++i) {
    const int64_t nr = start[i + 1] - start[i];
    if (nr == 0) continue;
    const int64_t n = std::min<int64_t>(threads, std::max<int64_t>(1, (2 * nr * threads) / std::max<int64_t>(E, 1)));
    for (int64_t p = 0; p < n; ++p) parts.push_back({ip[i], start[i], nr, p, n});
  }
  std::stable_sort(parts.begin(), parts.end(),
                   [](const Part& a, const Part& b) { return a.nr / a.parts > b.nr / b.parts; });
  return parts;
}

// [lo, hi) of `size` for part p of n, in multiples of `align` so SIMD tiles stay whole.
inline std::pair<int64_t, int64_t> part_range(int64_t size, int64_t p, int64_t n, int64_t align) {
  int64_t step = (size + n - 1) / n;
  step = ((step + align - 1) / align) * align;
  return {std::min(size, p * step), std::min(size, (p + 1) * step)};
}

template <typename P, typename F>
void run_parts(const std::vector<P>& parts, F&& fn) {
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), static_cast<int64_t>(parts.size()));
  if (threads <= 1 || at::in_parallel_region()) {
    for (const P& part : parts) fn(part);
    return;
  }
  // Worker threads need the caller's dispatch state (autograd is excluded below this kernel).
  const at::ThreadLocalState tls;
  std::atomic<int64_t> next{0};
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    at::ThreadLocalStateGuard guard(tls);
    for (int64_t i = next++; i < static_cast<int64_t>(parts.size()); i = next++) fn(parts[i]);
  });
}

// A range of at most kSmallRows rows times one slot's row-major weights, streaming the weights
// once. Writing one character puts one row in each of its top_k slots, and there a BLAS call
// (which packs or re-reads b) reached about half the memory bandwidth of a plain pass over b;
// the weights' bytes are the whole cost of such a product.
constexpr int64_t kSmallRows = 4;
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

// n elements of scratch for this thread, kept for its next call: a fresh block of a tile's size
// (hundreds of KiB) would be mapped and faulted in page by page for every slot. Past kMaxKept
// bytes the caller's own (freed) buffer is used instead, so a thread holds at most that much.
// Each use has its own buffer: a GEMM kernel packs its weights (kPack) while the caller's gathered
// rows (kTile) are its input.
constexpr size_t kMaxKept = size_t{4} << 20;
enum class Scratch { kTile, kPack };

template <typename T, Scratch use = Scratch::kTile>
T* thread_scratch(int64_t n, std::vector<T>& own) {
  thread_local std::vector<T> kept;
  std::vector<T>& buf = static_cast<size_t>(n) * sizeof(T) <= kMaxKept ? kept : own;
  if (static_cast<int64_t>(buf.size()) < n) buf.resize(n);
  return buf.data();
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

// A weight gradient of at least this many bytes is written past the cache: it is read next by the
// optimizer, after the rest of the backward has passed through the cache.
constexpr size_t kStreamBytes = size_t{16} << 20;

// A matrix by pointer: `rows` rows of `cols` values, rows `ld` values apart, unit column stride.
// The per-slot loops pass these instead of narrowed tensors: a view is three dispatched ops (narrow,
// slice, as_strided) and a TensorImpl, and the weight gradients of 128 slots took ~600 of them a
// call.
struct RawMat {
  void* p;
  int64_t rows, cols, ld;
  template <typename T>
  T* data() const {
    return static_cast<T*>(p);
  }
  at::Tensor tensor(const at::TensorOptions& opts) const { return at::from_blob(p, {rows, cols}, {ld, 1}, opts); }
};

// out = x^T y, the sum over their rows (x [nr, M], y [nr, N], out [M, N]): a weight gradient's
// GEMM. bfloat16 takes bf16_dot_wgrad and float32 f32_gemm where they can, with `stream` writing
// past the cache (stream_rows in f32_gemm.h); else ATen's mm.
void wgrad_mm(at::ScalarType dtype, const RawMat& out, const RawMat& x, const RawMat& y, bool stream) {
  const int64_t nr = x.rows, M = x.cols, N = y.cols;
#ifdef MINAGI_BF16_DOT
  if (dtype == at::kBFloat16 && nr <= kBf16DotMaxInner && bf16_dot_wgrad_scratch(nr, N) * 2 <= kBf16DotMaxScratch &&
      bf16_dot_available()) {
    std::vector<uint16_t> own;
    uint16_t* scratch = thread_scratch<uint16_t, Scratch::kPack>(bf16_dot_wgrad_scratch(nr, N), own);
    bf16_dot_wgrad(x.data<const uint16_t>(), x.ld, y.data<const uint16_t>(), y.ld, out.data<uint16_t>(), out.ld, nr, M, N,
                   scratch, stream);
    return;
  }
#endif
#ifdef MINAGI_AVX512
  if (dtype == at::kFloat && nr <= kF32MaxInner && avx512_available()) {
    std::vector<float> own;
    float* scratch = thread_scratch<float, Scratch::kPack>(nr * f32_fma::kCols, own);
    // x^T's row m is x's column m: values x.ld apart
    f32_gemm(x.data<const float>(), 1, x.ld, y.data<const float>(), y.ld, 1, out.data<float>(), out.ld, M, nr, N, scratch,
             stream);
    return;
  }
#endif
  const auto opts = at::TensorOptions().dtype(dtype);
  at::Tensor o = out.tensor(opts);
  at::cpu::mm_out(o, x.tensor(opts).t(), y.tensor(opts));
}

// out[nr, M] (rows M apart) = a[nr, K] (rows K apart) times slot `slot` of b ([S, K, M], any
// strides), plus bias (M values) where given: a few rows through the streaming kernels above, more
// through the own AVX-512 kernels (float32, bfloat16; the bias starts their sums) where the CPU
// has them, else ATen's mm (the BLAS).
template <typename scalar_t>
void slot_mm(const scalar_t* a, const at::Tensor& b, int64_t slot, scalar_t* out, int64_t nr,
             const scalar_t* bias = nullptr) {
  const int64_t K = b.size(1), M = b.size(2);
  const scalar_t* bp = b.data_ptr<scalar_t>() + slot * b.stride(0);
  if (nr <= kSmallRows && (b.stride(2) == 1 || b.stride(1) == 1)) {
    few_rows_mm<scalar_t>(a, K, bp, b.stride(1), b.stride(2), out, M, nr, K, M);
  } else if (own_kernel_takes<scalar_t>(b)) {
    return own_slot_mm(a, K, bp, b.stride(1), b.stride(2), out, M, nr, K, M, bias);  // the bias starts its sums
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

at::Tensor grouped_mm_cpu(const at::Tensor& a_in, const at::Tensor& b, const at::Tensor& slot_ids,
                          const at::Tensor& slot_rows) {
  check_grouped_mm_args(a_in, b);
  const at::Tensor a = a_in.contiguous();
  const auto start = range_starts(slot_ids, slot_rows, a.size(0), b.size(0), "grouped_mm", false);
  at::Tensor out = empty_output({a.size(0), b.size(2)}, a.options());
  grouped_mm_into(a, b, at::Tensor(), slot_ids, start, out, [](int64_t, int64_t) {});
  zero_tail(out, start.back());
  return out;
}

// exp without a call, so that the clamped GPT-OSS form's loops below vectorise (libm's expf is one
// call per element, and ATen has no kernel for this form): Cephes' range reduction and degree-5
// polynomial, within a few ulp of expf; inputs past [-87.3, 88] are clamped there (a sigmoid's
// 0 or 1 to float precision). NaN stays NaN. double keeps std::exp (tests and checks only).
inline float exp_simd(float x) {
  x = x > 88.0f ? 88.0f : x;
  x = x < -87.3365478515625f ? -87.3365478515625f : x;
  float fx = std::floor(x * 1.44269504088896341f + 0.5f);
  const float r = x - fx * 0.693359375f + fx * 2.12194440e-4f;
  const float p = ((((1.9875691500e-4f * r + 1.3981999507e-3f) * r + 8.3334519073e-3f) * r + 4.1665795894e-2f) * r +
                   1.6666665459e-1f) * r + 5.0000001201e-1f;
  fx = fx == fx ? fx : 0.0f;  // NaN: any scale (the polynomial is NaN already)
  const uint32_t bits = static_cast<uint32_t>(static_cast<int32_t>(fx) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return (p * r * r + r + 1.0f) * scale;
}

// Elements per task of the activation loops when they are shared out over threads.
constexpr int64_t kActGrain = 16384;

template <typename acc_t>
inline acc_t sigmoid_simd(acc_t x) {
  if constexpr (std::is_same_v<acc_t, float>) {
    return 1.0f / (1.0f + exp_simd(-x));
  } else {
    return acc_t(1) / (acc_t(1) + std::exp(-x));
  }
}

// GPT-OSS's clamped form over one row: csrc/activation.h's act_gated_fwd and act_gated_bwd for
// SwigluOai, written for the vectoriser (gate and up alternate in h).
template <typename scalar_t, typename acc_t = at::opmath_type<scalar_t>>
MINAGI_SIMD_CLONES void oai_fwd_row(const scalar_t* __restrict h, scalar_t* __restrict o, int64_t W, acc_t alpha,
                                    acc_t limit) {
#pragma omp simd
  for (int64_t j = 0; j < W; ++j) {
    const acc_t gate = static_cast<acc_t>(h[2 * j]), up = static_cast<acc_t>(h[2 * j + 1]);
    const acc_t g = gate > limit ? limit : gate;
    const acc_t u = up > limit ? limit : (up < -limit ? -limit : up);
    o[j] = static_cast<scalar_t>((u + acc_t(1)) * g * sigmoid_simd(alpha * g));
  }
}

template <typename scalar_t, typename acc_t = at::opmath_type<scalar_t>>
MINAGI_SIMD_CLONES void oai_bwd_row(const scalar_t* __restrict grad, const scalar_t* __restrict h,
                                    scalar_t* __restrict gh, int64_t W, acc_t alpha, acc_t limit) {
#pragma omp simd
  for (int64_t j = 0; j < W; ++j) {
    const acc_t gate = static_cast<acc_t>(h[2 * j]), up = static_cast<acc_t>(h[2 * j + 1]);
    const acc_t gr = static_cast<acc_t>(grad[j]);
    // `&`, not `&&`, and both sides of each select computed: no branch for the vectoriser to refuse
    const bool g_in = !(gate > limit), u_in = !(up > limit) & !(up < -limit);
    const acc_t g = g_in ? gate : limit;
    const acc_t u_clamped = up > limit ? limit : -limit;
    const acc_t u = u_in ? up : u_clamped;
    const acc_t sg = sigmoid_simd(alpha * g);
    const acc_t glu = g * sg;
    const acc_t d_gate = gr * (u + acc_t(1)) * (sg + alpha * glu * (acc_t(1) - sg)), d_up = gr * glu;
    gh[2 * j] = static_cast<scalar_t>(g_in ? d_gate : acc_t(0));
    gh[2 * j + 1] = static_cast<scalar_t>(u_in ? d_up : acc_t(0));
  }
}

// An interleaved form's bfloat16 row (h [2W], gate and up alternating) through its float32 loop:
// chunks widened to float32, row_fn(hf, of, n) or, backward, row_fn(gf, hf, ghf, n), narrowed back.
template <typename RowFn>
void interleaved_fwd_bf16(const at::BFloat16* h, at::BFloat16* o, int64_t W, RowFn&& row_fn) {
  alignas(64) float hf[2 * kActChunk], of[kActChunk];
  for (int64_t j0 = 0; j0 < W; j0 += kActChunk) {
    const int64_t n = std::min(kActChunk, W - j0);
    bf16_to_float(reinterpret_cast<const uint16_t*>(h) + 2 * j0, hf, 2 * n);
    row_fn(hf, of, n);
    float_to_bf16(of, reinterpret_cast<uint16_t*>(o) + j0, n);
  }
}

template <typename RowFn>
void interleaved_bwd_bf16(const at::BFloat16* grad, const at::BFloat16* h, at::BFloat16* gh, int64_t W,
                          RowFn&& row_fn) {
  alignas(64) float gf[kActChunk], hf[2 * kActChunk], ghf[2 * kActChunk];
  for (int64_t j0 = 0; j0 < W; j0 += kActChunk) {
    const int64_t n = std::min(kActChunk, W - j0);
    bf16_to_float(reinterpret_cast<const uint16_t*>(grad) + j0, gf, n);
    bf16_to_float(reinterpret_cast<const uint16_t*>(h) + 2 * j0, hf, 2 * n);
    row_fn(gf, hf, ghf, n);
    float_to_bf16(ghf, reinterpret_cast<uint16_t*>(gh) + 2 * j0, 2 * n);
  }
}

// SwiGLU's own loops, both forms, gate and up `s` apart element to element (1: h's halves, 2:
// interleaved). Forward: out = silu(gate) * up. Backward: d up = grad * silu(gate), d gate = grad *
// up * silu'(gate). ATen's silu, mul and silu_backward on the forms' views took 3.3 ns an output in
// the backward, and 2-3x this loop's time in the interleaved forward (tools/activation_probe.py);
// in the halves forward they were as fast, but as two ATen calls and four views a slot's part.
template <typename acc_t, int s>
MINAGI_SIMD_CLONES void swiglu_fwd_row(const acc_t* __restrict gate, const acc_t* __restrict up,
                                       acc_t* __restrict o, int64_t W) {
#pragma omp simd
  for (int64_t j = 0; j < W; ++j) {
    const acc_t g = gate[j * s];
    const acc_t v = g * sigmoid_simd(g) * up[j * s];
    o[j] = g == -std::numeric_limits<acc_t>::infinity() ? std::numeric_limits<acc_t>::quiet_NaN() : v;  // as the twin
  }
}

template <typename acc_t, int s>  // s known at compile time: unit or stride-2 vector accesses, not gathers
MINAGI_SIMD_CLONES void swiglu_bwd_row(const acc_t* __restrict grad, const acc_t* __restrict gate,
                                       const acc_t* __restrict up, acc_t* __restrict d_gate, acc_t* __restrict d_up,
                                       int64_t W) {
#pragma omp simd
  for (int64_t j = 0; j < W; ++j) {
    const acc_t g = gate[j * s], gr = grad[j];
    const acc_t sg = sigmoid_simd(g);
    const bool minus_inf = g == -std::numeric_limits<acc_t>::infinity();  // NaN there, as the twin
    const acc_t nan = std::numeric_limits<acc_t>::quiet_NaN();
    const acc_t du = gr * g * sg, dg = gr * up[j * s] * sg * (acc_t(1) + g * (acc_t(1) - sg));
    d_up[j * s] = minus_inf ? nan : du;
    d_gate[j * s] = minus_inf ? nan : dg;
  }
}

// A float32 or bfloat16 row through csrc/cpu/swiglu_avx512.h where the CPU has AVX-512 (false:
// not taken, the portable loops below serve).
template <typename scalar_t>
bool swiglu_avx512_row(bool interleaved, const scalar_t* h, scalar_t* o, int64_t W) {
#ifdef MINAGI_AVX512
  if constexpr (std::is_same_v<scalar_t, float> || std::is_same_v<scalar_t, at::BFloat16>) {
    if (!swiglu512::available()) return false;
    using T = std::conditional_t<std::is_same_v<scalar_t, float>, float, uint16_t>;
    const T* hp = reinterpret_cast<const T*>(h);
    T* op = reinterpret_cast<T*>(o);
    interleaved ? swiglu512::forward_row<true>(hp, op, W) : swiglu512::forward_row<false>(hp, op, W);
    return true;
  }
#endif
  return false;
}

template <typename scalar_t>
bool swiglu_avx512_grad_row(bool interleaved, const scalar_t* grad, const scalar_t* h, scalar_t* gh, int64_t W) {
#ifdef MINAGI_AVX512
  if constexpr (std::is_same_v<scalar_t, float> || std::is_same_v<scalar_t, at::BFloat16>) {
    if (!swiglu512::available()) return false;
    using T = std::conditional_t<std::is_same_v<scalar_t, float>, float, uint16_t>;
    const T *gp = reinterpret_cast<const T*>(grad), *hp = reinterpret_cast<const T*>(h);
    T* ghp = reinterpret_cast<T*>(gh);
    interleaved ? swiglu512::backward_row<true>(gp, hp, ghp, W) : swiglu512::backward_row<false>(gp, hp, ghp, W);
    return true;
  }
#endif
  return false;
}

// One row: float32 and float64 in place; bfloat16 widened to float32 a chunk at a time, as the
// clamped form's rows are.
template <typename scalar_t>
void swiglu_row(bool interleaved, const scalar_t* h, scalar_t* o, int64_t W) {
  if (swiglu_avx512_row(interleaved, h, o, W)) return;
  if constexpr (std::is_same_v<scalar_t, at::BFloat16>) {
    if (interleaved) {
      interleaved_fwd_bf16(h, o, W, [](const float* hf, float* of, int64_t n) {
        swiglu_fwd_row<float, 2>(hf, hf + 1, of, n);
      });
      return;
    }
    alignas(64) float gf[kActChunk], uf[kActChunk], of[kActChunk];
    const uint16_t* hu = reinterpret_cast<const uint16_t*>(h);
    for (int64_t j0 = 0; j0 < W; j0 += kActChunk) {
      const int64_t n = std::min(kActChunk, W - j0);
      bf16_to_float(hu + j0, gf, n);
      bf16_to_float(hu + W + j0, uf, n);
      swiglu_fwd_row<float, 1>(gf, uf, of, n);
      float_to_bf16(of, reinterpret_cast<uint16_t*>(o) + j0, n);
    }
  } else if constexpr (std::is_floating_point_v<scalar_t>) {
    if (interleaved) {
      swiglu_fwd_row<scalar_t, 2>(h, h + 1, o, W);
    } else {
      swiglu_fwd_row<scalar_t, 1>(h, h + W, o, W);
    }
  } else {
    TORCH_INTERNAL_ASSERT(false, "swiglu_row: float16 takes ATen's kernels");
  }
}

template <typename scalar_t>
void swiglu_grad_row(bool interleaved, const scalar_t* grad, const scalar_t* h, scalar_t* gh, int64_t W) {
  if (swiglu_avx512_grad_row(interleaved, grad, h, gh, W)) return;
  if constexpr (std::is_same_v<scalar_t, at::BFloat16>) {
    if (interleaved) {
      interleaved_bwd_bf16(grad, h, gh, W, [](const float* gf, const float* hf, float* ghf, int64_t n) {
        swiglu_bwd_row<float, 2>(gf, hf, hf + 1, ghf, ghf + 1, n);
      });
      return;
    }
    alignas(64) float gf[kActChunk], hf[2 * kActChunk], ghf[2 * kActChunk];  // gate chunk, then up chunk
    const uint16_t* hu = reinterpret_cast<const uint16_t*>(h);
    uint16_t* ghu = reinterpret_cast<uint16_t*>(gh);
    for (int64_t j0 = 0; j0 < W; j0 += kActChunk) {
      const int64_t n = std::min(kActChunk, W - j0);
      bf16_to_float(reinterpret_cast<const uint16_t*>(grad) + j0, gf, n);
      bf16_to_float(hu + j0, hf, n);
      bf16_to_float(hu + W + j0, hf + kActChunk, n);
      swiglu_bwd_row<float, 1>(gf, hf, hf + kActChunk, ghf, ghf + kActChunk, n);
      float_to_bf16(ghf, ghu + j0, n);
      float_to_bf16(ghf + kActChunk, ghu + W + j0, n);
    }
  } else if constexpr (std::is_floating_point_v<scalar_t>) {
    if (interleaved) {
      swiglu_bwd_row<scalar_t, 2>(grad, h, h + 1, gh, gh + 1, W);
    } else {
      swiglu_bwd_row<scalar_t, 1>(grad, h, h + W, gh, gh + W, W);
    }
  } else {
    TORCH_INTERNAL_ASSERT(false, "swiglu_grad_row: float16 takes ATen's kernels");
  }
}

// Rows of h (unit column stride) through the rows above, shared out over the threads outside a
// part (inline inside one, like the clamped form's rows).
template <typename scalar_t>
void swiglu_rows(bool interleaved, const scalar_t* h, int64_t ldh, scalar_t* out, int64_t ldo, int64_t rows,
                 int64_t W) {
  at::parallel_for(0, rows, std::max<int64_t>(1, kActGrain / std::max<int64_t>(W, 1)), [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) swiglu_row<scalar_t>(interleaved, h + r * ldh, out + r * ldo, W);
  });
}

template <typename scalar_t>
void swiglu_rows(bool interleaved, const at::Tensor& h, at::Tensor& out) {
  swiglu_rows<scalar_t>(interleaved, h.data_ptr<scalar_t>(), h.stride(0), out.data_ptr<scalar_t>(), out.stride(0),
                        h.size(0), out.size(1));
}

template <typename scalar_t>
void swiglu_grad_rows(bool interleaved, const at::Tensor& grad, const at::Tensor& h, at::Tensor& gh) {
  const int64_t W = grad.size(1);
  at::parallel_for(0, h.size(0), std::max<int64_t>(1, kActGrain / std::max<int64_t>(W, 1)), [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) {
      swiglu_grad_row<scalar_t>(interleaved, grad.data_ptr<scalar_t>() + r * grad.stride(0),
                                h.data_ptr<scalar_t>() + r * h.stride(0), gh.data_ptr<scalar_t>() + r * gh.stride(0),
                                W);
    }
  });
}

// Whether SwiGLU's own rows above take these tensors: float32, float64 or bfloat16 (float16 keeps
// ATen's kernels), unit column strides.
bool swiglu_own_takes(std::initializer_list<const at::Tensor*> ts) {
  for (const at::Tensor* t : ts) {
    const auto st = t->scalar_type();
    if (!(st == at::kFloat || st == at::kDouble || st == at::kBFloat16) || t->stride(1) != 1) return false;
  }
  return true;
}

// The activation of h's rows into out's, through ATen's vectorised kernels (run on one thread
// inside a part: the parts are the parallelism; after small_ranges_by_columns, once over all rows,
// spread over the threads as ATen does). GPT-OSS's clamped form, with no ATen kernel of its
// own, takes the loops above.
template <typename scalar_t>
void oai_rows(const at::Tensor& h, at::Tensor& out, double alpha, double limit) {
  using acc_t = at::opmath_type<scalar_t>;
  const int64_t W = out.size(1);
  // Inside a part (a parallel region) this runs inline, on the part's thread.
  at::parallel_for(0, h.size(0), std::max<int64_t>(1, kActGrain / std::max<int64_t>(W, 1)), [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) {
      const scalar_t* hr = h.data_ptr<scalar_t>() + r * h.stride(0);
      scalar_t* o = out.data_ptr<scalar_t>() + r * out.stride(0);
      if constexpr (std::is_same_v<scalar_t, at::BFloat16>) {
        const float a = static_cast<float>(alpha), l = static_cast<float>(limit);
        interleaved_fwd_bf16(hr, o, W, [&](const float* hf, float* of, int64_t n) { oai_fwd_row<float>(hf, of, n, a, l); });
      } else {
        oai_fwd_row<scalar_t>(hr, o, W, static_cast<acc_t>(alpha), static_cast<acc_t>(limit));
      }
    }
  });
}

// gate and up of a gated form's h rows (views: halves, or alternate columns).
std::pair<at::Tensor, at::Tensor> gate_up(Act act, const at::Tensor& h) {
  const int64_t M = h.size(1), W = M / 2;
  if (act == Act::Swiglu) return {h.narrow(1, 0, W), h.narrow(1, W, W)};
  return {h.slice(1, 0, M, 2), h.slice(1, 1, M, 2)};
}

void act_forward(Act act, const at::Tensor& h, at::Tensor out, double alpha, double limit) {
  switch (act) {
    case Act::Gelu: at::gelu_out(out, h); return;
    case Act::GeluTanh: at::gelu_out(out, h, "tanh"); return;
    case Act::Silu: at::silu_out(out, h); return;
    case Act::Relu2:
      at::clamp_min_out(out, h, 0);
      out.mul_(out);
      return;
    case Act::SwigluOai:
      MINAGI_DISPATCH_FLOATING(h.scalar_type(), "minagi_oai_rows", [&] { oai_rows<scalar_t>(h, out, alpha, limit); });
      return;
    default: {  // swiglu, swiglu_interleaved
      if (swiglu_own_takes({&h, &out})) {
        MINAGI_DISPATCH_FLOATING(h.scalar_type(), "minagi_swiglu_rows",
                                 [&] { swiglu_rows<scalar_t>(act == Act::SwigluInterleaved, h, out); });
        return;
      }
      const auto [gate, up] = gate_up(act, h);
      at::silu_out(out, gate);
      out.mul_(up);
    }
  }
}

std::tuple<at::Tensor, at::Tensor> grouped_mm_act_cpu(const at::Tensor& a_in, const at::Tensor& b,
                                                      const c10::optional<at::Tensor>& bias_in,
                                                      const at::Tensor& slot_ids, const at::Tensor& slot_rows,
                                                      c10::string_view activation, double alpha, double limit) {
  const Act act = check_grouped_mm_act_args(a_in, b, bias_in, std::string(activation));
  const at::Tensor a = a_in.contiguous();
  const auto start = range_starts(slot_ids, slot_rows, a.size(0), b.size(0), "grouped_mm_act", false);
  const int64_t M = b.size(2);
  at::Tensor h = empty_output({a.size(0), M}, a.options());
  at::Tensor out = empty_output({a.size(0), act_gated(act) ? M / 2 : M}, a.options());
  const at::Tensor bias = bias_in.has_value() ? bias_in->contiguous() : at::Tensor();
  const bool own_swiglu = (act == Act::Swiglu || act == Act::SwigluInterleaved) && swiglu_own_takes({&h, &out});
  grouped_mm_into(a, b, bias, slot_ids, start, h, [&](int64_t r0, int64_t nr) {
    if (!own_swiglu) return act_forward(act, h.narrow(0, r0, nr), out.narrow(0, r0, nr), alpha, limit);
    MINAGI_DISPATCH_FLOATING(h.scalar_type(), "minagi_swiglu_rows", [&] {  // by pointer: no views a part
      swiglu_rows<scalar_t>(act == Act::SwigluInterleaved, h.data_ptr<scalar_t>() + r0 * M, M,
                            out.data_ptr<scalar_t>() + r0 * (M / 2), M / 2, nr, M / 2);
    });
  });
  zero_tail(h, start.back());
  zero_tail(out, start.back());
  return {h, out};
}

template <typename scalar_t>
void oai_backward_rows(const at::Tensor& grad, const at::Tensor& h, at::Tensor& gh, double alpha, double limit) {
  using acc_t = at::opmath_type<scalar_t>;
  const int64_t W = grad.size(1);
  // The whole [E, 2H] at once (no bias gradient) is shared out over the threads, as ATen's own
  // elementwise kernels are; per slot (inside a parallel region) it runs inline.
  at::parallel_for(0, h.size(0), std::max<int64_t>(1, kActGrain / std::max<int64_t>(W, 1)), [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) {
      const scalar_t* gr = grad.data_ptr<scalar_t>() + r * grad.stride(0);
      const scalar_t* hr = h.data_ptr<scalar_t>() + r * h.stride(0);
      scalar_t* g = gh.data_ptr<scalar_t>() + r * gh.stride(0);
      if constexpr (std::is_same_v<scalar_t, at::BFloat16>) {
        const float a = static_cast<float>(alpha), l = static_cast<float>(limit);
        interleaved_bwd_bf16(gr, hr, g, W, [&](const float* gf, const float* hf, float* ghf, int64_t n) {
          oai_bwd_row<float>(gf, hf, ghf, n, a, l);
        });
      } else {
        oai_bwd_row<scalar_t>(gr, hr, g, W, static_cast<acc_t>(alpha), static_cast<acc_t>(limit));
      }
    }
  });
}

// h's gradient from the activation's output gradient, for some rows (ATen's kernels as above).
void act_backward(Act act, const at::Tensor& grad, const at::Tensor& h, at::Tensor gh, double alpha, double limit) {
  switch (act) {
    case Act::Gelu: at::gelu_backward_out(gh, grad, h); return;
    case Act::GeluTanh: at::gelu_backward_out(gh, grad, h, "tanh"); return;
    case Act::Silu: at::silu_backward_out(gh, grad, h); return;
    case Act::Relu2:
      at::clamp_min_out(gh, h, 0);
      gh.mul_(grad).mul_(2);
      return;
    case Act::SwigluOai:
      MINAGI_DISPATCH_FLOATING(h.scalar_type(), "minagi_oai_backward_rows",
                               [&] { oai_backward_rows<scalar_t>(grad, h, gh, alpha, limit); });
      return;
    default: {  // d up = grad * silu(gate); d gate = grad * up * silu'(gate)
      if (swiglu_own_takes({&grad, &h, &gh})) {
        MINAGI_DISPATCH_FLOATING(h.scalar_type(), "minagi_swiglu_grad_rows",
                                 [&] { swiglu_grad_rows<scalar_t>(act == Act::SwigluInterleaved, grad, h, gh); });
        return;
      }
      const auto [gate, up] = gate_up(act, h);
      auto [d_gate, d_up] = gate_up(act, gh);
      at::silu_out(d_up, gate);
      d_up.mul_(grad);
      at::silu_backward_out(d_gate, grad, gate);
      d_gate.mul_(up);
    }
  }
}

std::tuple<at::Tensor, at::Tensor> expert_act_backward_cpu(const at::Tensor& grad_in, const at::Tensor& h_in,
                                                           const at::Tensor& slot_ids, const at::Tensor& slot_rows,
                                                           c10::string_view activation, double alpha, double limit,
                                                           int64_t n_slots, bool bias_grad) {
  const Act act = check_act_backward_args(grad_in, h_in, std::string(activation), n_slots);
  const at::Tensor grad = grad_in.contiguous(), h = h_in.contiguous();
  const auto start = range_starts(slot_ids, slot_rows, h.size(0), n_slots, "expert_act_backward", bias_grad);
  const int64_t E = h.size(0), M = h.size(1);
  at::Tensor gh = empty_output({E, M}, h.options());
  if (!bias_grad) {  // elementwise over every row: ATen shares it out over the threads
    act_backward(act, grad, h, gh, alpha, limit);
    zero_tail(gh, start.back());
    return {gh, at::empty({0}, h.options())};
  }
  // Each slot's rows on one thread: its bias gradient is a sum in a fixed order.
  at::Tensor gb = at::zeros({n_slots, M}, h.options());
  const at::Tensor ids = slot_ids.contiguous();
  const int64_t* ip = ids.data_ptr<int64_t>();
  const at::ThreadLocalState tls;
  at::parallel_for(0, ids.size(0), 1, [&](int64_t b, int64_t e) {
    at::ThreadLocalStateGuard guard(tls);
    for (int64_t i = b; i < e; ++i) {
      const int64_t r0 = start[i], nr = start[i + 1] - start[i];
      at::Tensor rows = gh.narrow(0, r0, nr);
      act_backward(act, grad.narrow(0, r0, nr), h.narrow(0, r0, nr), rows, alpha, limit);
      at::Tensor g = gb.select(0, ip[i]);
      at::sum_out(g, rows, {0});
    }
  });
  zero_tail(gh, start.back());
  return {gh, gb};
}

at::Tensor grouped_mm_wgrad_cpu(const at::Tensor& a_in, const at::Tensor& grad_in,
                                const at::Tensor& slot_ids, const at::Tensor& slot_rows,
                                int64_t n_slots) {
  const char* op = "grouped_mm_wgrad";
  check_wgrad_args(a_in, grad_in, n_slots);
  const at::Tensor a = a_in.contiguous(), grad = grad_in.contiguous();
  const auto start = range_starts(slot_ids, slot_rows, a.size(0), n_slots, op, true);
  const int64_t K = a.size(1), M = grad.size(1);
  // Only the slots that own no rows need zeros; the others are overwritten whole.
  at::Tensor out = empty_output({n_slots, K, M}, a.options());
  const bool stream = out.nbytes() >= kStreamBytes;
  const at::Tensor ids = slot_ids.contiguous();
  auto parts = plan_parts(ids, start, at::get_num_threads());
  // Slots with no rows get zeros, as parts of their own so the zeroing is shared out too.
  std::vector<char> owned(n_slots, 0);
  for (const Part& p : parts) owned[p.slot] = 1;
  for (int64_t s = 0; s < n_slots; ++s) {
    if (!owned[s]) parts.push_back({s, 0, 0, 0, 1});
  }
  char* op_ = static_cast<char*>(out.data_ptr());
  char* ap = static_cast<char*>(a.data_ptr());
  char* gp = static_cast<char*>(grad.data_ptr());
  const int64_t elem = a.element_size();
  run_parts(parts, [&](const Part& p) {
    const auto [lo, hi] = part_range(M, p.part, p.parts, 16);
    if (hi <= lo) return;
    const RawMat o{op_ + (p.slot * K * M + lo) * elem, K, hi - lo, M};
    if (p.nr == 0) {
      for (int64_t r = 0; r < K; ++r) std::memset(o.data<char>() + r * M * elem, 0, (hi - lo) * elem);
      return;
    }
    wgrad_mm(a.scalar_type(), o, {ap + p.r0 * K * elem, p.nr, K, K}, {gp + (p.r0 * M + lo) * elem, p.nr, hi - lo, M},
             stream);
  });
  return out;
}

// nr rows of D into tile: for each, the row of src (one row per character) of its pair's character,
// or zeros for a padding row (pair < 0). k pairs per character.
template <typename scalar_t>
void gather_pair_rows(scalar_t* tile, const scalar_t* src, const int64_t* row_pair, int64_t nr, int64_t k,
                      int64_t D) {
  for (int64_t i = 0; i < nr; ++i) {
    const int64_t pair = row_pair[i];
    scalar_t* t = tile + i * D;
    if (pair < 0) {
      std::fill(t, t + D, scalar_t(0));
    } else {
      std::copy(src + (pair / k) * D, src + (pair / k + 1) * D, t);
    }
  }
}

// For each of nr rows holding a pair (row_pair >= 0; a padding row's gradient is zero already):
// the pair's gate gradient <g_r, a_r>, then g_r and (where tile is given) the row's tile row times
// the pair's gate. g_r is the row of grad_y b^T.
template <typename scalar_t>
void gate_rows(scalar_t* g, const scalar_t* a, scalar_t* tile, const int64_t* row_pair, const scalar_t* gates,
               scalar_t* grad_gates, int64_t nr, int64_t I, int64_t D) {
  using acc_t = at::opmath_type<scalar_t>;
  for (int64_t i = 0; i < nr; ++i) {
    const int64_t pair = row_pair[i];
    if (pair < 0) continue;
    grad_gates[pair] = static_cast<scalar_t>(dot_row(g + i * I, a + i * I, I));
    const acc_t w = static_cast<acc_t>(gates[pair]);
    scale_row(g + i * I, w, I);
    if (tile != nullptr) scale_row(tile + i * D, w, D);
  }
}

// The fused backward below keeps one slot's rows of the output gradient in a thread's tile: worth
// it while a tile stays in cache and no slot holds more than a thread's share of the rows (it
// gives each slot to one thread, where the unfused GEMMs split a sink slot across threads).
bool fuses_scatter_backward(const std::vector<int64_t>& start, int64_t row_bytes) {
  const int64_t busiest = busiest_range(start);
  return busiest > 0 && busiest * row_bytes <= g_fused_tile_bytes.load() &&
         busiest * at::get_num_threads() <= start.back();
}

// [E, D]: for each row, the row of src [N, D] of its pair's character (zeros for padding).
at::Tensor gathered_rows(const at::Tensor& src, const at::Tensor& row_pair, int64_t k) {
  const int64_t E = row_pair.size(0), D = src.size(1);
  at::Tensor out = empty_output({E, D}, src.options());
  MINAGI_DISPATCH_FLOATING(src.scalar_type(), "minagi_gathered_rows", [&] {
    at::parallel_for(0, E, std::max<int64_t>(1, 16384 / std::max<int64_t>(D, 1)), [&](int64_t r0, int64_t r1) {
      gather_pair_rows(out.data_ptr<scalar_t>() + r0 * D, src.data_ptr<scalar_t>(),
                       row_pair.data_ptr<int64_t>() + r0, r1 - r0, k, D);
    });
  });
  return out;
}

// scatter_mm_backward as whole-buffer passes: each row's character's grad_y gathered into [E, D],
// grad_y b^T by grouped_mm (a sink slot split over threads), the gates' gradient and the gate
// scaling row by row, then the weight gradient by grouped_mm_wgrad.
std::tuple<at::Tensor, at::Tensor, at::Tensor> scatter_mm_backward_unfused(
    const at::Tensor& grad_y, const at::Tensor& a, const at::Tensor& b, const at::Tensor& gates,
    const at::Tensor& slot_ids, const at::Tensor& slot_rows, const at::Tensor& row_pair, at::Tensor& grad_g,
    int64_t b_grad) {
  const int64_t E = a.size(0), I = a.size(1), D = b.size(2);
  at::Tensor dy = gathered_rows(grad_y, row_pair, grad_g.size(1));
  at::Tensor grad_a = grouped_mm_cpu(dy, b.transpose(1, 2), slot_ids, slot_rows);
  MINAGI_DISPATCH_FLOATING(a.scalar_type(), "minagi_scatter_mm_backward_rows", [&] {
    at::parallel_for(0, E, std::max<int64_t>(1, 4096 / std::max<int64_t>(I + D, 1)), [&](int64_t r0, int64_t r1) {
      gate_rows<scalar_t>(grad_a.data_ptr<scalar_t>() + r0 * I, a.data_ptr<scalar_t>() + r0 * I,
                          b_grad ? dy.data_ptr<scalar_t>() + r0 * D : nullptr, row_pair.data_ptr<int64_t>() + r0,
                          gates.data_ptr<scalar_t>(), grad_g.data_ptr<scalar_t>(), r1 - r0, I, D);
    });
  });
  at::Tensor grad_b = at::empty({0}, a.options());
  if (b_grad == 1) grad_b = grouped_mm_wgrad_cpu(a, dy, slot_ids, slot_rows, b.size(0));
  if (b_grad == 2) grad_b = grouped_mm_wgrad_cpu(dy, a, slot_ids, slot_rows, b.size(0));
  return {grad_a, grad_b, grad_g};
}

// The gradients of y = weighted_scatter(grouped_mm(a, b), dest, row_pair, gates) with respect to a,
// b and the gates, one slot's rows at a time on one thread. A row's output gradient (its
// character's grad_y, times its gate) is the gathered operand of both of the slot's GEMMs; here it
// lives in the thread's tile (in cache) where the unfused backward writes an [E, D] buffer and
// reads it three times (for a's gradient, b's, and the gates'). The gates' gradient comes from the
// I-wide rows, <a_r, grad_y b^T>, which equals <grad_y, a_r b>: the D-wide outputs need not be kept
// from the forward. grad_b: b_grad 1 gives [S, I, D], 2 the same transposed ([S, D, I], contiguous:
// the layout of a weight stored [S, D, I] and passed as its .mT view), 0 none ([0]).
std::tuple<at::Tensor, at::Tensor, at::Tensor> scatter_mm_backward_cpu(
    const at::Tensor& grad_y_in, const at::Tensor& a_in, const at::Tensor& b, const at::Tensor& gates_in,
    const at::Tensor& slot_ids, const at::Tensor& slot_rows, const at::Tensor& row_pair_in, const at::Tensor& dest,
    int64_t b_grad) {
  const char* op = "scatter_mm_backward";
  check_scatter_mm_backward_args(grad_y_in, a_in, b, gates_in, row_pair_in, dest, b_grad);
  const at::Tensor grad_y = grad_y_in.contiguous(), a = a_in.contiguous(), gates = gates_in.contiguous();
  const at::Tensor row_pair = row_pair_in.contiguous();
  const int64_t E = a.size(0), I = a.size(1), S = b.size(0), D = b.size(2), N = dest.size(0), k = dest.size(1);
  check_range_cpu(row_pair, -1, N * k, op, "row_pair");
  const auto start = range_starts(slot_ids, slot_rows, E, S, op, true);
  at::Tensor grad_g = at::zeros({N, k}, a.options());  // dropped pairs own no row: their gradient is 0
  if (!fuses_scatter_backward(start, D * a.element_size())) {
    return scatter_mm_backward_unfused(grad_y, a, b, gates, slot_ids, slot_rows, row_pair, grad_g, b_grad);
  }
  at::Tensor grad_a = empty_output({E, I}, a.options());
  const std::vector<int64_t> b_shape = b_grad == 2 ? std::vector<int64_t>{S, D, I} : std::vector<int64_t>{S, I, D};
  at::Tensor grad_b = b_grad ? empty_output(b_shape, a.options()) : at::empty({0}, a.options());
  const bool stream = grad_b.nbytes() >= kStreamBytes;
  // One part per slot, never split (its weight gradient is one GEMM over all its rows); largest
  // first. Slots that own no rows get a zero gradient, as parts of their own.
  const at::Tensor ids = slot_ids.contiguous();
  const int64_t* ip = ids.data_ptr<int64_t>();
  std::vector<Part> parts;
  std::vector<char> owned(S, 0);
  for (int64_t i = 0; i + 1 < static_cast<int64_t>(start.size()); ++i) {
    owned[ip[i]] = 1;
    parts.push_back({ip[i], start[i], start[i + 1] - start[i], 0, 1});
  }
  for (int64_t s = 0; s < S && b_grad; ++s) {
    if (!owned[s]) parts.push_back({s, 0, 0, 0, 1});
  }
  std::stable_sort(parts.begin(), parts.end(), [](const Part& x, const Part& y) { return x.nr > y.nr; });
  const at::Tensor b_t = b.transpose(1, 2);  // [S, D, I]
  MINAGI_DISPATCH_FLOATING(a.scalar_type(), "minagi_scatter_mm_backward", [&] {
    const scalar_t* gy = grad_y.data_ptr<scalar_t>();
    const scalar_t* ap = a.data_ptr<scalar_t>();
    const scalar_t* gp = gates.data_ptr<scalar_t>();
    const int64_t* rp = row_pair.data_ptr<int64_t>();
    scalar_t* ga = grad_a.data_ptr<scalar_t>();
    scalar_t* gg = grad_g.data_ptr<scalar_t>();
    scalar_t* gb = b_grad ? grad_b.data_ptr<scalar_t>() : nullptr;
    run_parts(parts, [&](const Part& p) {
      if (p.nr == 0) {
        if (b_grad) std::fill(gb + p.slot * I * D, gb + (p.slot + 1) * I * D, scalar_t(0));
        return;
      }
      std::vector<scalar_t> own;
      scalar_t* tile = thread_scratch<scalar_t>(p.nr * D, own);
      gather_pair_rows(tile, gy, rp + p.r0, p.nr, k, D);  // each row's character's grad_y
      slot_mm<scalar_t>(tile, b_t, p.slot, ga + p.r0 * I, p.nr);  // grad_y b^T: [nr, I]
      gate_rows<scalar_t>(ga + p.r0 * I, ap + p.r0 * I, b_grad ? tile : nullptr, rp + p.r0, gp, gg, p.nr, I, D);
      if (b_grad == 0) return;
      const RawMat a_rows{const_cast<scalar_t*>(ap) + p.r0 * I, p.nr, I, I}, tile_m{tile, p.nr, D, D};
      if (b_grad == 1) {
        wgrad_mm(a.scalar_type(), {gb + p.slot * I * D, I, D, D}, a_rows, tile_m, stream);  // [I, nr] x [nr, D]
      } else {
        wgrad_mm(a.scalar_type(), {gb + p.slot * I * D, D, I, I}, tile_m, a_rows, stream);  // [D, nr] x [nr, I]
      }
    });
  });
  zero_tail(grad_a, start.back());
  return {grad_a, grad_b, grad_g};
}

at::Tensor grouped_mm_scatter_cpu(const at::Tensor& a, const at::Tensor& b, const at::Tensor& gates,
                                  const at::Tensor& slot_ids, const at::Tensor& slot_rows, const at::Tensor& row_pair,
                                  const at::Tensor& dest) {
  static const auto scatter = c10::Dispatcher::singleton()
                                  .findSchemaOrThrow("minagi::weighted_scatter", "")
                                  .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                                    const c10::optional<at::Tensor>&)>();
  return scatter.call(grouped_mm_cpu(a, b, slot_ids, slot_rows), dest, row_pair, gates);
}

// The activation of grouped_mm_act(bucketed_gather(x, row_pair, dest), b, bias, ...) without its
// two [E, ...] buffers: each row's character's x (zeros for a padding row) is copied into the
// thread's tile, multiplied there, and only the activation is written out. The unfused forward
// writes the gathered rows and h to memory and reads both back; in inference neither is kept.
at::Tensor gather_mm_act_cpu(const at::Tensor& x_in, const at::Tensor& b, const c10::optional<at::Tensor>& bias_in,
                             const at::Tensor& slot_ids, const at::Tensor& slot_rows, const at::Tensor& row_pair_in,
                             const at::Tensor& dest, c10::string_view activation, double alpha, double limit) {
  const char* op = "gather_mm_act";
  const Act act = check_grouped_mm_act_args(x_in, b, bias_in, std::string(activation), op, "x");
  check_plan_maps(dest, row_pair_in, op);
  check_same_device(x_in, dest, op, "x", "dest");
  check_size(dest, 0, x_in.size(0), op, "dest", "x.shape[0]");
  const at::Tensor x = x_in.contiguous(), row_pair = row_pair_in.contiguous();
  const int64_t E = row_pair.size(0), D = x.size(1), M = b.size(2), k = dest.size(1);
  check_range_cpu(row_pair, -1, x.size(0) * k, op, "row_pair");
  const auto start = range_starts(slot_ids, slot_rows, E, b.size(0), op, false, "row_pair");
  const int64_t tile_bytes = g_gather_tile_bytes.load();
  if (busiest_range(start) * (D + M) * x.element_size() > tile_bytes) {
    // A slot too large for a tile (hundreds of rows of a wide layer): its rows gathered whole and
    // multiplied by one GEMM, as grouped_mm_act does.
    const at::Tensor buf = gathered_rows(x, row_pair, k);
    return std::get<1>(grouped_mm_act_cpu(buf, b, bias_in, slot_ids, slot_rows, activation, alpha, limit));
  }
  at::Tensor out = empty_output({E, act_gated(act) ? M / 2 : M}, x.options());
  const at::Tensor bias = bias_in.has_value() ? bias_in->contiguous() : at::Tensor();
  const auto parts = plan_parts(slot_ids.contiguous(), start, at::get_num_threads());
  const int64_t chunk = std::max<int64_t>(8, tile_bytes / std::max<int64_t>(1, (D + M) * x.element_size()));
  MINAGI_DISPATCH_FLOATING(x.scalar_type(), "minagi_gather_mm_act", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    const int64_t* rp = row_pair.data_ptr<int64_t>();
    run_parts(parts, [&](const Part& p) {
      const auto [lo, hi] = part_range(p.nr, p.part, p.parts, 8);
      for (int64_t c0 = lo; c0 < hi; c0 += chunk) {
        const int64_t r0 = p.r0 + c0, nr = std::min(chunk, hi - c0);
        std::vector<scalar_t> own;
        scalar_t* tile = thread_scratch<scalar_t>(nr * (D + M), own);
        scalar_t* h = tile + nr * D;
        gather_pair_rows(tile, xp, rp + r0, nr, k, D);
        slot_mm<scalar_t>(tile, b, p.slot, h, nr, bias.defined() ? bias.data_ptr<scalar_t>() + p.slot * M : nullptr);
        act_forward(act, at::from_blob(h, {nr, M}, x.options()), out.narrow(0, r0, nr), alpha, limit);
      }
    });
  });
  zero_tail(out, start.back());
  return out;
}

Act check_decode_experts_args(const at::Tensor& x, const at::Tensor& slot_idx, const at::Tensor& gates,
                              const at::Tensor& w_in, const at::Tensor& w_out, const c10::optional<at::Tensor>& b_in,
                              const c10::optional<at::Tensor>& b_out, const std::string& activation) {
  const char* op = "decode_experts";
  check_dim(x, 2, op, "x");
  check_floating(x, op, "x");
  check_dim(w_in, 3, op, "w_in");
  check_dim(w_out, 3, op, "w_out");
  check_dim(slot_idx, 2, op, "slot_idx");
  check_index(slot_idx, op, "slot_idx");
  const Act act = parse_act(activation, op);
  const int64_t S = w_in.size(0), D = x.size(1), M = w_in.size(2), H = act_gated(act) ? M / 2 : M;
  TORCH_CHECK(!act_gated(act) || M % 2 == 0, "minagi.decode_experts: the gated form '", activation,
              "' needs an even width of w_in (gate and up, 2H), got shape ", w_in.sizes());
  check_size(w_in, 1, D, op, "w_in", "x.shape[1]");
  TORCH_CHECK(w_out.size(0) == S && w_out.size(1) == H && w_out.size(2) == D, "minagi.decode_experts: w_out must be ",
              "[S, H, D] = [", S, ", ", H, ", ", D, "] for x ", x.sizes(), " and w_in ", w_in.sizes(), ", got ",
              w_out.sizes());
  check_size(slot_idx, 0, x.size(0), op, "slot_idx", "x.shape[0]");
  TORCH_CHECK(gates.sizes() == slot_idx.sizes(), "minagi.decode_experts: gates must have slot_idx's shape ",
              slot_idx.sizes(), ", got ", gates.sizes());
  const std::pair<const char*, const c10::optional<at::Tensor>*> biases[] = {{"b_in", &b_in}, {"b_out", &b_out}};
  for (const auto& [name, bias] : biases) {
    if (!bias->has_value()) continue;
    const int64_t width = bias == &b_in ? M : D;
    TORCH_CHECK((*bias)->dim() == 2 && (*bias)->size(0) == S && (*bias)->size(1) == width, "minagi.decode_experts: ",
                name, " must be [", S, ", ", width, "], got shape ", (*bias)->sizes());
    check_same_dtype(x, **bias, op, "x", name);
    check_same_device(x, **bias, op, "x", name);
  }
  for (const auto& [name, t] : {std::pair<const char*, const at::Tensor*>{"gates", &gates}, {"w_in", &w_in},
                                {"w_out", &w_out}}) {
    check_same_dtype(x, *t, op, "x", name);
    check_same_device(x, *t, op, "x", name);
  }
  check_same_device(x, slot_idx, op, "x", "slot_idx");
  return act;
}

// decode_experts (csrc/ops.cpp): the unfused decode's ten or so dispatched ops (plan, gather, two
// GEMMs, scatter, bias) cost more than the GEMMs' own time at 1 character. Here the plan is a sort
// of the pairs (at most 32 where dispatch calls it), both layers go through grouped_mm_into (the
// few-row kernels, their threads' split, the bias and activation as in grouped_mm_act; b_out added
// to each pair's output), and each character's gated sum is one row in the accumulation type.
at::Tensor decode_experts_cpu(const at::Tensor& x_in, const at::Tensor& slot_idx_in, const at::Tensor& gates_in,
                              const at::Tensor& w_in, const at::Tensor& w_out,
                              const c10::optional<at::Tensor>& b_in_opt, const c10::optional<at::Tensor>& b_out_opt,
                              c10::string_view activation, double alpha, double limit) {
  const at::Tensor x = x_in.contiguous();
  const Act act = check_decode_experts_args(x, slot_idx_in, gates_in, w_in, w_out, b_in_opt, b_out_opt,
                                            std::string(activation));
  const at::Tensor idx = slot_idx_in.contiguous(), gates = gates_in.contiguous();
  const int64_t N = x.size(0), D = x.size(1), K = idx.size(1), E = N * K, M = w_in.size(2);
  check_slot_ids_cpu(idx, w_in.size(0));
  const int64_t* ip = idx.data_ptr<int64_t>();
  std::vector<int64_t> pair(E);  // buffer row -> its pair, sorted by slot
  std::iota(pair.begin(), pair.end(), int64_t{0});
  std::stable_sort(pair.begin(), pair.end(), [&](int64_t p, int64_t q) { return ip[p] < ip[q]; });
  std::vector<int64_t> ids, start{0}, dest(E);
  for (int64_t e = 0; e < E; ++e) {
    dest[pair[e]] = e;
    if (e > 0 && ip[pair[e]] != ip[pair[e - 1]]) start.push_back(e);
    if (e == 0 || ip[pair[e]] != ip[pair[e - 1]]) ids.push_back(ip[pair[e]]);
  }
  if (E > 0) start.push_back(E);
  const at::Tensor slot_ids = at::tensor(ids, idx.options());
  const at::Tensor b_in = b_in_opt.has_value() ? b_in_opt->contiguous() : at::Tensor();
  const at::Tensor b_out = b_out_opt.has_value() ? b_out_opt->contiguous() : at::Tensor();
  at::Tensor y = at::empty({N, D}, x.options());
  if (E == 0) return y.zero_();
  at::Tensor a = at::empty({E, D}, x.options());
  at::Tensor h = at::empty({E, M}, x.options());
  at::Tensor hact = at::empty({E, act_gated(act) ? M / 2 : M}, x.options());
  at::Tensor out = at::empty({E, D}, x.options());
  MINAGI_DISPATCH_FLOATING(x.scalar_type(), "minagi_decode_experts", [&] {
    gather_pair_rows(a.data_ptr<scalar_t>(), x.data_ptr<scalar_t>(), pair.data(), E, K, D);
  });
  grouped_mm_into(a, w_in, b_in, slot_ids, start, h, [&](int64_t r0, int64_t nr) {
    act_forward(act, h.narrow(0, r0, nr), hact.narrow(0, r0, nr), alpha, limit);
  });
  grouped_mm_into(hact, w_out, b_out, slot_ids, start, out, [](int64_t, int64_t) {});
  MINAGI_DISPATCH_FLOATING(x.scalar_type(), "minagi_decode_experts", [&] {
    std::vector<at::opmath_type<scalar_t>> acc(D);
    for (int64_t n = 0; n < N; ++n) {
      gated_row_sum(y.data_ptr<scalar_t>() + n * D, out.data_ptr<scalar_t>(), dest.data() + n * K,
                    gates.data_ptr<scalar_t>() + n * K, K, D, acc.data());
    }
  });
  return y;
}

}  // namespace

// torch.ops.minagi.tile_bytes (csrc/ops.cpp): a fused kernel's tile size, "gather" or "fused";
// value >= 0 sets it. Returns the size before.
int64_t tile_bytes(c10::string_view name, int64_t value) {
  std::atomic<int64_t>* size = name == "gather" ? &g_gather_tile_bytes : name == "fused" ? &g_fused_tile_bytes : nullptr;
  TORCH_CHECK_VALUE(size != nullptr, "minagi.tile_bytes: name must be 'gather' or 'fused', got '", std::string(name),
                    "'");
  return value >= 0 ? size->exchange(value) : size->load();
}

TORCH_LIBRARY_IMPL(minagi, CPU, m) {
  m.impl("grouped_mm", &grouped_mm_cpu);
  m.impl("grouped_mm_wgrad", &grouped_mm_wgrad_cpu);
  m.impl("grouped_mm_act", &grouped_mm_act_cpu);
  m.impl("expert_act_backward", &expert_act_backward_cpu);
  m.impl("scatter_mm_backward", &scatter_mm_backward_cpu);
  m.impl("grouped_mm_scatter", &grouped_mm_scatter_cpu);
  m.impl("gather_mm_act", &gather_mm_act_cpu);
  m.impl("decode_experts", &decode_experts_cpu);
}

}  // namespace minagi
