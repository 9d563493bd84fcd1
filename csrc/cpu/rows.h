// Row loops shared by the CPU kernels: bfloat16 <-> float32 in chunks, and the dot products and
// scalings of single rows, in forms GCC vectorises for bfloat16 as well.
#pragma once

#include <ATen/OpMathType.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>

namespace minagi {
namespace {

#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && defined(__linux__)
// Built for the baseline ISA (no -march=native); where the CPU has AVX2 + FMA, a loop so marked
// runs from a clone compiled for them, picked at load time.
#define MINAGI_SIMD_CLONES __attribute__((target_clones("arch=x86-64-v3", "default")))
#else
#define MINAGI_SIMD_CLONES
#endif

// Values per chunk where a bfloat16 row goes through float32: a few KiB on the stack.
constexpr int64_t kActChunk = 256;

// bfloat16 <-> float32 as bit operations the vectoriser takes (c10::BFloat16's own conversions,
// through a struct, kept the bfloat16 activation loops scalar): widening is exact, narrowing rounds
// to nearest even with NaN kept NaN, as c10::BFloat16 does.
MINAGI_SIMD_CLONES void bf16_to_float(const uint16_t* __restrict x, float* __restrict y, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t bits = static_cast<uint32_t>(x[i]) << 16;
    std::memcpy(y + i, &bits, sizeof(float));
  }
}

MINAGI_SIMD_CLONES void float_to_bf16(const float* __restrict y, uint16_t* __restrict x, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    uint32_t u;
    std::memcpy(&u, y + i, sizeof(u));
    const uint16_t v = static_cast<uint16_t>((u + ((u >> 16) & 1u) + 0x7FFFu) >> 16);
    x[i] = y[i] != y[i] ? uint16_t{0x7FC0} : v;
  }
}

// <x, y> and x *= w over n values. In bfloat16 the values go through float32 chunks: c10's
// conversions (a struct apiece) kept GCC from vectorising the plain loops, which made the gate
// scaling of scatter_mm_backward's tile (every row of grad_y, D wide) a third of its time.
template <typename scalar_t, typename acc_t = at::opmath_type<scalar_t>>
MINAGI_SIMD_CLONES acc_t dot_row(const scalar_t* __restrict x, const scalar_t* __restrict y, int64_t n) {
  acc_t dot = 0;
  if constexpr (std::is_same_v<scalar_t, at::BFloat16>) {
    alignas(64) float xf[kActChunk], yf[kActChunk];
    for (int64_t j0 = 0; j0 < n; j0 += kActChunk) {
      const int64_t m = std::min(kActChunk, n - j0);
      bf16_to_float(reinterpret_cast<const uint16_t*>(x) + j0, xf, m);
      bf16_to_float(reinterpret_cast<const uint16_t*>(y) + j0, yf, m);
#pragma omp simd reduction(+ : dot)
      for (int64_t c = 0; c < m; ++c) dot += xf[c] * yf[c];
    }
  } else {
#pragma omp simd reduction(+ : dot)
    for (int64_t c = 0; c < n; ++c) dot += static_cast<acc_t>(x[c]) * static_cast<acc_t>(y[c]);
  }
  return dot;
}

template <typename scalar_t, typename acc_t = at::opmath_type<scalar_t>>
MINAGI_SIMD_CLONES void scale_row(scalar_t* __restrict x, acc_t w, int64_t n) {
  if constexpr (std::is_same_v<scalar_t, at::BFloat16>) {
    alignas(64) float xf[kActChunk];
    for (int64_t j0 = 0; j0 < n; j0 += kActChunk) {
      const int64_t m = std::min(kActChunk, n - j0);
      uint16_t* xb = reinterpret_cast<uint16_t*>(x) + j0;
      bf16_to_float(xb, xf, m);
#pragma omp simd
      for (int64_t c = 0; c < m; ++c) xf[c] *= w;
      float_to_bf16(xf, xb, m);  // rounds as c10's conversion does (nearest even, NaN kept)
    }
  } else {
#pragma omp simd
    for (int64_t c = 0; c < n; ++c) x[c] = static_cast<scalar_t>(w * static_cast<acc_t>(x[c]));
  }
}

// acc[0, n) += w * x[0, n), in float32 for bfloat16 (widened in the loop, as bf16_to_float does:
// c10's conversion kept it scalar) and store_row's rounding back.
template <typename scalar_t, typename acc_t = at::opmath_type<scalar_t>>
MINAGI_SIMD_CLONES void axpy_row(acc_t* __restrict acc, acc_t w, const scalar_t* __restrict x, int64_t n) {
  if constexpr (std::is_same_v<scalar_t, at::BFloat16>) {
    const uint16_t* xb = reinterpret_cast<const uint16_t*>(x);
#pragma omp simd
    for (int64_t c = 0; c < n; ++c) {
      const uint32_t bits = static_cast<uint32_t>(xb[c]) << 16;
      float v;
      std::memcpy(&v, &bits, sizeof(float));
      acc[c] += w * v;
    }
  } else {
#pragma omp simd
    for (int64_t c = 0; c < n; ++c) acc[c] += w * static_cast<acc_t>(x[c]);
  }
}

template <typename scalar_t, typename acc_t = at::opmath_type<scalar_t>>
MINAGI_SIMD_CLONES void store_row(scalar_t* __restrict x, const acc_t* __restrict acc, int64_t n) {
  if constexpr (std::is_same_v<scalar_t, at::BFloat16>) {
    float_to_bf16(acc, reinterpret_cast<uint16_t*>(x), n);  // rounds as c10's conversion does
  } else {
#pragma omp simd
    for (int64_t c = 0; c < n; ++c) x[c] = static_cast<scalar_t>(acc[c]);
  }
}

// One character's output row: out = sum over j < k of gates[j] * rows[dest[j]], summed in acc_t in
// acc (D values of scratch) and rounded once; a negative dest adds nothing, no gates means 1.
// weighted_scatter's row, and decode_experts' gated sum.
template <typename scalar_t, typename acc_t = at::opmath_type<scalar_t>>
void gated_row_sum(scalar_t* out, const scalar_t* rows, const int64_t* dest, const scalar_t* gates, int64_t k,
                   int64_t D, acc_t* acc) {
  std::fill(acc, acc + D, acc_t(0));
  for (int64_t j = 0; j < k; ++j) {
    if (dest[j] < 0) continue;
    axpy_row(acc, gates == nullptr ? acc_t(1) : static_cast<acc_t>(gates[j]), rows + dest[j] * D, D);
  }
  store_row(out, acc, D);
}

}  // namespace
}  // namespace minagi
