// One slot's bfloat16 GEMM on AVX512-BF16's pair dot product (vdpbf16ps), without a call into
// ATen. In bfloat16 ATen's mm goes to oneDNN, which builds a primitive descriptor on every call,
// paid once per slot per GEMM: thousands of times a step over many experts. This kernel packs the
// slot's weights into pairs (one column block at a time, in the thread's cache) and runs the rows
// over them (the figures: docs/log/2026-12-05-bfloat16-gemm-kernel.md).
//
// Built for the baseline ISA like the rest (no -march=native): the functions carry a target
// attribute, and callers ask bf16_dot_available() (CPUID, once) before calling them.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "f32_gemm.h"  // transpose16
#include "isa.h"

// GCC 11 and clang 12 know both the avx512bf16 target and its CPUID name.
#if defined(__x86_64__) && !defined(_WIN32) && \
    ((defined(__clang__) && __clang_major__ >= 12) || (!defined(__clang__) && defined(__GNUC__) && __GNUC__ >= 11))
#define MINAGI_BF16_DOT 1
#include <immintrin.h>
// GCC 12's AVX-512 headers trip -Wmaybe-uninitialized on their own _mm512_undefined_* values.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif

namespace minagi {

// The kernels do not block over the inner dimension: a packed column block is re-read for every 8
// rows, so past this inner size (256 KiB a block) it would leave the L2 cache; ATen's mm (oneDNN,
// which blocks) is taken there, its set-up cost small beside such a product. A weight gradient
// packs its whole right operand, so it is also bounded by kBf16DotMaxScratch bytes.
constexpr int64_t kBf16DotMaxInner = 4096;
constexpr int64_t kBf16DotMaxScratch = int64_t{16} << 20;

#ifdef MINAGI_BF16_DOT

inline bool bf16_dot_available() {
  static const bool ok = !cpu_baseline_only() && __builtin_cpu_supports("avx512f") &&
                         __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
                         __builtin_cpu_supports("avx512dq") &&
                         __builtin_cpu_supports("avx512bf16");
  return ok;
}

#define MINAGI_BF16_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")))

namespace bf16_dot {

constexpr int64_t kCols = 32;  // output columns per block: two zmm of float32 accumulators
constexpr int64_t kRows = 8;   // rows per micro-tile: 16 accumulators

// One column block's weights for K pairs: the scratch a thread needs (bf16 elements).
inline int64_t block_elems(int64_t K) { return ((K + 1) / 2) * kCols * 2; }

inline int64_t ceil_blocks(int64_t N) { return (N + kCols - 1) / kCols; }

// Columns [n0, n0 + nn) of b (b[k, n] at b + k * sk + n * sn, with sk == 1 or sn == 1) into pairs:
// out[p * 64 + c * 2 + j] = b[2p + j, n0 + c], zero past K and past nn.
MINAGI_BF16_TARGET inline void pack_block(const uint16_t* b, int64_t sk, int64_t sn, int64_t K, int64_t n0,
                                          int64_t nn, uint16_t* out) {
  const int64_t KP = (K + 1) / 2, full = K / 2;
  if (sk == 1) {  // a column's K values are contiguous, so a pair is one 32-bit word: transpose words
    uint32_t* dst = reinterpret_cast<uint32_t*>(out);
    for (int64_t h = 0; h < kCols; h += 16) {
      const int64_t m = std::max<int64_t>(0, std::min<int64_t>(16, nn - h));
      for (int64_t p0 = 0; p0 < full; p0 += 16) {
        const int64_t q = std::min<int64_t>(16, full - p0);
        const __mmask32 lm = q >= 16 ? 0xFFFFFFFFu : static_cast<__mmask32>((1ull << (2 * q)) - 1);
        __m512 r[16];
        for (int64_t i = 0; i < 16; ++i) {
          r[i] = i < m ? _mm512_castsi512_ps(_mm512_maskz_loadu_epi16(lm, b + (n0 + h + i) * sn + 2 * p0))
                       : _mm512_setzero_ps();
        }
        transpose16(r);
        for (int64_t j = 0; j < q; ++j) _mm512_storeu_ps(reinterpret_cast<float*>(dst + (p0 + j) * kCols + h), r[j]);
      }
      if (K & 1) {  // the last value, paired with zero
        for (int64_t i = 0; i < 16; ++i) {
          out[(full * kCols + h + i) * 2] = i < m ? b[(n0 + h + i) * sn + (K - 1)] : 0;
          out[(full * kCols + h + i) * 2 + 1] = 0;
        }
      }
    }
    return;
  }
  // A row's columns are contiguous: interleave rows 2p and 2p + 1.
  const __m512i lo = _mm512_setr_epi32(0x00200000, 0x00210001, 0x00220002, 0x00230003, 0x00240004, 0x00250005,
                                       0x00260006, 0x00270007, 0x00280008, 0x00290009, 0x002A000A, 0x002B000B,
                                       0x002C000C, 0x002D000D, 0x002E000E, 0x002F000F);
  const __m512i hi = _mm512_add_epi16(lo, _mm512_set1_epi16(16));
  const __mmask32 mask = nn >= kCols ? 0xFFFFFFFFu : static_cast<__mmask32>((1ull << nn) - 1);
  for (int64_t p = 0; p < KP; ++p) {
    const __m512i r0 = _mm512_maskz_loadu_epi16(mask, b + 2 * p * sk + n0);
    const __m512i r1 =
        2 * p + 1 < K ? _mm512_maskz_loadu_epi16(mask, b + (2 * p + 1) * sk + n0) : _mm512_setzero_si512();
    _mm512_storeu_si512(out + p * kCols * 2, _mm512_permutex2var_epi16(r0, lo, r1));
    _mm512_storeu_si512(out + p * kCols * 2 + 32, _mm512_permutex2var_epi16(r0, hi, r1));
  }
}

// R rows of a times one packed column block: nn columns of out (rows ldo apart). Row r's pair p
// (its values 2p and 2p + 1) is the 32-bit word at a + r * ra + p * pa: a row-major a has ra = lda,
// pa = 2; an a packed by pack_block (the weight gradient's transposed operand) has ra = 2, pa = 64.
template <int R>
MINAGI_BF16_TARGET inline void micro(const uint16_t* a, int64_t ra, int64_t pa, const uint16_t* pb, int64_t K,
                                     uint16_t* out, int64_t ldo, int64_t nn, const Source& next, int64_t q0,
                                     int64_t q1, bool stream, const float* bias) {
  __m512 acc[R][2];
  const __m512 c0 = bias ? _mm512_loadu_ps(bias) : _mm512_setzero_ps();
  const __m512 c1 = bias ? _mm512_loadu_ps(bias + 16) : _mm512_setzero_ps();
  for (int r = 0; r < R; ++r) acc[r][0] = c0, acc[r][1] = c1;
  const int64_t full = K / 2;
  Prefetch pf(next, q0, q1, full);
  for (int64_t c = 0, C = pf.chunks(); c < C; ++c) {
    pf.issue();
    for (int64_t p = c * full / C, p1 = (c + 1) * full / C; p < p1; ++p) {
      const __m512bh b0 = (__m512bh)_mm512_loadu_si512(pb + p * kCols * 2);
      const __m512bh b1 = (__m512bh)_mm512_loadu_si512(pb + p * kCols * 2 + 32);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        int32_t w;
        std::memcpy(&w, a + r * ra + p * pa, sizeof(w));
        const __m512bh av = (__m512bh)_mm512_set1_epi32(w);
        acc[r][0] = _mm512_dpbf16_ps(acc[r][0], av, b0);
        acc[r][1] = _mm512_dpbf16_ps(acc[r][1], av, b1);
      }
    }
  }
  if (K & 1) {  // the last value, paired with zero
    const __m512bh b0 = (__m512bh)_mm512_loadu_si512(pb + full * kCols * 2);
    const __m512bh b1 = (__m512bh)_mm512_loadu_si512(pb + full * kCols * 2 + 32);
    for (int r = 0; r < R; ++r) {
      const __m512bh av = (__m512bh)_mm512_set1_epi32(static_cast<int32_t>(a[r * ra + full * pa]));
      acc[r][0] = _mm512_dpbf16_ps(acc[r][0], av, b0);
      acc[r][1] = _mm512_dpbf16_ps(acc[r][1], av, b1);
    }
  }
  // round to nearest even (denormals flush to zero, as in vdpbf16ps itself)
  if (stream_rows(stream, nn == kCols, out, kCols * 2, ldo * 2)) {
    for (int r = 0; r < R; ++r) {
      _mm512_stream_si512(reinterpret_cast<__m512i*>(out + r * ldo),
                          (__m512i)_mm512_cvtne2ps_pbh(acc[r][1], acc[r][0]));
    }
    return;
  }
  const __mmask32 mask = nn >= kCols ? 0xFFFFFFFFu : static_cast<__mmask32>((1ull << nn) - 1);
  for (int r = 0; r < R; ++r) {
    _mm512_mask_storeu_epi16(out + r * ldo, mask, (__m512i)_mm512_cvtne2ps_pbh(acc[r][1], acc[r][0]));
  }
}

template <int R>
MINAGI_BF16_TARGET inline void rows_tail(const uint16_t* a, int64_t ra, int64_t pa, const uint16_t* pb, int64_t K,
                                         uint16_t* out, int64_t ldo, int64_t nn, int64_t left, const Source& next,
                                         int64_t q0, int64_t q1, bool stream, const float* bias) {
  if constexpr (R > 0) {
    if (left == R) return micro<R>(a, ra, pa, pb, K, out, ldo, nn, next, q0, q1, stream, bias);
    rows_tail<R - 1>(a, ra, pa, pb, K, out, ldo, nn, left, next, q0, q1, stream, bias);
  }
}

// nr rows of a (addressed as in micro) times one packed column block, prefetching `next`'s lines
// spread over the tiles.
MINAGI_BF16_TARGET inline void rows_times_block(const uint16_t* a, int64_t ra, int64_t pa, const uint16_t* pb,
                                                int64_t K, uint16_t* out, int64_t ldo, int64_t nr, int64_t nn,
                                                const Source& next = Source{}, bool stream = false,
                                                const float* bias = nullptr) {
  const int64_t tiles = (nr + kRows - 1) / kRows, Q = next.lines();
  for (int64_t t = 0; t < tiles; ++t) {
    const int64_t r = t * kRows, q0 = t * Q / tiles, q1 = (t + 1) * Q / tiles;
    if (r + kRows <= nr) {
      micro<kRows>(a + r * ra, ra, pa, pb, K, out + r * ldo, ldo, nn, next, q0, q1, stream, bias);
    } else {
      rows_tail<kRows - 1>(a + r * ra, ra, pa, pb, K, out + r * ldo, ldo, nn, nr - r, next, q0, q1, stream, bias);
    }
  }
}

}  // namespace bf16_dot

// out[nr, N] (rows ldo apart) = a[nr, K] (rows lda apart) x b, b[k, n] at b + k * sk + n * sn with
// sk == 1 or sn == 1; float32 accumulation (from the bias, N values or null), rounded once. scratch
// holds bf16_dot::block_elems(K).
MINAGI_BF16_TARGET inline void bf16_dot_gemm(const uint16_t* a, int64_t lda, const uint16_t* b, int64_t sk, int64_t sn,
                                             uint16_t* out, int64_t ldo, int64_t nr, int64_t K, int64_t N,
                                             uint16_t* scratch, const uint16_t* bias = nullptr) {
  using namespace bf16_dot;
  alignas(64) float bias_blk[kCols];
  for (int64_t n0 = 0; n0 < N; n0 += kCols) {
    const int64_t nn = std::min(kCols, N - n0);
    pack_block(b, sk, sn, K, n0, nn, scratch);
    if (bias) {  // widened to float32: it starts the sums
      const __mmask32 mask = nn >= kCols ? 0xFFFFFFFFu : static_cast<__mmask32>((1ull << nn) - 1);
      const __m512i v = _mm512_maskz_loadu_epi16(mask, bias + n0);
      _mm512_store_si512(bias_blk, _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(v)), 16));
      _mm512_store_si512(bias_blk + 16, _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(v, 1)), 16));
    }
    rows_times_block(a, lda, 2, scratch, K, out + n0, ldo, nr, nn,
                     block_source(b, 2, sk, sn, K, n0 + kCols, std::min(kCols, N - n0 - kCols)), false,
                     bias ? bias_blk : nullptr);
  }
}

// A weight gradient: out[M, N] (rows ldo apart) = x[nr, M]^T y[nr, N] (rows ldx and ldy apart), the
// sum over the nr rows; `stream` as in f32_gemm. y is packed whole (bf16_dot_wgrad_scratch(nr, N)
// elements, then one block of x's columns); x's columns are packed 32 at a time into the rows of
// the transposed operand.
inline int64_t bf16_dot_wgrad_scratch(int64_t nr, int64_t N) {
  return (bf16_dot::ceil_blocks(N) + 1) * bf16_dot::block_elems(nr);
}

MINAGI_BF16_TARGET inline void bf16_dot_wgrad(const uint16_t* x, int64_t ldx, const uint16_t* y, int64_t ldy,
                                              uint16_t* out, int64_t ldo, int64_t nr, int64_t M, int64_t N,
                                              uint16_t* scratch, bool stream = false) {
  using namespace bf16_dot;
  const int64_t blk = block_elems(nr), nb = ceil_blocks(N);
  for (int64_t j = 0; j < nb; ++j) pack_block(y, ldy, 1, nr, j * kCols, std::min(kCols, N - j * kCols), scratch + j * blk);
  uint16_t* xp = scratch + nb * blk;
  for (int64_t m0 = 0; m0 < M; m0 += kCols) {
    const int64_t mm = std::min(kCols, M - m0);
    pack_block(x, ldx, 1, nr, m0, mm, xp);  // x^T's rows m0.. in pairs along the nr rows
    const Source next = block_source(x, 2, ldx, 1, nr, m0 + kCols, std::min(kCols, M - m0 - kCols));
    for (int64_t j = 0; j < nb; ++j) {
      rows_times_block(xp, 2, kCols * 2, scratch + j * blk, nr, out + m0 * ldo + j * kCols, ldo, mm,
                       std::min(kCols, N - j * kCols), j == 0 ? next : Source{}, stream);
    }
  }
  if (stream) _mm_sfence();  // the streamed lines are visible before whatever reads them next
}

#pragma GCC diagnostic pop

#else

inline bool bf16_dot_available() { return false; }

#endif

}  // namespace minagi
