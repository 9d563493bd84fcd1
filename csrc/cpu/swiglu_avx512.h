// SwiGLU's rows on AVX-512: out = silu(gate) * up, and its backward, in float32 and bfloat16, for
// both layouts of h (gate and up as halves, or interleaved). The portable loops in
// act_rows.h (swiglu_fwd_row, swiglu_bwd_row) leave vectorising to GCC, which builds them
// for AVX2 at most, and widen bfloat16 through float32 buffers a chunk at a time (a pass to
// widen, one to compute, one to narrow). Here a vector of bfloat16 is widened in registers, the
// exp is the same Cephes range reduction and polynomial as exp_simd (to within its few ulp), and
// gate and up of the interleaved layout come out of one load. Training's first layer runs these
// on every row of every slot, forward and backward: a pass of the sigmoid over [E, I].
//
// Built for the baseline ISA like the rest (no -march=native): the functions carry a target
// attribute, and callers ask swiglu512::available() (CPUID, once) first.
#pragma once

#include <algorithm>
#include <cstdint>

#include "f32_gemm.h"  // MINAGI_AVX512 and <immintrin.h>
#include "isa.h"

// GCC's AVX-512 headers trip -W(maybe-)uninitialized on their own _mm512_undefined_* values.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#if !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif

namespace minagi {
namespace swiglu512 {

#ifdef MINAGI_AVX512

inline bool available() {
  static const bool ok = !cpu_baseline_only() && __builtin_cpu_supports("avx512f") &&
                         __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl");
  return ok;
}

#define MINAGI_AVX512BW_TARGET __attribute__((target("avx512f,avx512bw,avx512vl")))

inline __mmask16 tail16(int64_t n) { return n >= 16 ? __mmask16(0xFFFF) : static_cast<__mmask16>((1u << n) - 1); }
inline __mmask32 tail32(int64_t n) { return n >= 32 ? __mmask32(0xFFFFFFFFu) : static_cast<__mmask32>((1u << n) - 1); }

// 1 / (1 + exp(-x)), exp as exp_simd computes it: its argument clamped to [-87.34, 88] (NaN kept
// NaN: min/max return their second operand on NaN), Cephes' reduction and degree-5 polynomial,
// and 2^n applied by scalef.
MINAGI_AVX512BW_TARGET inline __m512 sigmoid(__m512 x) {
  __m512 t = _mm512_sub_ps(_mm512_setzero_ps(), x);
  t = _mm512_min_ps(_mm512_set1_ps(88.0f), t);
  t = _mm512_max_ps(_mm512_set1_ps(-87.3365478515625f), t);
  const __m512 fx = _mm512_roundscale_ps(_mm512_fmadd_ps(t, _mm512_set1_ps(1.44269504088896341f), _mm512_set1_ps(0.5f)),
                                         _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(fx, _mm512_set1_ps(0.693359375f), t);
  r = _mm512_fmadd_ps(fx, _mm512_set1_ps(2.12194440e-4f), r);
  __m512 p = _mm512_fmadd_ps(_mm512_set1_ps(1.9875691500e-4f), r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  const __m512 one = _mm512_set1_ps(1.0f);
  const __m512 e = _mm512_scalef_ps(_mm512_add_ps(_mm512_fmadd_ps(p, _mm512_mul_ps(r, r), r), one), fx);
  return _mm512_div_ps(one, _mm512_add_ps(one, e));
}

// bfloat16 <-> float32 in registers: widening is exact; narrowing rounds to nearest even and
// gives NaN as 0x7FC0, as c10::BFloat16 (and rows.h's float_to_bf16) do. The narrowed values sit
// in the low 16 bits of each 32-bit lane.
MINAGI_AVX512BW_TARGET inline __m512 widen(__m256i v) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16));
}

MINAGI_AVX512BW_TARGET inline __m512i narrow_lanes(__m512 x) {
  const __m512i u = _mm512_castps_si512(x);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7FFF)), lsb), 16);
  return _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
}

// 16 values of T at p (m: which), as float32, and back.
MINAGI_AVX512BW_TARGET inline __m512 load16(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
MINAGI_AVX512BW_TARGET inline __m512 load16(const uint16_t* p, __mmask16 m) {
  return widen(_mm256_maskz_loadu_epi16(m, p));
}
MINAGI_AVX512BW_TARGET inline void store16(float* p, __m512 x, __mmask16 m) { _mm512_mask_storeu_ps(p, m, x); }
MINAGI_AVX512BW_TARGET inline void store16(uint16_t* p, __m512 x, __mmask16 m) {
  _mm256_mask_storeu_epi16(p, m, _mm512_cvtepi32_epi16(narrow_lanes(x)));
}

// Gate and up of outputs j .. j + n - 1 (n <= 16) of a row of h, W outputs wide: halves, gate at
// h[j..] and up at h[W + j..]; interleaved, pairs (gate, up) from h[2j]. And their gradients into
// gh, laid out as h.
template <bool kInterleaved>
MINAGI_AVX512BW_TARGET inline void load_pairs(const float* h, int64_t W, int64_t j, int64_t n, __m512& gate,
                                              __m512& up) {
  if constexpr (kInterleaved) {
    const __m512 lo = _mm512_maskz_loadu_ps(static_cast<__mmask16>(tail32(2 * n)), h + 2 * j);
    const __m512 hi = _mm512_maskz_loadu_ps(static_cast<__mmask16>(tail32(2 * n) >> 16),
                                            h + 2 * j + 16);
    const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
    gate = _mm512_permutex2var_ps(lo, even, hi);
    up = _mm512_permutex2var_ps(lo, _mm512_add_epi32(even, _mm512_set1_epi32(1)), hi);
  } else {
    gate = _mm512_maskz_loadu_ps(tail16(n), h + j);
    up = _mm512_maskz_loadu_ps(tail16(n), h + W + j);
  }
}

template <bool kInterleaved>
MINAGI_AVX512BW_TARGET inline void load_pairs(const uint16_t* h, int64_t W, int64_t j, int64_t n, __m512& gate,
                                              __m512& up) {
  if constexpr (kInterleaved) {  // a 32-bit lane holds a pair: gate in its low half, up in its high
    const __m512i v = _mm512_maskz_loadu_epi16(tail32(2 * n), h + 2 * j);
    gate = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
    up = _mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
  } else {
    gate = load16(h + j, tail16(n));
    up = load16(h + W + j, tail16(n));
  }
}

template <bool kInterleaved>
MINAGI_AVX512BW_TARGET inline void store_pairs(float* gh, int64_t W, int64_t j, int64_t n, __m512 d_gate,
                                               __m512 d_up) {
  if constexpr (kInterleaved) {
    const __m512i lo_idx = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
    const __m512i hi_idx = _mm512_add_epi32(lo_idx, _mm512_set1_epi32(8));
    const __mmask32 both = tail32(2 * n);
    _mm512_mask_storeu_ps(gh + 2 * j, static_cast<__mmask16>(both), _mm512_permutex2var_ps(d_gate, lo_idx, d_up));
    _mm512_mask_storeu_ps(gh + 2 * j + 16, static_cast<__mmask16>(both >> 16),
                          _mm512_permutex2var_ps(d_gate, hi_idx, d_up));
  } else {
    _mm512_mask_storeu_ps(gh + j, tail16(n), d_gate);
    _mm512_mask_storeu_ps(gh + W + j, tail16(n), d_up);
  }
}

template <bool kInterleaved>
MINAGI_AVX512BW_TARGET inline void store_pairs(uint16_t* gh, int64_t W, int64_t j, int64_t n, __m512 d_gate,
                                               __m512 d_up) {
  if constexpr (kInterleaved) {
    const __m512i v = _mm512_or_si512(narrow_lanes(d_gate), _mm512_slli_epi32(narrow_lanes(d_up), 16));
    _mm512_mask_storeu_epi16(gh + 2 * j, tail32(2 * n), v);
  } else {
    store16(gh + j, d_gate, tail16(n));
    store16(gh + W + j, d_up, tail16(n));
  }
}

// NaN where gate is -inf, as the twin gives (silu(-inf) = -inf / inf there); the clamped exp
// would give -inf * sigmoid(-87) = -inf.
MINAGI_AVX512BW_TARGET inline __m512 nan_at_minus_inf(__m512 gate, __m512 v) {
  const __mmask16 m = _mm512_cmp_ps_mask(gate, _mm512_set1_ps(-__builtin_inff()), _CMP_EQ_OQ);
  return _mm512_mask_mov_ps(v, m, _mm512_set1_ps(__builtin_nanf("")));
}

// One row: o[j] = silu(gate_j) * up_j for j < W. T is float or uint16_t (bfloat16's bits).
template <bool kInterleaved, typename T>
MINAGI_AVX512BW_TARGET void forward_row(const T* h, T* o, int64_t W) {
  for (int64_t j = 0; j < W; j += 16) {
    const int64_t n = std::min<int64_t>(16, W - j);
    __m512 gate, up;
    load_pairs<kInterleaved>(h, W, j, n, gate, up);
    const __m512 out = _mm512_mul_ps(_mm512_mul_ps(gate, sigmoid(gate)), up);
    store16(o + j, nan_at_minus_inf(gate, out), tail16(n));
  }
}

// One row of the backward: d up = grad * silu(gate), d gate = grad * up * silu'(gate), where
// silu'(g) = sg * (1 + g * (1 - sg)), sg = sigmoid(g); into gh, laid out as h.
template <bool kInterleaved, typename T>
MINAGI_AVX512BW_TARGET void backward_row(const T* grad, const T* h, T* gh, int64_t W) {
  const __m512 one = _mm512_set1_ps(1.0f);
  for (int64_t j = 0; j < W; j += 16) {
    const int64_t n = std::min<int64_t>(16, W - j);
    __m512 gate, up;
    load_pairs<kInterleaved>(h, W, j, n, gate, up);
    const __m512 gr = load16(grad + j, tail16(n)), sg = sigmoid(gate);
    const __m512 d_up = _mm512_mul_ps(_mm512_mul_ps(gr, gate), sg);
    const __m512 dsilu = _mm512_mul_ps(sg, _mm512_fmadd_ps(gate, _mm512_sub_ps(one, sg), one));
    const __m512 d_gate = _mm512_mul_ps(_mm512_mul_ps(gr, up), dsilu);
    store_pairs<kInterleaved>(gh, W, j, n, nan_at_minus_inf(gate, d_gate), nan_at_minus_inf(gate, d_up));
  }
}

#else  // no AVX-512 intrinsics in this build: the portable loops serve

inline bool available() { return false; }

#endif  // MINAGI_AVX512

}  // namespace swiglu512
}  // namespace minagi

#pragma GCC diagnostic pop
