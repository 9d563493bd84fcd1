// A few rows (1-4) times one slot's weights on AVX-512 (and, column-major, on AVX2: avx2_cols):
// the products of writing a handful of characters, where reading the weights once is the whole
// cost. The portable loops in slot_gemm.h (small_rows_mm, small_rows_mm_cols) leave this to GCC's
// vectoriser, which widens each bfloat16 weight once per row, and in the column-major layout sums
// one row's dot at a time, well under float32's streaming speed. Here each weight vector is loaded
// once and used for every row, and on AVX-512 bfloat16 goes through vdpbf16ps (pairs of values,
// no widening) (figures: docs/log/2026-12-05-decode-few-row-kernels.md).
//
// Built for the baseline ISA like the rest (no -march=native): the functions carry a target
// attribute, and callers ask avx512_available(), bf16_dot_available() or avx2_available() (CPUID,
// once) first.
#pragma once

#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "bf16_gemm.h"  // MINAGI_BF16_TARGET, bf16_dot_available
#include "f32_gemm.h"   // MINAGI_AVX512_TARGET, avx512_available

// GCC's AVX-512 headers trip -W(maybe-)uninitialized on their own _mm512_undefined_* values
// (_mm512_reduce_add_ps).
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#if !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif

namespace minagi {
namespace small_rows {

constexpr int kMaxRows = 4;

#ifdef MINAGI_AVX512

inline __mmask16 mask16(int64_t n) { return n >= 16 ? __mmask16(0xFFFF) : static_cast<__mmask16>((1u << n) - 1); }

// A weight vector as two 256-bit loads joined in a register. Streamed from past the L2 (the L3 or
// memory), whole 512-bit loads read slower on Zen 4; from the L2 and L3 the halves are as fast
// (figures: docs/log/2026-12-06-weights-in-halves.md). x, read from L1, keeps its 512-bit loads.
MINAGI_AVX512_TARGET inline __m512 load_halves_ps(const float* p) {
  const __m512d lo = _mm512_castpd256_pd512(_mm256_castps_pd(_mm256_loadu_ps(p)));
  return _mm512_castpd_ps(_mm512_insertf64x4(lo, _mm256_castps_pd(_mm256_loadu_ps(p + 8)), 1));
}

// Independent sums a row in the column kernels (8 for one row, 4 a row for more: 8-16 in all),
// enough to hide the FMA latency. One column is taken after another, so the slot is read as one
// sequential stream (4 columns at once, 4 streams of 4 KiB each, ran slower at one row).
template <int R>
constexpr int kChains = R == 1 ? 8 : 4;

// R rows times one column of a column-major b (its K values contiguous at b): out[r * ldo].
template <int R>
MINAGI_AVX512_TARGET inline void f32_col(const float* a, int64_t lda, const float* b, float* out, int64_t ldo,
                                         int64_t K) {
  constexpr int U = kChains<R>;
  __m512 acc[R][U];
  for (int r = 0; r < R; ++r)
    for (int u = 0; u < U; ++u) acc[r][u] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 16 * U <= K; k += 16 * U) {
    for (int u = 0; u < U; ++u) {
      const __m512 w = load_halves_ps(b + k + 16 * u);
      for (int r = 0; r < R; ++r) acc[r][u] = _mm512_fmadd_ps(_mm512_loadu_ps(a + r * lda + k + 16 * u), w, acc[r][u]);
    }
  }
  for (; k < K; k += 16) {
    const __mmask16 m = mask16(K - k);
    const __m512 w = _mm512_maskz_loadu_ps(m, b + k);
    for (int r = 0; r < R; ++r) acc[r][0] = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, a + r * lda + k), w, acc[r][0]);
  }
  for (int r = 0; r < R; ++r) {
    for (int u = 1; u < U; ++u) acc[r][0] = _mm512_add_ps(acc[r][0], acc[r][u]);
    out[r * ldo] = _mm512_reduce_add_ps(acc[r][0]);
  }
}

// out[R, M] = a[R, K] x b for a column-major b (column m's K values at b + m * sn).
template <int R>
MINAGI_AVX512_TARGET inline void f32(const float* a, int64_t lda, const float* b, int64_t sn, float* out,
                                     int64_t ldo, int64_t K, int64_t M) {
  for (int64_t m = 0; m < M; ++m) f32_col<R>(a, lda, b + m * sn, out + m, ldo, K);
}

#endif  // MINAGI_AVX512

#ifdef MINAGI_BF16_DOT

inline __mmask32 mask32(int64_t n) { return n >= 32 ? __mmask32(0xFFFFFFFFu) : static_cast<__mmask32>((1u << n) - 1); }

// load_halves_ps's bfloat16 twin: 32 values as two 256-bit loads.
MINAGI_BF16_TARGET inline __m512i load_halves_si(const uint16_t* p) {
  const __m512i lo = _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_inserti64x4(lo, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 16)), 1);
}

// As c10::BFloat16 rounds (nearest even).
inline uint16_t to_bf16(float v) { return c10::BFloat16(v).x; }

// As f32_col, 32 values a step, in pairs.
template <int R>
MINAGI_BF16_TARGET inline void bf16_col(const uint16_t* a, int64_t lda, const uint16_t* b, uint16_t* out, int64_t ldo,
                                        int64_t K) {
  constexpr int U = kChains<R>;
  __m512 acc[R][U];
  for (int r = 0; r < R; ++r)
    for (int u = 0; u < U; ++u) acc[r][u] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 32 * U <= K; k += 32 * U) {
    for (int u = 0; u < U; ++u) {
      const __m512bh w = (__m512bh)load_halves_si(b + k + 32 * u);
      for (int r = 0; r < R; ++r)
        acc[r][u] = _mm512_dpbf16_ps(acc[r][u], (__m512bh)_mm512_loadu_si512(a + r * lda + k + 32 * u), w);
    }
  }
  for (; k < K; k += 32) {  // zeros past K pair with zeros
    const __mmask32 m = mask32(K - k);
    const __m512bh w = (__m512bh)_mm512_maskz_loadu_epi16(m, b + k);
    for (int r = 0; r < R; ++r)
      acc[r][0] = _mm512_dpbf16_ps(acc[r][0], (__m512bh)_mm512_maskz_loadu_epi16(m, a + r * lda + k), w);
  }
  for (int r = 0; r < R; ++r) {
    for (int u = 1; u < U; ++u) acc[r][0] = _mm512_add_ps(acc[r][0], acc[r][u]);
    out[r * ldo] = to_bf16(_mm512_reduce_add_ps(acc[r][0]));
  }
}

// Output columns a pass of bf16_rows takes; their float32 sums (8 KiB a row, 8-32 KiB for 1-4
// rows) stay in the L1 and L2. Each
// pass reads a 4 KiB run of every one of b's rows: with 512 columns (1 KiB runs, 8 KiB apart) the
// slot came from memory at 0.54-0.75x torch.sum's speed, with 2,048 at 0.65-1.0x (4,096 was no
// better, 1,024 worse for 3 and 4 rows; tools/few_rows_probe.py --slots 8).
constexpr int64_t kRowChunk = 2048;
static_assert(kRowChunk % 32 == 0, "bf16_rows zeroes whole 32-column blocks of its sums");

// P pairs of b's rows (k, k + 1), ..., (k + 2P - 2, k + 2P - 1) times the R rows' matching values,
// added into y[r][0, nc): the pairs are interleaved in registers (as bf16_dot's pack_block does in
// memory), 32 columns at a time, and each is used for every row. `odd`: the last pair's second
// row lies past K and reads as zeros.
template <int R, int P>
MINAGI_BF16_TARGET inline void bf16_rows_step(const uint16_t* a, int64_t lda, const uint16_t* b, int64_t ldb,
                                              int64_t k, bool odd, float (*y)[kRowChunk], int64_t nc) {
  const __m512i lo = _mm512_setr_epi32(0x00200000, 0x00210001, 0x00220002, 0x00230003, 0x00240004, 0x00250005,
                                       0x00260006, 0x00270007, 0x00280008, 0x00290009, 0x002A000A, 0x002B000B,
                                       0x002C000C, 0x002D000D, 0x002E000E, 0x002F000F);
  const __m512i hi = _mm512_add_epi16(lo, _mm512_set1_epi16(16));
  __m512bh x[R][P];
  for (int r = 0; r < R; ++r) {
    for (int p = 0; p < P; ++p) {
      const bool whole = !(odd && p == P - 1);
      const uint32_t v = a[r * lda + k + 2 * p] | (whole ? static_cast<uint32_t>(a[r * lda + k + 2 * p + 1]) << 16 : 0u);
      x[r][p] = (__m512bh)_mm512_set1_epi32(static_cast<int32_t>(v));
    }
  }
  for (int64_t c = 0; c < nc; c += 32) {
    const __mmask32 m = mask32(nc - c);
    __m512bh wl[P], wh[P];
    for (int p = 0; p < P; ++p) {
      const uint16_t* row = b + (k + 2 * p) * ldb + c;
      const __m512i r0 = _mm512_maskz_loadu_epi16(m, row);
      const __m512i r1 = odd && p == P - 1 ? _mm512_setzero_si512() : _mm512_maskz_loadu_epi16(m, row + ldb);
      wl[p] = (__m512bh)_mm512_permutex2var_epi16(r0, lo, r1);
      wh[p] = (__m512bh)_mm512_permutex2var_epi16(r0, hi, r1);
    }
    for (int r = 0; r < R; ++r) {
      __m512 y0 = _mm512_load_ps(y[r] + c), y1 = _mm512_load_ps(y[r] + c + 16);
      for (int p = 0; p < P; ++p) {
        y0 = _mm512_dpbf16_ps(y0, x[r][p], wl[p]);
        y1 = _mm512_dpbf16_ps(y1, x[r][p], wh[p]);
      }
      _mm512_store_ps(y[r] + c, y0);
      _mm512_store_ps(y[r] + c + 16, y1);
    }
  }
}

// out[R, M] = a[R, K] x b for a row-major b (row k's M values at b + k * sk), kRowChunk columns at
// a time: each pass reads 8 of b's rows along the chunk (8 sequential streams; a register-only
// tile, 256 columns wide, read each row in a page of its own and ran at half the speed).
template <int R>
MINAGI_BF16_TARGET inline void bf16_rows(const uint16_t* a, int64_t lda, const uint16_t* b, int64_t sk, uint16_t* out,
                                         int64_t ldo, int64_t K, int64_t M) {
  alignas(64) float y[R][kRowChunk];
  for (int64_t c0 = 0; c0 < M; c0 += kRowChunk) {
    const int64_t nc = std::min(kRowChunk, M - c0);
    for (int r = 0; r < R; ++r) std::fill(y[r], y[r] + (nc + 31) / 32 * 32, 0.0f);  // nc <= kRowChunk, a multiple of 32
    int64_t k = 0;
    for (; k + 8 <= K; k += 8) bf16_rows_step<R, 4>(a, lda, b + c0, sk, k, false, y, nc);
    for (; k + 2 <= K; k += 2) bf16_rows_step<R, 1>(a, lda, b + c0, sk, k, false, y, nc);
    if (k < K) bf16_rows_step<R, 1>(a, lda, b + c0, sk, k, true, y, nc);
    for (int r = 0; r < R; ++r) {
      for (int64_t c = 0; c < nc; c += 32) {  // round to nearest even (denormals flush to zero, as in vdpbf16ps)
        const __m512i v = (__m512i)_mm512_cvtne2ps_pbh(_mm512_load_ps(y[r] + c + 16), _mm512_load_ps(y[r] + c));
        _mm512_mask_storeu_epi16(out + r * ldo + c0 + c, mask32(nc - c), v);
      }
    }
  }
}

template <int R>
MINAGI_BF16_TARGET inline void bf16(const uint16_t* a, int64_t lda, const uint16_t* b, int64_t sk, int64_t sn,
                                    uint16_t* out, int64_t ldo, int64_t K, int64_t M) {
  if (sk == 1) {
    for (int64_t m = 0; m < M; ++m) bf16_col<R>(a, lda, b + m * sn, out + m, ldo, K);
    return;
  }
  bf16_rows<R>(a, lda, b, sk, out, ldo, K, M);
}

#endif  // MINAGI_BF16_DOT

#ifdef MINAGI_AVX512  // any x86-64 compiler that has the AVX-512 intrinsics has AVX2's

#define MINAGI_AVX2_TARGET __attribute__((target("avx2,fma")))

inline bool avx2_available() {
  static const bool ok = cpu_isa() >= CpuIsa::kAvx2;
  return ok;
}

// 8 values as float32: bfloat16 widened (its bits the float's upper half), float32 as they are.
MINAGI_AVX2_TARGET inline __m256 load8(const uint16_t* p) {
  const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
}
MINAGI_AVX2_TARGET inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }

inline float value(uint16_t v) { return static_cast<float>(c10::BFloat16(v, c10::BFloat16::from_bits())); }
inline float value(float v) { return v; }
inline void store(uint16_t* p, float v) { *p = c10::BFloat16(v).x; }  // nearest even, as the portable loops round
inline void store(float* p, float v) { *p = v; }

MINAGI_AVX2_TARGET inline float hsum8(__m256 v) {
  __m128 t = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  t = _mm_add_ps(t, _mm_movehl_ps(t, t));
  t = _mm_add_ss(t, _mm_movehdup_ps(t));
  return _mm_cvtss_f32(t);
}

// R rows times C columns of a column-major b (column c's K values at b + c * sn): out[r * ldo +
// c]. Each step of 8 inputs loads the rows' values once for all C columns, and the C x R sums are
// the chains that hide the FMA's latency. C columns read at once are C streams, which the CPU's
// own prefetchers follow poorly: every 32 inputs ask for the next C columns' matching bytes.
template <int R, int C, typename T>
MINAGI_AVX2_TARGET inline void avx2_cols(const T* a, int64_t lda, const T* b, int64_t sn, T* out, int64_t ldo,
                                         int64_t K) {
  __m256 acc[C][R];
#pragma GCC unroll 4
  for (int c = 0; c < C; ++c)
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) acc[c][r] = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 32 <= K; k += 32) {
#pragma GCC unroll 4
    for (int c = 0; c < C; ++c) {
      const char* next = reinterpret_cast<const char*>(b + (C + c) * sn + k);
      for (size_t o = 0; o < 32 * sizeof(T); o += 64) _mm_prefetch(next + o, _MM_HINT_T0);
    }
#pragma GCC unroll 4
    for (int u = 0; u < 32; u += 8) {
      __m256 x[R];
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) x[r] = load8(a + r * lda + k + u);
#pragma GCC unroll 4
      for (int c = 0; c < C; ++c) {
        const __m256 w = load8(b + c * sn + k + u);
#pragma GCC unroll 4
        for (int r = 0; r < R; ++r) acc[c][r] = _mm256_fmadd_ps(x[r], w, acc[c][r]);
      }
    }
  }
  for (; k + 8 <= K; k += 8) {
    for (int c = 0; c < C; ++c) {
      const __m256 w = load8(b + c * sn + k);
      for (int r = 0; r < R; ++r) acc[c][r] = _mm256_fmadd_ps(load8(a + r * lda + k), w, acc[c][r]);
    }
  }
  for (int c = 0; c < C; ++c) {
    for (int r = 0; r < R; ++r) {
      float sum = hsum8(acc[c][r]);
      for (int64_t i = k; i < K; ++i) sum += value(a[r * lda + i]) * value(b[c * sn + i]);
      store(out + r * ldo + c, sum);
    }
  }
}

// out[R, M] = a[R, K] x b for a column-major b: 4 / R columns at a time (R = 3: one).
template <int R, typename T>
MINAGI_AVX2_TARGET inline void avx2_col_major(const T* a, int64_t lda, const T* b, int64_t sn, T* out, int64_t ldo,
                                              int64_t K, int64_t M) {
  constexpr int C = R == 3 ? 1 : 4 / R;
  int64_t m = 0;
  for (; m + C <= M; m += C) avx2_cols<R, C>(a, lda, b + m * sn, sn, out + m, ldo, K);
  for (; m < M; ++m) avx2_cols<R, 1>(a, lda, b + m * sn, sn, out + m, ldo, K);
}

template <typename T>
bool avx2_run(const T* a, int64_t lda, const T* b, int64_t sn, T* out, int64_t ldo, int64_t nr, int64_t K,
              int64_t M) {
  switch (nr) {
    case 1: avx2_col_major<1>(a, lda, b, sn, out, ldo, K, M); return true;
    case 2: avx2_col_major<2>(a, lda, b, sn, out, ldo, K, M); return true;
    case 3: avx2_col_major<3>(a, lda, b, sn, out, ldo, K, M); return true;
    case 4: avx2_col_major<4>(a, lda, b, sn, out, ldo, K, M); return true;
    default: return false;
  }
}

#endif  // MINAGI_AVX512

// out[nr, M] (rows ldo apart) = a[nr, K] (rows lda apart) x b, b[k, m] at b + k * sk + m * sn with
// sk == 1 or sn == 1, where these kernels take it (nr in [1, kMaxRows]): bfloat16 in both layouts
// and float32 column-major, on CPUs with the instructions (CPUID, checked once). A row-major
// float32 slot is left to the portable loops, which stream it as fast. One float32 row of a
// column-major slot runs here: as fast as the portable loop from memory, faster from the cache.
// Returns whether it ran.
template <typename scalar_t>
bool run(const scalar_t* a, int64_t lda, const scalar_t* b, int64_t sk, int64_t sn, scalar_t* out, int64_t ldo,
         int64_t nr, int64_t K, int64_t M) {
#ifdef MINAGI_AVX512
  if constexpr (std::is_same_v<scalar_t, float>) {
    if (sk != 1 || !avx512_available()) return false;
    switch (nr) {
      case 1: f32<1>(a, lda, b, sn, out, ldo, K, M); break;
      case 2: f32<2>(a, lda, b, sn, out, ldo, K, M); break;
      case 3: f32<3>(a, lda, b, sn, out, ldo, K, M); break;
      case 4: f32<4>(a, lda, b, sn, out, ldo, K, M); break;
      default: return false;
    }
    return true;
  }
#endif
#ifdef MINAGI_BF16_DOT
  if constexpr (std::is_same_v<scalar_t, c10::BFloat16>) {
    if (!bf16_dot_available()) return false;
    const auto* ua = reinterpret_cast<const uint16_t*>(a);
    const auto* ub = reinterpret_cast<const uint16_t*>(b);
    auto* uo = reinterpret_cast<uint16_t*>(out);
    switch (nr) {
      case 1: bf16<1>(ua, lda, ub, sk, sn, uo, ldo, K, M); break;
      case 2: bf16<2>(ua, lda, ub, sk, sn, uo, ldo, K, M); break;
      case 3: bf16<3>(ua, lda, ub, sk, sn, uo, ldo, K, M); break;
      case 4: bf16<4>(ua, lda, ub, sk, sn, uo, ldo, K, M); break;
      default: return false;
    }
    return true;
  }
#endif
#ifdef MINAGI_AVX512
  if (sk == 1 && avx2_available()) {  // column-major on an AVX2 CPU (AVX-512's own kernels above came first)
    if constexpr (std::is_same_v<scalar_t, float>) return avx2_run(a, lda, b, sn, out, ldo, nr, K, M);
    if constexpr (std::is_same_v<scalar_t, c10::BFloat16>) {
      return avx2_run(reinterpret_cast<const uint16_t*>(a), lda, reinterpret_cast<const uint16_t*>(b), sn,
                      reinterpret_cast<uint16_t*>(out), ldo, nr, K, M);
    }
  }
#endif
  (void)a, (void)lda, (void)b, (void)sk, (void)sn, (void)out, (void)ldo, (void)nr, (void)K, (void)M;
  return false;
}

}  // namespace small_rows
}  // namespace minagi

#pragma GCC diagnostic pop
