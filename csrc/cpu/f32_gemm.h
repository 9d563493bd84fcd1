// One slot's float32 GEMM on AVX-512 FMAs, without a call into ATen. ATen's mm goes to MKL's sgemm,
// which is slower at the slots' small shapes (32-128 rows), and torch.bmm over all experts no
// faster. Here the products come from a column block packed in the thread's cache, 8 rows at a
// time: the packing is one pass over 32 columns, and a block's next one is prefetched while it is
// used (figures: docs/log/2026-12-05-float32-gemm-kernel.md).
//
// Built for the baseline ISA like the rest (no -march=native): the functions carry a target
// attribute, and callers ask avx512_available() (CPUID, once) before calling them.
#pragma once

#include <algorithm>
#include <cstdint>

#include "isa.h"

#if defined(__x86_64__) && !defined(_WIN32) && \
    ((defined(__clang__) && __clang_major__ >= 8) || (!defined(__clang__) && defined(__GNUC__) && __GNUC__ >= 8))
#define MINAGI_AVX512 1
#include <immintrin.h>
// GCC's AVX-512 headers trip -W(maybe-)uninitialized on their own _mm512_undefined_* values.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#if !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
#endif

namespace minagi {

// A packed column block is re-read for every 8 rows and the kernels do not block over the inner
// dimension: past this inner size (512 KiB a block) it would leave the L2 cache, and ATen's mm
// (which blocks) is taken instead. A weight gradient's inner dimension is its slot's rows.
constexpr int64_t kF32MaxInner = 4096;

#ifdef MINAGI_AVX512

inline bool avx512_available() {
  static const bool ok = !cpu_baseline_only() && __builtin_cpu_supports("avx512f");
  return ok;
}

#define MINAGI_AVX512_TARGET __attribute__((target("avx512f")))

// r[i] <- column i of the 16 x 16 matrix of 32-bit words whose rows were r[0..15].
MINAGI_AVX512_TARGET __attribute__((always_inline)) inline void transpose16(__m512 r[16]) {
  __m512 t[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {
    const __m512d a = _mm512_castps_pd(t[4 * i]), b = _mm512_castps_pd(t[4 * i + 2]);
    const __m512d c = _mm512_castps_pd(t[4 * i + 1]), d = _mm512_castps_pd(t[4 * i + 3]);
    r[4 * i] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, b));
    r[4 * i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, b));
    r[4 * i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(c, d));
    r[4 * i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(c, d));
  }
  for (int i = 0; i < 4; ++i) {
    t[i] = _mm512_shuffle_f32x4(r[i], r[i + 4], 0x88);
    t[i + 4] = _mm512_shuffle_f32x4(r[i], r[i + 4], 0xdd);
    t[i + 8] = _mm512_shuffle_f32x4(r[i + 8], r[i + 12], 0x88);
    t[i + 12] = _mm512_shuffle_f32x4(r[i + 8], r[i + 12], 0xdd);
  }
  for (int i = 0; i < 8; ++i) {
    r[i] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0x88);
    r[i + 8] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0xdd);
  }
}

// Where a column block [n0, n0 + nn) of b lies (b[k, n] at b + (k * sk + n * sn) elements of `elem`
// bytes, sk == 1 or sn == 1), as "units" of contiguous values: K rows of nn values, or nn columns
// of K values. The GEMM kernels prefetch a block's cache lines a few at a time while the block
// before it is in use: from memory, a block arrives in about the time its tiles take.
struct Source {
  const char* p = nullptr;
  int64_t unit_stride = 0, unit_lines = 0, units = 0;
  int64_t lines() const { return units * unit_lines; }
  const char* line(int64_t q) const { return p + (q / unit_lines) * unit_stride + (q % unit_lines) * 64; }
};

inline Source block_source(const void* b, int64_t elem, int64_t sk, int64_t sn, int64_t K, int64_t n0, int64_t nn) {
  if (nn <= 0) return {};
  const char* p = static_cast<const char*>(b);
  if (sk == 1) return {p + n0 * sn * elem, sn * elem, (K * elem + 63) / 64, nn};
  return {p + n0 * elem, sk * elem, (nn * elem + 63) / 64, K};
}

// Lines [q0, q1) of a Source spread over a loop of n steps: the loop runs in chunks() chunks, and
// before chunk c issue(c) prefetches its share of the lines. (A branch on every step inside the
// loop kept GCC from holding the accumulators in registers.)
struct Prefetch {
  const Source& src;
  int64_t q, q1, n_chunks, per;
  Prefetch(const Source& s, int64_t q0, int64_t q1_, int64_t n)
      : src(s), q(q0), q1(q1_), n_chunks(std::max<int64_t>(1, std::min(n, q1_ - q0))),
        per((q1_ - q0 + n_chunks - 1) / n_chunks) {}
  int64_t chunks() const { return n_chunks; }
  void issue() {
    for (int64_t i = 0; i < per && q < q1; ++i) _mm_prefetch(src.line(q++), _MM_HINT_T0);
  }
};

// Whether a tile's rows of out go straight to memory (non-temporal stores): asked for (a weight
// gradient too large to stay in cache, whose lines then are not read for ownership first, about a
// fifth of such a GEMM's time from memory), the tile a whole column block (a partial block's
// stores would cover columns past it), and its rows whole aligned 64-byte lines.
inline bool stream_rows(bool stream, bool whole_block, const void* out, int64_t row_bytes, int64_t ldo_bytes) {
  return stream && whole_block && row_bytes % 64 == 0 && ldo_bytes % 64 == 0 &&
         reinterpret_cast<uintptr_t>(out) % 64 == 0;
}

namespace f32_fma {

constexpr int64_t kCols = 32;  // output columns per block: two zmm accumulators a row
constexpr int64_t kRows = 8;   // rows per micro-tile: 16 accumulators

inline __mmask16 lanes(int64_t n) { return n >= 16 ? __mmask16(0xFFFF) : n <= 0 ? 0 : __mmask16((1u << n) - 1); }

// Columns [n0, n0 + nn) of b into out[k * 32 + c] = b[k, n0 + c], zero past nn.
MINAGI_AVX512_TARGET inline void pack_block(const float* b, int64_t sk, int64_t sn, int64_t K, int64_t n0,
                                            int64_t nn, float* out) {
  if (sk == 1) {  // a column's K values are contiguous: transpose 16 x 16 tiles
    for (int64_t h = 0; h < kCols; h += 16) {
      const int64_t m = std::max<int64_t>(0, std::min<int64_t>(16, nn - h));
      for (int64_t k0 = 0; k0 < K; k0 += 16) {
        const int64_t q = std::min<int64_t>(16, K - k0);
        __m512 r[16];
        for (int64_t i = 0; i < 16; ++i) {
          r[i] = i < m ? _mm512_maskz_loadu_ps(lanes(q), b + (n0 + h + i) * sn + k0) : _mm512_setzero_ps();
        }
        transpose16(r);
        for (int64_t j = 0; j < q; ++j) _mm512_storeu_ps(out + (k0 + j) * kCols + h, r[j]);
      }
    }
    return;
  }
  const __mmask16 m0 = lanes(nn), m1 = lanes(nn - 16);
  for (int64_t k = 0; k < K; ++k) {
    _mm512_storeu_ps(out + k * kCols, _mm512_maskz_loadu_ps(m0, b + k * sk + n0));
    _mm512_storeu_ps(out + k * kCols + 16, _mm512_maskz_loadu_ps(m1, b + k * sk + n0 + 16));
  }
}

// R rows of a times one packed block (nn columns of out, rows ldo apart); row r's value k is at
// a + r * ra + k * pa (a row-major a: ra = lda, pa = 1; a weight gradient's x^T: ra = 1, pa = ldx).
// Prefetches lines [q0, q1) of `next` along the way.
template <int R>
MINAGI_AVX512_TARGET inline void micro(const float* a, int64_t ra, int64_t pa, const float* pb, int64_t K, float* out,
                                       int64_t ldo, int64_t nn, const Source& next, int64_t q0, int64_t q1,
                                       bool stream, const float* bias) {
  __m512 acc[R][2];
  const __m512 c0 = bias ? _mm512_loadu_ps(bias) : _mm512_setzero_ps();
  const __m512 c1 = bias ? _mm512_loadu_ps(bias + 16) : _mm512_setzero_ps();
  for (int r = 0; r < R; ++r) acc[r][0] = c0, acc[r][1] = c1;
  Prefetch pf(next, q0, q1, K);
  for (int64_t c = 0, C = pf.chunks(); c < C; ++c) {
    pf.issue();
    for (int64_t k = c * K / C, k1 = (c + 1) * K / C; k < k1; ++k) {
      const __m512 b0 = _mm512_loadu_ps(pb + k * kCols), b1 = _mm512_loadu_ps(pb + k * kCols + 16);
      const float* ak = a + k * pa;
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const __m512 av = _mm512_set1_ps(ak[r * ra]);
        acc[r][0] = _mm512_fmadd_ps(av, b0, acc[r][0]);
        acc[r][1] = _mm512_fmadd_ps(av, b1, acc[r][1]);
      }
    }
  }
  if (stream_rows(stream, nn == kCols, out, kCols * 4, ldo * 4)) {
    for (int r = 0; r < R; ++r) {
      _mm512_stream_ps(out + r * ldo, acc[r][0]);
      _mm512_stream_ps(out + r * ldo + 16, acc[r][1]);
    }
    return;
  }
  const __mmask16 m0 = lanes(nn), m1 = lanes(nn - 16);
  for (int r = 0; r < R; ++r) {
    _mm512_mask_storeu_ps(out + r * ldo, m0, acc[r][0]);
    _mm512_mask_storeu_ps(out + r * ldo + 16, m1, acc[r][1]);
  }
}

template <int R>
MINAGI_AVX512_TARGET inline void rows_tail(const float* a, int64_t ra, int64_t pa, const float* pb, int64_t K,
                                           float* out, int64_t ldo, int64_t nn, int64_t left, const Source& next,
                                           int64_t q0, int64_t q1, bool stream, const float* bias) {
  if constexpr (R > 0) {
    if (left == R) return micro<R>(a, ra, pa, pb, K, out, ldo, nn, next, q0, q1, stream, bias);
    rows_tail<R - 1>(a, ra, pa, pb, K, out, ldo, nn, left, next, q0, q1, stream, bias);
  }
}

}  // namespace f32_fma

// out[nr, N] (rows ldo apart) = a x b, with a's row r value k at a + r * ra + k * pa and b[k, n] at
// b + k * sk + n * sn (sk == 1 or sn == 1). Each output is one sequential sum over k, whatever nr
// and the caller's split of rows or columns. scratch holds K * 32 floats. With `stream` (see
// stream_rows) whole aligned blocks of out are written past the cache. A bias (N values, or null)
// starts every row's sums, so it costs no pass of its own over out.
MINAGI_AVX512_TARGET inline void f32_gemm(const float* a, int64_t ra, int64_t pa, const float* b, int64_t sk,
                                          int64_t sn, float* out, int64_t ldo, int64_t nr, int64_t K, int64_t N,
                                          float* scratch, bool stream = false, const float* bias = nullptr) {
  using namespace f32_fma;
  const int64_t tiles = (nr + kRows - 1) / kRows;
  alignas(64) float bias_blk[kCols];
  for (int64_t n0 = 0; n0 < N; n0 += kCols) {
    const int64_t nn = std::min(kCols, N - n0);
    pack_block(b, sk, sn, K, n0, nn, scratch);
    if (bias) {
      _mm512_store_ps(bias_blk, _mm512_maskz_loadu_ps(lanes(nn), bias + n0));
      _mm512_store_ps(bias_blk + 16, _mm512_maskz_loadu_ps(lanes(nn - 16), bias + n0 + 16));
    }
    const float* blk_bias = bias ? bias_blk : nullptr;
    const Source next = block_source(b, 4, sk, sn, K, n0 + kCols, std::min(kCols, N - n0 - kCols));
    const int64_t Q = next.lines();
    for (int64_t t = 0; t < tiles; ++t) {  // the next block's lines spread over this block's tiles
      const int64_t r = t * kRows, q0 = t * Q / tiles, q1 = (t + 1) * Q / tiles;
      if (r + kRows <= nr) {
        micro<kRows>(a + r * ra, ra, pa, scratch, K, out + r * ldo + n0, ldo, nn, next, q0, q1, stream, blk_bias);
      } else {
        rows_tail<kRows - 1>(a + r * ra, ra, pa, scratch, K, out + r * ldo + n0, ldo, nn, nr - r, next, q0, q1,
                             stream, blk_bias);
      }
    }
  }
  if (stream) _mm_sfence();  // the streamed lines are visible before whatever reads them next
}

#pragma GCC diagnostic pop

#else

inline bool avx512_available() { return false; }

#endif

}  // namespace minagi
