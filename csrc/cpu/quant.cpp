// Quantized expert weights on the CPU: qgrouped_mm, the grouped GEMM whose weights are int8 or
// int4 (minagi/moe/quant.py's format: q [S, out, in] int8 or [S, out, in / 2] uint8, output-major with
// each output channel's inputs contiguous; scales [S, out] or [S, out, in / group]).
//
// Two ways through a slot's row range, chosen per range:
//   stream (at most kSmallRows rows: decode): each output channel's bytes are read once and
//     dequantized in registers, every row's dot product taken from them, the channels shared out
//     over the threads (the bytes are the whole cost of such a product);
//   tile (more rows: prefill): a block of output channels is dequantized into a float tile in
//     the thread's cache and multiplied by ATen's mm (the BLAS), which reuses it for every row.
// Both compute in float32 (float64 for float64 inputs): value * scale is exact there, so each
// product equals the dequantize-then-multiply oracle's (minagi/reference.py qgrouped_mm) up to
// the order of the float32 sums. bfloat16 and float16 rows stream through int16 instead
// (rows_as_i16, qdot_i16): each 32-input block of a row as int16 with a power-of-two scale of its
// own (exact for values within 7 binades (bfloat16) or 4 (float16) of the block's largest), the
// products summed in int32 by vpmaddwd, two weights an instruction a lane where the float32 loop
// widens, converts and multiplies each: what lets int4 keep up with memory on AVX2.
//
// The inner loops come in three builds, picked once at run time (isa.h cpu_isa: CPUID, capped by
// MINAGI_CPU_ISA): portable C++, AVX2 + FMA, and AVX-512 (whose int16 loops are AVX2's). They are
// compiled for the baseline ISA inside target regions (no -march=native), so every x86-64 build
// carries all three. Rows are not quantized to int8 (llama.cpp's Q8 activations, AVX-512 VNNI's
// vpdpbusd): that moves results by far more than the rounding of a float32 or bfloat16 result.
#include <torch/library.h>

#include <ATen/ATen.h>
#include <ATen/ops/mm_cpu_dispatch.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <type_traits>
#include <vector>

#include "../common.h"
#include "isa.h"
#include "quant.h"
#include "rows.h"
#include "scheduling.h"

#if defined(__x86_64__) && defined(__GNUC__) && !defined(_WIN32)
#define MINAGI_QUANT_X86 1
#include <immintrin.h>
// GCC's AVX-512 headers trip -W(maybe-)uninitialized on their own _mm512_undefined_* values.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#if !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
#endif

namespace minagi {
namespace {

constexpr int64_t kBlock = 32;  // int4's packing block: 32 inputs in 16 bytes, and the unit of a group

// The int16 loops' sums in flight (channels x rows, qdot_i16): enough chains to hide the FMA's latency.
constexpr int kI16Chains = 4;

// The scratch qdot_i16 takes (work), in floats: the rows' group sums, the channels' scales and
// their products with the rows' block scales.
constexpr int64_t i16_work(int64_t R, int64_t G) { return (2 * kI16Chains + R) * G; }

// ---------------------------------------------------------------- portable

// A scale as acc_t, from float32, bfloat16 (its bits as uint16_t) or float16 (c10::Half).
template <typename acc_t, typename S>
inline acc_t scale_as(const S* s, int64_t i) {
  if constexpr (std::is_same_v<S, uint16_t>) {
    const uint32_t bits = static_cast<uint32_t>(s[i]) << 16;
    float f;
    std::memcpy(&f, &bits, sizeof(f));
    return static_cast<acc_t>(f);
  } else {
    return static_cast<acc_t>(static_cast<float>(s[i]));
  }
}

// One 32-input block of a channel's values (int8: 32 bytes; int4: 16 bytes, input j in byte j's
// low nibble and input j + 16 in its high one, each nibble the value + 8).
template <int bits, typename acc_t>
inline void unpack_block(const uint8_t* q, acc_t* w) {
  if constexpr (bits == 8) {
    for (int j = 0; j < 32; ++j) w[j] = static_cast<acc_t>(static_cast<int8_t>(q[j]));
  } else {
    for (int j = 0; j < 16; ++j) {
      w[j] = static_cast<acc_t>(static_cast<int>(q[j] & 15) - 8);
      w[j + 16] = static_cast<acc_t>(static_cast<int>(q[j] >> 4) - 8);
    }
  }
}

// The portable build of quant_kernels.h's qdot8 / qdot4 (same arguments; acc_t float or double).
template <int bits, typename acc_t, typename S>
void qdot_portable(const acc_t* x, int nr, const uint8_t* q, int64_t q_row, const S* s, int64_t G, int64_t K,
                   int64_t gs, int64_t nch, acc_t* y, int64_t ldy) {
  acc_t w[32];
  for (int64_t c = 0; c < nch; ++c) {
    const uint8_t* qc = q + c * q_row;
    acc_t sum[kSmallRows] = {};
    for (int64_t g = 0; g < G; ++g) {
      const int64_t g1 = (g + 1) * gs;
      acc_t part[kSmallRows] = {};
      int64_t i = g * gs;
      for (; i + 32 <= g1; i += 32) {
        unpack_block<bits>(qc + (bits == 8 ? i : i / 2), w);
        for (int r = 0; r < nr; ++r) {
          const acc_t* xr = x + r * K + i;
          acc_t dot = 0;
          for (int j = 0; j < 32; ++j) dot += xr[j] * w[j];
          part[r] += dot;
        }
      }
      for (; i < g1; ++i) {  // int8 with one scale per channel: the inputs past the last block
        const acc_t v = static_cast<acc_t>(static_cast<int8_t>(qc[i]));
        for (int r = 0; r < nr; ++r) part[r] += x[r * K + i] * v;
      }
      const acc_t sc = scale_as<acc_t>(s, c * G + g);
      for (int r = 0; r < nr; ++r) sum[r] += part[r] * sc;
    }
    for (int r = 0; r < nr; ++r) y[r * ldy + c] = sum[r];
  }
}

template <int bits, typename acc_t, typename S>
void dequant_portable(const uint8_t* q, const S* s, int64_t K, int64_t gs, acc_t* out) {
  for (int64_t g0 = 0, g = 0; g0 < K; g0 += gs, ++g) {
    const int64_t g1 = std::min(K, g0 + gs);
    const acc_t sc = scale_as<acc_t>(s, g);
    int64_t i = g0;
    for (; i + 32 <= g1; i += 32) {
      unpack_block<bits>(q + (bits == 8 ? i : i / 2), out + i);
      for (int j = 0; j < 32; ++j) out[i + j] *= sc;
    }
    for (; i < g1; ++i) out[i] = static_cast<acc_t>(static_cast<int8_t>(q[i])) * sc;
  }
}

}  // namespace

#ifdef MINAGI_QUANT_X86

// ---------------------------------------------------------------- AVX2 + FMA

#pragma GCC push_options
#pragma GCC target("avx2,fma")
namespace quant_avx2 {
namespace {
struct V {
  using reg = __m256;
  using ireg = __m256i;
  static constexpr int L = 8;
  static reg zero() { return _mm256_setzero_ps(); }
  static reg load(const float* p) { return _mm256_loadu_ps(p); }
  static void store(float* p, reg v) { _mm256_storeu_ps(p, v); }
  static reg set1(float v) { return _mm256_set1_ps(v); }
  static reg fma(reg a, reg b, reg c) { return _mm256_fmadd_ps(a, b, c); }
  static reg fnma(reg a, reg b, reg c) { return _mm256_fnmadd_ps(a, b, c); }
  static reg add(reg a, reg b) { return _mm256_add_ps(a, b); }
  static reg mul(reg a, reg b) { return _mm256_mul_ps(a, b); }
  static ireg u8(const uint8_t* p) { return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))); }
  static ireg i8(const uint8_t* p) { return _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))); }
  static ireg and_15(ireg v) { return _mm256_and_si256(v, _mm256_set1_epi32(15)); }
  static ireg srl4(ireg v) { return _mm256_srli_epi32(v, 4); }
  static reg to_float(ireg v) { return _mm256_cvtepi32_ps(v); }
  static reg bf16(const uint16_t* p) {
    const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
  }
  static float hsum(reg v) {
    __m128 t = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    t = _mm_add_ps(t, _mm_movehl_ps(t, t));
    t = _mm_add_ss(t, _mm_movehdup_ps(t));
    return _mm_cvtss_f32(t);
  }
};
#include "quant_kernels.h"

// One block's 32 weights of a channel as int16: int8 sign-extended; int4 the stored nibbles
// (value + 8), low nibbles the block's first 16 inputs.
template <int bits>
inline void block_i16(const uint8_t* p, __m256i& w0, __m256i& w1) {
  if constexpr (bits == 8) {
    w0 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    w1 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16)));
  } else {
    const __m256i v = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    w0 = _mm256_and_si256(v, _mm256_set1_epi16(15));
    w1 = _mm256_srli_epi16(v, 4);
  }
}

// The block's products of a channel's weights and a row's int16 values, summed to 8 lanes.
inline __m256 block_dot(__m256i w0, __m256i w1, const int16_t* x) {
  const __m256i* xr = reinterpret_cast<const __m256i*>(x);
  return _mm256_cvtepi32_ps(_mm256_add_epi32(_mm256_madd_epi16(w0, _mm256_loadu_si256(xr)),
                                             _mm256_madd_epi16(w1, _mm256_loadu_si256(xr + 1))));
}

// The cache lines of n bytes from p, asked for ahead of their use. The loops read C channels at
// once, C streams a few hundred bytes apart, which the CPU's own prefetchers follow poorly; each
// block asks for its share of the next C channels' bytes.
template <int64_t n>
inline void prefetch_lines(const char* p) {
  for (int64_t o = 0; o < n; o += 64) _mm_prefetch(p + o, _MM_HINT_T0);
}

inline void prefetch_span(const void* p, int64_t n) {
  for (int64_t o = 0; o < n; o += 64) _mm_prefetch(static_cast<const char*>(p) + o, _MM_HINT_T0);
}

// out[i] = a[i] * b[i], i < n.
inline void mul_f32(const float* a, const float* b, int64_t n, float* out) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i)));
  for (; i < n; ++i) out[i] = a[i] * b[i];
}

// C channels (q: the first; q_row bytes apart) against R rows. The loops over c and r are
// unrolled, so the C x R sums stay in registers. Pointers are stepped along, not indices: the
// build's -fwrapv keeps GCC from reducing index arithmetic, which slowed such loops.
template <int bits, int R, int C, bool kG32, typename S>
inline void qdot_i16_channels(const int16_t* x16, const float* xscale, const float* xs, float* work, const uint8_t* q,
                              int64_t q_row, const S* s, int64_t G, int64_t K, int64_t gs, float* y, int64_t ldy) {
  constexpr int64_t step = bits == 8 ? 32 : 16;  // a block's bytes
  const int64_t B = K / 32;
  float* sf = work;  // the channels' scales [C][G]
  for (int c = 0; c < C; ++c) scales_f32(s + c * G, G, sf + c * G);
  prefetch_span(s + C * G, C * G * sizeof(S));  // the next channels
  __m256 acc[C][R];
#pragma GCC unroll 4
  for (int c = 0; c < C; ++c)
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) acc[c][r] = _mm256_setzero_ps();
  const uint8_t* qb = q;
  const int16_t* xb = x16;
  if constexpr (kG32) {  // one block a group: its scale times the row's block scale, multiplied out first
    float* sfx = work + C * G;  // [C][R][B]
    for (int c = 0; c < C; ++c)
      for (int r = 0; r < R; ++r) mul_f32(sf + c * G, xscale + r * B, B, sfx + (c * R + r) * B);
    const float* sp = sfx;
    const char* pf = reinterpret_cast<const char*>(q + C * q_row);
    for (int64_t b = 0; b < B; ++b, qb += step, xb += 32, ++sp, pf += C * step) {
      prefetch_lines<C * step>(pf);
#pragma GCC unroll 4
      for (int c = 0; c < C; ++c) {
        __m256i w0, w1;
        block_i16<bits>(qb + c * q_row, w0, w1);
#pragma GCC unroll 4
        for (int r = 0; r < R; ++r)
          acc[c][r] = _mm256_fmadd_ps(block_dot(w0, w1, xb + r * K), _mm256_broadcast_ss(sp + (c * R + r) * B),
                                      acc[c][r]);
      }
    }
  } else {  // longer groups: the blocks' sums in the row's block scales, then the group's scale once
    const float* sp = xscale;
    const float* sc = sf;
    const char* pf = reinterpret_cast<const char*>(q + C * q_row);
    for (int64_t g = 0; g < G; ++g, ++sc) {
      __m256 grp[C][R];
#pragma GCC unroll 4
      for (int c = 0; c < C; ++c)
#pragma GCC unroll 4
        for (int r = 0; r < R; ++r) grp[c][r] = _mm256_setzero_ps();
      for (int64_t k = 0; k < gs / 32; ++k, qb += step, xb += 32, ++sp, pf += C * step) {
        prefetch_lines<C * step>(pf);
#pragma GCC unroll 4
        for (int c = 0; c < C; ++c) {
          __m256i w0, w1;
          block_i16<bits>(qb + c * q_row, w0, w1);
#pragma GCC unroll 4
          for (int r = 0; r < R; ++r)
            grp[c][r] = _mm256_fmadd_ps(block_dot(w0, w1, xb + r * K), _mm256_broadcast_ss(sp + r * B), grp[c][r]);
        }
      }
#pragma GCC unroll 4
      for (int c = 0; c < C; ++c) {
        const __m256 scale = _mm256_broadcast_ss(sc + c * G);
#pragma GCC unroll 4
        for (int r = 0; r < R; ++r) acc[c][r] = _mm256_fmadd_ps(grp[c][r], scale, acc[c][r]);
      }
    }
  }
  for (int c = 0; c < C; ++c) {
    for (int r = 0; r < R; ++r) {
      float sum = V::hsum(acc[c][r]);
      if constexpr (bits == 4) sum -= 8.0f * dot_f32(sf + c * G, xs + r * G, G);
      y[r * ldy + c] = sum;
    }
  }
}

// The rows as int16 (bfloat16 and float16 activations; qdot_i16): y[r * ldy + c] = sum_b xscale[r *
// K / 32 + b] * sum_{i in block b} x16[r * K + i] * value(c, i) * s[c * G + i / gs], each 32-input
// block's products summed in int32 by vpmaddwd (two weights an instruction a lane, exact), then
// converted and scaled once. Groups of 32: each block's scale times the row's block scale,
// multiplied out before the loop; longer groups: the blocks' sums scaled by the row's block
// scales into the group's sum, which is scaled once. int4 multiplies the stored nibbles (value +
// 8) and takes 8 x sum_g scale_g x (the row's sum over g) off once a channel. Needs K a multiple
// of 32.
//
// C channels go through the loop together (qdot_i16_channels), C = 4 / R (1 for 3 rows): each
// row block's int16 values are loaded once for all C, and the C x R sums are the independent
// chains that hide the FMA's latency, so the loop carries nothing else. work: i16_work(R, G)
// floats.
template <int bits, int R, typename S>
void qdot_i16(const int16_t* x16, const float* xscale, float* work, const uint8_t* q, int64_t q_row, const S* s,
              int64_t G, int64_t K, int64_t gs, int64_t nch, float* y, int64_t ldy) {
  constexpr int C = R == 3 ? 1 : kI16Chains / R;
  const int64_t B = K / 32;
  float* xs = work;  // int4: each row's sum over each group, its blocks in their own scales
  if constexpr (bits == 4) {
    for (int r = 0; r < R; ++r) {
      for (int64_t g = 0; g < G; ++g) {
        float t = 0.0f;
        for (int64_t b = g * gs / 32; b < (g + 1) * gs / 32; ++b) {
          int32_t sb = 0;
          for (int64_t i = b * 32; i < b * 32 + 32; ++i) sb += x16[r * K + i];
          t += static_cast<float>(sb) * xscale[r * B + b];
        }
        xs[r * G + g] = t;
      }
    }
  }
  float* rest = work + R * G;
  int64_t c = 0;
  auto channels = [&](auto fn, int64_t n) {
    for (; c + n <= nch; c += n) fn(x16, xscale, xs, rest, q + c * q_row, q_row, s + c * G, G, K, gs, y + c, ldy);
  };
  if (gs == 32) {
    channels(qdot_i16_channels<bits, R, C, true, S>, C);
    channels(qdot_i16_channels<bits, R, 1, true, S>, 1);
  } else {
    channels(qdot_i16_channels<bits, R, C, false, S>, C);
    channels(qdot_i16_channels<bits, R, 1, false, S>, 1);
  }
}
}  // namespace
}  // namespace quant_avx2
#pragma GCC pop_options

// ---------------------------------------------------------------- AVX-512

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx2,fma")
namespace quant_avx512 {
namespace {
struct V {
  using reg = __m512;
  using ireg = __m512i;
  static constexpr int L = 16;
  static reg zero() { return _mm512_setzero_ps(); }
  static reg load(const float* p) { return _mm512_loadu_ps(p); }
  static void store(float* p, reg v) { _mm512_storeu_ps(p, v); }
  static reg set1(float v) { return _mm512_set1_ps(v); }
  static reg fma(reg a, reg b, reg c) { return _mm512_fmadd_ps(a, b, c); }
  static reg fnma(reg a, reg b, reg c) { return _mm512_fnmadd_ps(a, b, c); }
  static reg add(reg a, reg b) { return _mm512_add_ps(a, b); }
  static reg mul(reg a, reg b) { return _mm512_mul_ps(a, b); }
  static ireg u8(const uint8_t* p) { return _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
  static ireg i8(const uint8_t* p) { return _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
  static ireg and_15(ireg v) { return _mm512_and_si512(v, _mm512_set1_epi32(15)); }
  static ireg srl4(ireg v) { return _mm512_srli_epi32(v, 4); }
  static reg to_float(ireg v) { return _mm512_cvtepi32_ps(v); }
  static reg bf16(const uint16_t* p) {
    const __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
  }
  static float hsum(reg v) { return _mm512_reduce_add_ps(v); }
};
#include "quant_kernels.h"
}  // namespace
}  // namespace quant_avx512
#pragma GCC pop_options

#endif  // MINAGI_QUANT_X86

namespace {

// ---------------------------------------------------------------- the kernels picked at run time

// float32's kernels of one level, for float32 scales [0] and bfloat16 scales [1] (float16 scales
// are converted to float32 first): dot[bits == 4][scales][long groups][rows - 1] (long groups: 4
// chains a row, else 2, enough for a 32-input group), dequant[bits == 4][scales].
using DotFn = void (*)(const float*, float*, const uint8_t*, int64_t, const void*, int64_t, int64_t, int64_t,
                       int64_t, float*, int64_t);
using DequantFn = void (*)(const uint8_t*, const void*, int64_t, int64_t, float*);

// The int16 rows' kernels (bfloat16 and float16 activations; AVX2, which AVX-512 CPUs have too):
// i16[bits == 4][scales][rows - 1]; none in the portable build.
using I16Fn = void (*)(const int16_t*, const float*, float*, const uint8_t*, int64_t, const void*, int64_t, int64_t,
                       int64_t, int64_t, float*, int64_t);

struct F32Kernels {
  DotFn dot[2][2][2][kSmallRows];
  DequantFn dequant[2][2];
  I16Fn i16[2][2][kSmallRows];
};

template <auto fn, typename S>
void i16_as(const int16_t* x16, const float* xscale, float* work, const uint8_t* q, int64_t q_row, const void* s,
            int64_t G, int64_t K, int64_t gs, int64_t nch, float* y, int64_t ldy) {
  fn(x16, xscale, work, q, q_row, static_cast<const S*>(s), G, K, gs, nch, y, ldy);
}

template <auto fn, typename S>
void dot_as(const float* x, float* work, const uint8_t* q, int64_t q_row, const void* s, int64_t G, int64_t K,
            int64_t gs, int64_t nch, float* y, int64_t ldy) {
  fn(x, work, q, q_row, static_cast<const S*>(s), G, K, gs, nch, y, ldy);
}

template <auto fn, typename S>
void dequant_as(const uint8_t* q, const void* s, int64_t K, int64_t gs, float* out) {
  fn(q, static_cast<const S*>(s), K, gs, out);
}

template <int bits, int R, int U, typename S>
void qdot_portable_f32(const float* x, float*, const uint8_t* q, int64_t q_row, const S* s, int64_t G, int64_t K,
                       int64_t gs, int64_t nch, float* y, int64_t ldy) {
  qdot_portable<bits, float, S>(x, R, q, q_row, s, G, K, gs, nch, y, ldy);
}
template <int R, int U, typename S>
void qdot8_portable_f32(const float* x, float* w, const uint8_t* q, int64_t q_row, const S* s, int64_t G, int64_t K,
                        int64_t gs, int64_t nch, float* y, int64_t ldy) {
  qdot_portable_f32<8, R, U, S>(x, w, q, q_row, s, G, K, gs, nch, y, ldy);
}
template <int R, int U, typename S>
void qdot4_portable_f32(const float* x, float* w, const uint8_t* q, int64_t q_row, const S* s, int64_t G, int64_t K,
                        int64_t gs, int64_t nch, float* y, int64_t ldy) {
  qdot_portable_f32<4, R, U, S>(x, w, q, q_row, s, G, K, gs, nch, y, ldy);
}

template <int bits, typename S>
void dequant_portable_f32(const uint8_t* q, const S* s, int64_t K, int64_t gs, float* out) {
  dequant_portable<bits, float, S>(q, s, K, gs, out);
}

static_assert(kSmallRows == 4, "the tables below list the row counts 1..kSmallRows");
#define MINAGI_ROWS(fn, U, S) \
  { &dot_as<&fn<1, U, S>, S>, &dot_as<&fn<2, U, S>, S>, &dot_as<&fn<3, U, S>, S>, &dot_as<&fn<4, U, S>, S> }
#define MINAGI_DOTS(fn8, fn4)                                                                             \
  {                                                                                                       \
    {{MINAGI_ROWS(fn8, 2, float), MINAGI_ROWS(fn8, 4, float)},                                            \
     {MINAGI_ROWS(fn8, 2, uint16_t), MINAGI_ROWS(fn8, 4, uint16_t)}},                                     \
    {                                                                                                     \
      {MINAGI_ROWS(fn4, 2, float), MINAGI_ROWS(fn4, 4, float)}, {                                         \
        MINAGI_ROWS(fn4, 2, uint16_t), MINAGI_ROWS(fn4, 4, uint16_t)                                      \
      }                                                                                                   \
    }                                                                                                     \
  }
#define MINAGI_I16_ROWS(bits, S)                                                                  \
  {                                                                                                \
    &i16_as<&quant_avx2::qdot_i16<bits, 1, S>, S>, &i16_as<&quant_avx2::qdot_i16<bits, 2, S>, S>,  \
        &i16_as<&quant_avx2::qdot_i16<bits, 3, S>, S>, &i16_as<&quant_avx2::qdot_i16<bits, 4, S>, S> \
  }
#define MINAGI_I16S \
  {{MINAGI_I16_ROWS(8, float), MINAGI_I16_ROWS(8, uint16_t)}, {MINAGI_I16_ROWS(4, float), MINAGI_I16_ROWS(4, uint16_t)}}
#define MINAGI_DEQUANTS(fn)                                                                  \
  {                                                                                          \
    {&dequant_as<&fn<8, float>, float>, &dequant_as<&fn<8, uint16_t>, uint16_t>}, {          \
      &dequant_as<&fn<4, float>, float>, &dequant_as<&fn<4, uint16_t>, uint16_t>             \
    }                                                                                        \
  }

const F32Kernels& f32_kernels() {
  static const F32Kernels portable{MINAGI_DOTS(qdot8_portable_f32, qdot4_portable_f32),
                                   MINAGI_DEQUANTS(dequant_portable_f32), {}};
#ifdef MINAGI_QUANT_X86
  static const F32Kernels avx2{MINAGI_DOTS(quant_avx2::qdot8, quant_avx2::qdot4), MINAGI_DEQUANTS(quant_avx2::dequant),
                               MINAGI_I16S};
  static const F32Kernels avx512{MINAGI_DOTS(quant_avx512::qdot8, quant_avx512::qdot4),
                                 MINAGI_DEQUANTS(quant_avx512::dequant), MINAGI_I16S};
  switch (cpu_isa()) {
    case CpuIsa::kAvx512: return avx512;
    case CpuIsa::kAvx2: return avx2;
    default: return portable;
  }
#else
  return portable;
#endif
}
#undef MINAGI_ROWS
#undef MINAGI_DOTS
#undef MINAGI_DEQUANTS
#undef MINAGI_I16_ROWS
#undef MINAGI_I16S

// ---------------------------------------------------------------- the op

// The inputs a channel stores: K, or with groups K rounded up to whole groups (a short last
// group's padding holds zeros, and the kernels pad the rows with zeros to match, so every loop
// runs over whole groups).
int64_t padded_inputs(int64_t K, int64_t group_size) {
  return group_size > 0 ? (K + group_size - 1) / group_size * group_size : K;
}

}  // namespace

void check_quantized_weight(const at::Tensor& a, int64_t K, const at::Tensor& q, const at::Tensor& scale, int64_t bits,
                            int64_t group_size, const char* op, const char* a_name, const char* q_name,
                            const char* scale_name) {
  check_dim(q, 3, op, q_name);
  TORCH_CHECK_VALUE(bits == 8 || bits == 4, "minagi.", op, ": bits must be 8 or 4, got ", bits);
  const auto want = bits == 8 ? at::kChar : at::kByte;
  TORCH_CHECK_VALUE(q.scalar_type() == want, "minagi.", op, ": int", bits, " weights come as ", q_name, " of dtype ",
                    bits == 8 ? "int8" : "uint8 (two values a byte)", ", got ", q.scalar_type());
  const int64_t per_byte = bits == 8 ? 1 : 2;
  TORCH_CHECK_VALUE(group_size >= 0 && group_size % kBlock == 0, "minagi.", op,
                    ": group_size must be 0 (one scale per output channel) or a multiple of 32, got ", group_size);
  TORCH_CHECK_VALUE(bits == 8 || group_size > 0, "minagi.", op, ": int4 needs a group_size (a multiple of 32), ",
                    "got ", group_size);
  const int64_t stored = padded_inputs(K, group_size);
  TORCH_CHECK_VALUE(q.size(2) * per_byte == stored, "minagi.", op, ": ", q_name, " [S, out, ",
                    bits == 8 ? "in" : "in / 2", "] must hold ", a_name, "'s ", K, " inputs",
                    stored == K ? "" : " padded to whole groups (" + std::to_string(stored) + ")", ", got ", q_name,
                    " of shape ", q.sizes());
  const auto st = scale.scalar_type();
  TORCH_CHECK_VALUE(st == at::kFloat || st == at::kBFloat16 || st == at::kHalf, "minagi.", op, ": ", scale_name,
                    " must be float32, bfloat16 or float16, got ", st);
  const int64_t groups = group_size > 0 ? (K + group_size - 1) / group_size : 1;
  const bool shape_ok = group_size == 0 ? scale.dim() == 2 && scale.size(0) == q.size(0) && scale.size(1) == q.size(1)
                                        : scale.dim() == 3 && scale.size(0) == q.size(0) &&
                                              scale.size(1) == q.size(1) && scale.size(2) == groups;
  TORCH_CHECK_VALUE(shape_ok, "minagi.", op, ": ", scale_name, " must be [S, out] = [", q.size(0), ", ", q.size(1),
                    "] for group_size 0, else [S, out, ceil(in / group_size)]; got ", scale.sizes(),
                    " with group_size ", group_size, " and ", K, " inputs");
  check_same_device(a, q, op, a_name, q_name);
  check_same_device(a, scale, op, a_name, scale_name);
}

namespace {

void check_qgrouped_mm_args(const at::Tensor& a, const at::Tensor& q, const at::Tensor& scale, int64_t bits,
                            int64_t group_size) {
  check_dim(a, 2, "qgrouped_mm", "a");
  check_floating(a, "qgrouped_mm", "a");
  check_quantized_weight(a, a.size(1), q, scale, bits, group_size, "qgrouped_mm", "a", "q", "scale");
}

// A range's rows times a block of its slot's output channels [c0, c1).
struct QPart {
  int64_t slot, r0, nr, c0, c1;
};

// Output channels a tile takes: its float weights about 256 KiB, in the L2 cache beside the rows.
int64_t tile_columns(int64_t K, int64_t M, size_t elem) {
  const int64_t cols = (int64_t{256} << 10) / (std::max<int64_t>(K, 1) * static_cast<int64_t>(elem));
  return std::min(M, std::max<int64_t>(16, cols / 16 * 16));
}

// Rows of a (scalar_t) as acc_t, n values.
template <typename scalar_t, typename acc_t>
inline void rows_to(const scalar_t* a, int64_t n, acc_t* out) {
  if constexpr (std::is_same_v<scalar_t, at::BFloat16> && std::is_same_v<acc_t, float>) {
    bf16_to_float(reinterpret_cast<const uint16_t*>(a), out, n);
  } else {
    for (int64_t i = 0; i < n; ++i) out[i] = static_cast<acc_t>(a[i]);
  }
}

template <typename scalar_t, typename acc_t>
inline void rows_from(const acc_t* v, int64_t n, scalar_t* out) {
  if constexpr (std::is_same_v<scalar_t, at::BFloat16> && std::is_same_v<acc_t, float>) {
    float_to_bf16(v, reinterpret_cast<uint16_t*>(out), n);
  } else {
    for (int64_t i = 0; i < n; ++i) out[i] = static_cast<scalar_t>(v[i]);
  }
}

// Rows of K floats as int16, each block of 32 inputs with a power-of-two scale of its own:
// x16 = x * 2^sh, xscale = 2^-sh, the block's largest magnitude at 2^14 to 2^15. bfloat16 and
// float16 values (at most 11 significant bits) keep every bit where they lie within 7
// (bfloat16) or 4 (float16) binades of their block's largest, and smaller ones are rounded at
// 2^-15 of it, well under the rounding of a bfloat16 or float16 result. false where a row holds
// a NaN or an infinity (the float32 loops take those, so they propagate as the oracle's do).
inline bool rows_as_i16(const float* x, int64_t nr, int64_t K, int16_t* x16, float* xscale) {
  for (int64_t b = 0; b < nr * K / 32; ++b) {
    const float* xb = x + b * 32;
    float m = 0.0f;
    bool finite = true;
    for (int i = 0; i < 32; ++i) {
      const float v = std::abs(xb[i]);
      finite &= v <= std::numeric_limits<float>::max();  // false for NaN too
      m = std::max(m, v);
    }
    if (!finite) return false;
    const int sh = m > 0.0f ? 14 - std::ilogb(m) : 0;
    const float up = std::ldexp(1.0f, sh);
    xscale[b] = std::ldexp(1.0f, -sh);
    for (int i = 0; i < 32; ++i) x16[b * 32 + i] = static_cast<int16_t>(std::lrintf(xb[i] * up));
  }
  return true;
}

// One call's work over its parts. S: the scales as stored (float, uint16_t for bfloat16's bits,
// c10::Half).
template <typename scalar_t, typename S>
struct QGemm {
  using acc_t = at::opmath_type<scalar_t>;
  static constexpr bool kF32 = std::is_same_v<acc_t, float>;
  static constexpr bool kConvert = !std::is_same_v<scalar_t, acc_t>;
  static constexpr bool kHalfScales = std::is_same_v<S, c10::Half>;
  // Rows whose values have at most 11 significant bits (bfloat16's 8, float16's 11): as int16 with
  // a power-of-two scale a row they lose nothing where a row's exponents span a few binades.
  static constexpr bool kI16Rows = std::is_same_v<scalar_t, at::BFloat16> || std::is_same_v<scalar_t, at::Half>;
  const scalar_t* a;
  const uint8_t* q;
  const S* scale;
  scalar_t* out;
  int64_t K, M, bits, gs, G, q_row;  // inputs, outputs, bits, inputs a scale, scales a channel, bytes a channel
  int64_t KP;                        // inputs a channel stores (padded_inputs), what the kernels run over
  const F32Kernels* kernels;         // float32's kernels of the CPU's level

  const uint8_t* channels(const QPart& p) const { return q + (p.slot * M + p.c0) * q_row; }
  const S* scales(const QPart& p) const { return scale + (p.slot * M + p.c0) * G; }

  // The part's scales as the float32 kernels take them (float32 or bfloat16 as stored; float16
  // converted to float32 into buf), and which of the two they are.
  std::pair<const void*, int> kernel_scales(const QPart& p, float* buf) const {
    if constexpr (kHalfScales) {
      const S* s = scales(p);
      for (int64_t i = 0; i < (p.c1 - p.c0) * G; ++i) buf[i] = static_cast<float>(s[i]);
      return {buf, 0};
    } else {
      return {scales(p), std::is_same_v<S, float> ? 0 : 1};
    }
  }

  // A few rows: each channel's bytes read once, every row's dot product from them. bfloat16 and
  // float16 rows go through int16 (rows_as_i16) where the CPU's level has those loops.
  void stream(const QPart& p) const {
    const int64_t nch = p.c1 - p.c0, nr = p.nr;
    // int16 rows: nr * K values and a scale a 32-value block
    const int64_t n_half = kHalfScales ? nch * G : 0, n16 = kI16Rows ? nr * KP / 2 + nr * KP / 32 + 1 : 0;
    std::vector<acc_t> own;
    const int64_t n_work = std::max(G + 2 * nr * G, i16_work(nr, G));  // the float32 loops' or the int16 loops'
    acc_t* buf = thread_scratch<acc_t>(nr * KP + n_work + nr * nch + n_half + n16, own);
    acc_t *xs = buf, *work = xs + nr * KP, *y = work + n_work, *sbuf = y + nr * nch;
    acc_t *xscale = sbuf + n_half, *b16 = xscale + nr * KP / 32;
    const acc_t* x = reinterpret_cast<const acc_t*>(a + p.r0 * K);
    if (kConvert || KP != K) {  // the rows as acc_t, each padded with zeros to the stored inputs
      for (int64_t r = 0; r < nr; ++r) {
        rows_to(a + (p.r0 + r) * K, K, xs + r * KP);
        std::fill(xs + r * KP + K, xs + (r + 1) * KP, acc_t(0));
      }
      x = xs;
    }
    if constexpr (kF32) {
      const auto [s, kind] = kernel_scales(p, sbuf);
      const I16Fn i16 = kI16Rows && KP % 32 == 0 ? kernels->i16[bits == 4][kind][nr - 1] : nullptr;
      int16_t* x16 = reinterpret_cast<int16_t*>(b16);
      if (i16 != nullptr && rows_as_i16(x, nr, KP, x16, xscale)) {
        i16(x16, xscale, work, channels(p), q_row, s, G, KP, gs, nch, y, nch);
      } else {
        kernels->dot[bits == 4][kind][gs > 32][nr - 1](x, work, channels(p), q_row, s, G, KP, gs, nch, y, nch);
      }
    } else if (bits == 8) {
      qdot_portable<8, acc_t, S>(x, static_cast<int>(nr), channels(p), q_row, scales(p), G, KP, gs, nch, y, nch);
    } else {
      qdot_portable<4, acc_t, S>(x, static_cast<int>(nr), channels(p), q_row, scales(p), G, KP, gs, nch, y, nch);
    }
    for (int64_t r = 0; r < nr; ++r) rows_from(y + r * nch, nch, out + (p.r0 + r) * M + p.c0);
  }

  // Many rows: the block's channels dequantized into a tile once, the rows multiplied by it in
  // chunks (converted to acc_t where a is not), through ATen's mm.
  void tile(const QPart& p) const {
    const int64_t nc = p.c1 - p.c0;
    const int64_t chunk =
        std::min<int64_t>(p.nr, std::max<int64_t>(16, (int64_t{1} << 20) / (std::max<int64_t>(K, 1) * sizeof(acc_t))));
    std::vector<acc_t> own;
    acc_t* buf = thread_scratch<acc_t>(nc * KP + chunk * nc + (kConvert ? chunk * K : 0) + (kHalfScales ? nc * G : 0),
                                       own);
    acc_t *w = buf, *y = w + nc * KP, *xa = y + chunk * nc, *sbuf = xa + (kConvert ? chunk * K : 0);
    const uint8_t* qc = channels(p);
    if constexpr (kF32) {
      const auto [s, kind] = kernel_scales(p, sbuf);
      const DequantFn fn = kernels->dequant[bits == 4][kind];
      const size_t step = (kind == 0 ? sizeof(float) : sizeof(uint16_t)) * G;
      for (int64_t o = 0; o < nc; ++o) fn(qc + o * q_row, static_cast<const char*>(s) + o * step, KP, gs, w + o * KP);
    } else {
      for (int64_t o = 0; o < nc; ++o) {
        bits == 8 ? dequant_portable<8, acc_t, S>(qc + o * q_row, scales(p) + o * G, KP, gs, w + o * KP)
                  : dequant_portable<4, acc_t, S>(qc + o * q_row, scales(p) + o * G, KP, gs, w + o * KP);
      }
    }
    const auto opts = at::TensorOptions().dtype(c10::CppTypeToScalarType<acc_t>::value);
    const at::Tensor wt = at::from_blob(w, {nc, K}, {KP, 1}, opts).t();  // the padding left out
    for (int64_t r = 0; r < p.nr; r += chunk) {
      const int64_t nr = std::min(chunk, p.nr - r);
      const scalar_t* ar = a + (p.r0 + r) * K;
      const acc_t* x = reinterpret_cast<const acc_t*>(ar);
      if constexpr (kConvert) {
        rows_to(ar, nr * K, xa);
        x = xa;
      }
      at::Tensor yt = at::from_blob(y, {nr, nc}, opts);
      at::cpu::mm_out(yt, at::from_blob(const_cast<acc_t*>(x), {nr, K}, opts), wt);
      for (int64_t i = 0; i < nr; ++i) rows_from(y + i * nc, nc, out + (p.r0 + r + i) * M + p.c0);
    }
  }
};

// The parts of a call: a few-row range's channels cut into parts so the threads share them (as
// slot_gemm.h small_ranges_by_columns does: where the ranges are fewer than 4 a thread, up to one
// part a thread per range); a larger range's into tiles. Largest first.
std::vector<QPart> plan_qparts(const int64_t* ip, const std::vector<int64_t>& start, int64_t M, int64_t tile_cols,
                               int64_t threads) {
  int64_t ranges = 0;
  for (size_t i = 0; i + 1 < start.size(); ++i) ranges += start[i + 1] > start[i];
  const int64_t n = std::min<int64_t>(threads, (4 * threads + ranges - 1) / std::max<int64_t>(ranges, 1));
  std::vector<QPart> parts;
  for (size_t i = 0; i + 1 < start.size(); ++i) {
    const int64_t r0 = start[i], nr = start[i + 1] - start[i];
    if (nr == 0) continue;
    if (nr <= kSmallRows) {
      for (int64_t t = 0; t < n; ++t) {
        const auto [c0, c1] = part_range(M, t, n, 16);
        if (c1 > c0) parts.push_back({ip[i], r0, nr, c0, c1});
      }
    } else {
      for (int64_t c0 = 0; c0 < M; c0 += tile_cols) parts.push_back({ip[i], r0, nr, c0, std::min(M, c0 + tile_cols)});
    }
  }
  std::stable_sort(parts.begin(), parts.end(), [](const QPart& x, const QPart& y) {
    return x.nr * (x.c1 - x.c0) > y.nr * (y.c1 - y.c0);
  });
  return parts;
}

at::Tensor qgrouped_mm_cpu(const at::Tensor& a_in, const at::Tensor& q_in, const at::Tensor& scale_in,
                           const at::Tensor& slot_ids, const at::Tensor& slot_rows, int64_t bits, int64_t group_size) {
  check_qgrouped_mm_args(a_in, q_in, scale_in, bits, group_size);
  const at::Tensor a = a_in.contiguous();
  const auto start = range_starts(slot_ids, slot_rows, a.size(0), q_in.size(0), "qgrouped_mm", false);
  at::Tensor out = empty_output({a.size(0), q_in.size(1)}, a.options());
  qgrouped_mm_into(a, q_in, scale_in, bits, group_size, slot_ids.contiguous().data_ptr<int64_t>(), start, out);
  zero_tail(out, start.back());
  return out;
}

}  // namespace

void qgrouped_mm_into(const at::Tensor& a, const at::Tensor& q_in, const at::Tensor& scale_in, int64_t bits,
                      int64_t group_size, const int64_t* slot_ids, const std::vector<int64_t>& start, at::Tensor& out) {
  const at::Tensor q = q_in.contiguous(), scale = scale_in.contiguous();
  const int64_t M = q.size(1), K = a.size(1);
  if (start.back() == 0 || M == 0) return;
  const int64_t gs = group_size > 0 ? group_size : std::max<int64_t>(K, 1), KP = padded_inputs(K, group_size);
  MINAGI_DISPATCH_FLOATING(a.scalar_type(), "minagi_qgrouped_mm", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const auto parts = plan_qparts(slot_ids, start, M, tile_columns(KP, M, sizeof(acc_t)), at::get_num_threads());
    auto run = [&](const auto* scale_ptr) {
      using S = std::remove_const_t<std::remove_pointer_t<decltype(scale_ptr)>>;
      const QGemm<scalar_t, S> g{a.data_ptr<scalar_t>(), static_cast<const uint8_t*>(q.data_ptr()), scale_ptr,
                                 out.data_ptr<scalar_t>(), K, M, bits, gs,
                                 group_size > 0 ? (K + group_size - 1) / group_size : 1, q.size(2), KP,
                                 &f32_kernels()};
      run_parts(parts, [&](const QPart& p) { p.nr <= kSmallRows ? g.stream(p) : g.tile(p); });
    };
    switch (scale.scalar_type()) {
      case at::kFloat: return run(scale.data_ptr<float>());
      case at::kBFloat16: return run(static_cast<const uint16_t*>(scale.data_ptr()));
      default: return run(scale.data_ptr<at::Half>());
    }
  });
}

// torch.ops.minagi.cpu_isa (csrc/ops.cpp): the level the quantized kernels run at.
std::string cpu_isa_level() { return cpu_isa_name(cpu_isa()); }

TORCH_LIBRARY_IMPL(minagi, CPU, m) {
  m.impl("qgrouped_mm", &qgrouped_mm_cpu);
}

}  // namespace minagi

#ifdef MINAGI_QUANT_X86
#pragma GCC diagnostic pop
#endif
