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
// the order of the float32 sums.
//
// The inner loops come in three builds, picked once at run time (isa.h cpu_isa: CPUID, capped by
// MINAGI_CPU_ISA): portable C++, AVX2 + FMA, and AVX-512. They are compiled for the baseline ISA
// with target attributes (no -march=native), so every x86-64 build carries all three. AVX-512
// VNNI's integer dot products are not used: they would need the activations quantized to int8 too,
// which the oracle does not do (results would move by far more than float32 rounding).
#include <torch/library.h>

#include <ATen/ATen.h>
#include <ATen/ops/mm_cpu_dispatch.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

#include "../common.h"
#include "isa.h"
#include "rows.h"
#include "scheduling.h"

#if defined(__x86_64__) && defined(__GNUC__) && !defined(_WIN32)
#define MINAGI_QUANT_X86 1
#include <immintrin.h>
#define MINAGI_AVX2_FMA __attribute__((target("avx2,fma")))
#define MINAGI_AVX512_QUANT __attribute__((target("avx512f,avx512bw,avx512vl,avx2,fma")))
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

// ---------------------------------------------------------------- portable

// One 32-input block of an output channel's values (int8: 32 bytes; int4: 16 bytes, input j in
// byte j's low nibble and input j + 16 in its high one, each nibble the value + 8).
template <int bits, typename acc_t>
inline void unpack_block(const uint8_t* q, acc_t* w) {
  if constexpr (bits == 8) {
    const int8_t* v = reinterpret_cast<const int8_t*>(q);
    for (int j = 0; j < 32; ++j) w[j] = static_cast<acc_t>(v[j]);
  } else {
    for (int j = 0; j < 16; ++j) {
      w[j] = static_cast<acc_t>(static_cast<int>(q[j] & 15) - 8);
      w[j + 16] = static_cast<acc_t>(static_cast<int>(q[j] >> 4) - 8);
    }
  }
}

// y[r] = sum_i x[r * ldx + i] * value_i * s[i / gs] over K inputs of one output channel, r < nr.
// gs = K for one scale per channel (int8 only; K then need not be a multiple of 32).
template <int bits, typename acc_t>
void qdot_portable(const acc_t* x, int64_t ldx, int nr, const uint8_t* q, const acc_t* s, int64_t K, int64_t gs,
                   acc_t* y) {
  acc_t w[32];
  for (int r = 0; r < nr; ++r) y[r] = 0;
  for (int64_t g0 = 0; g0 < K; g0 += gs) {
    const int64_t g1 = std::min(K, g0 + gs);
    acc_t part[kSmallRows] = {};
    int64_t i = g0;
    for (; i + kBlock <= g1; i += kBlock) {
      unpack_block<bits>(q + (bits == 8 ? i : i / 2), w);
      for (int r = 0; r < nr; ++r) {
        const acc_t* xr = x + r * ldx + i;
        acc_t sum = 0;
        for (int j = 0; j < 32; ++j) sum += xr[j] * w[j];
        part[r] += sum;
      }
    }
    for (; i < g1; ++i) {  // int8 with one scale per channel: the inputs past the last block
      const acc_t v = static_cast<acc_t>(reinterpret_cast<const int8_t*>(q)[i]);
      for (int r = 0; r < nr; ++r) part[r] += x[r * ldx + i] * v;
    }
    const acc_t sc = s[g0 / gs];
    for (int r = 0; r < nr; ++r) y[r] += part[r] * sc;
  }
}

// out[i] = value_i * s[i / gs]: one output channel's float weights, for the tile.
template <int bits, typename acc_t>
void dequant_portable(const uint8_t* q, const acc_t* s, int64_t K, int64_t gs, acc_t* out) {
  for (int64_t g0 = 0; g0 < K; g0 += gs) {
    const int64_t g1 = std::min(K, g0 + gs);
    const acc_t sc = s[g0 / gs];
    int64_t i = g0;
    for (; i + kBlock <= g1; i += kBlock) {
      unpack_block<bits>(q + (bits == 8 ? i : i / 2), out + i);
      for (int j = 0; j < 32; ++j) out[i + j] *= sc;
    }
    for (; i < g1; ++i) out[i] = static_cast<acc_t>(reinterpret_cast<const int8_t*>(q)[i]) * sc;
  }
}

#ifdef MINAGI_QUANT_X86

// ---------------------------------------------------------------- AVX2 + FMA

MINAGI_AVX2_FMA inline float hsum256(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// 8 int8 values from 8 bytes, as floats.
MINAGI_AVX2_FMA inline __m256 i8x8_ps(__m128i v8) { return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v8)); }

// One 32-input block as four vectors of 8 floats (inputs 0-7, 8-15, 16-23, 24-31).
template <int bits>
MINAGI_AVX2_FMA inline void block_avx2(const uint8_t* q, __m256 w[4]) {
  if constexpr (bits == 8) {
    for (int u = 0; u < 4; ++u) w[u] = i8x8_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + 8 * u)));
  } else {
    const __m128i m0f = _mm_set1_epi8(0x0F), m8 = _mm_set1_epi8(8);
    const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q));
    const __m128i lo = _mm_sub_epi8(_mm_and_si128(v, m0f), m8);
    const __m128i hi = _mm_sub_epi8(_mm_and_si128(_mm_srli_epi16(v, 4), m0f), m8);
    w[0] = i8x8_ps(lo);
    w[1] = i8x8_ps(_mm_unpackhi_epi64(lo, lo));
    w[2] = i8x8_ps(hi);
    w[3] = i8x8_ps(_mm_unpackhi_epi64(hi, hi));
  }
}

// qdot_portable's sums for R rows. Each row keeps U chains of 8 lanes, enough independent FMAs to
// hide their latency. Within a group the products are summed unscaled and the group's sum is
// scaled once (one scale per channel: a single group).
template <int bits, int R>
MINAGI_AVX2_FMA void qdot_avx2(const float* x, int64_t ldx, const uint8_t* q, const float* s, int64_t K, int64_t gs,
                               float* y) {
  constexpr int U = R <= 2 ? 4 : 2;
  __m256 acc[R][U];
  for (int r = 0; r < R; ++r)
    for (int u = 0; u < U; ++u) acc[r][u] = _mm256_setzero_ps();
  float tail[R] = {};
  for (int64_t g0 = 0; g0 < K; g0 += gs) {
    const int64_t g1 = std::min(K, g0 + gs);
    __m256 part[R][U];
    for (int r = 0; r < R; ++r)
      for (int u = 0; u < U; ++u) part[r][u] = _mm256_setzero_ps();
    int64_t i = g0;
    for (; i + kBlock <= g1; i += kBlock) {
      __m256 w[4];
      block_avx2<bits>(q + (bits == 8 ? i : i / 2), w);
      for (int u = 0; u < 4; ++u)
        for (int r = 0; r < R; ++r)
          part[r][u % U] = _mm256_fmadd_ps(_mm256_loadu_ps(x + r * ldx + i + 8 * u), w[u], part[r][u % U]);
    }
    if constexpr (bits == 8) {  // one scale per channel: the inputs past the last block
      for (; i + 8 <= g1; i += 8) {
        const __m256 w = i8x8_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + i)));
        for (int r = 0; r < R; ++r) part[r][0] = _mm256_fmadd_ps(_mm256_loadu_ps(x + r * ldx + i), w, part[r][0]);
      }
      for (; i < g1; ++i) {
        const float v = static_cast<float>(reinterpret_cast<const int8_t*>(q)[i]);
        for (int r = 0; r < R; ++r) tail[r] += x[r * ldx + i] * v;
      }
    }
    const __m256 sc = _mm256_set1_ps(s[g0 / gs]);
    for (int r = 0; r < R; ++r)
      for (int u = 0; u < U; ++u) acc[r][u] = _mm256_fmadd_ps(part[r][u], sc, acc[r][u]);
  }
  for (int r = 0; r < R; ++r) {
    __m256 t = acc[r][0];
    for (int u = 1; u < U; ++u) t = _mm256_add_ps(t, acc[r][u]);
    y[r] = hsum256(t) + tail[r] * s[0];  // a tail only where one scale covers the channel
  }
}

template <int bits>
MINAGI_AVX2_FMA void dequant_avx2(const uint8_t* q, const float* s, int64_t K, int64_t gs, float* out) {
  for (int64_t g0 = 0; g0 < K; g0 += gs) {
    const int64_t g1 = std::min(K, g0 + gs);
    const __m256 sc = _mm256_set1_ps(s[g0 / gs]);
    int64_t i = g0;
    for (; i + kBlock <= g1; i += kBlock) {
      __m256 w[4];
      block_avx2<bits>(q + (bits == 8 ? i : i / 2), w);
      for (int u = 0; u < 4; ++u) _mm256_storeu_ps(out + i + 8 * u, _mm256_mul_ps(w[u], sc));
    }
    for (; i < g1; ++i) out[i] = static_cast<float>(reinterpret_cast<const int8_t*>(q)[i]) * s[g0 / gs];
  }
}

// ---------------------------------------------------------------- AVX-512

// One 32-input block as two vectors of 16 floats (inputs 0-15, 16-31).
template <int bits>
MINAGI_AVX512_QUANT inline void block_avx512(const uint8_t* q, __m512 w[2]) {
  if constexpr (bits == 8) {
    for (int u = 0; u < 2; ++u) {
      w[u] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 16 * u))));
    }
  } else {
    const __m128i m0f = _mm_set1_epi8(0x0F), m8 = _mm_set1_epi8(8);
    const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q));
    w[0] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_sub_epi8(_mm_and_si128(v, m0f), m8)));
    w[1] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_sub_epi8(_mm_and_si128(_mm_srli_epi16(v, 4), m0f), m8)));
  }
}

template <int bits, int R>
MINAGI_AVX512_QUANT void qdot_avx512(const float* x, int64_t ldx, const uint8_t* q, const float* s, int64_t K,
                                     int64_t gs, float* y) {
  constexpr int U = R <= 2 ? 4 : 2;  // chains a row; a block feeds two of them
  __m512 acc[R][U];
  for (int r = 0; r < R; ++r)
    for (int u = 0; u < U; ++u) acc[r][u] = _mm512_setzero_ps();
  float tail[R] = {};
  for (int64_t g0 = 0; g0 < K; g0 += gs) {
    const int64_t g1 = std::min(K, g0 + gs);
    __m512 part[R][U];
    for (int r = 0; r < R; ++r)
      for (int u = 0; u < U; ++u) part[r][u] = _mm512_setzero_ps();
    int64_t i = g0;
    int flip = 0;  // alternate the blocks between the chain pairs
    for (; i + kBlock <= g1; i += kBlock, flip ^= (U == 4 ? 2 : 0)) {
      __m512 w[2];
      block_avx512<bits>(q + (bits == 8 ? i : i / 2), w);
      for (int u = 0; u < 2; ++u)
        for (int r = 0; r < R; ++r)
          part[r][u + flip] = _mm512_fmadd_ps(_mm512_loadu_ps(x + r * ldx + i + 16 * u), w[u], part[r][u + flip]);
    }
    if constexpr (bits == 8) {
      for (; i < g1; ++i) {
        const float v = static_cast<float>(reinterpret_cast<const int8_t*>(q)[i]);
        for (int r = 0; r < R; ++r) tail[r] += x[r * ldx + i] * v;
      }
    }
    const __m512 sc = _mm512_set1_ps(s[g0 / gs]);
    for (int r = 0; r < R; ++r)
      for (int u = 0; u < U; ++u) acc[r][u] = _mm512_fmadd_ps(part[r][u], sc, acc[r][u]);
  }
  for (int r = 0; r < R; ++r) {
    __m512 t = acc[r][0];
    for (int u = 1; u < U; ++u) t = _mm512_add_ps(t, acc[r][u]);
    y[r] = _mm512_reduce_add_ps(t) + tail[r] * s[0];
  }
}

#endif  // MINAGI_QUANT_X86

// ---------------------------------------------------------------- the kernels picked at run time

using DotFn = void (*)(const float*, int64_t, const uint8_t*, const float*, int64_t, int64_t, float*);
using DequantFn = void (*)(const uint8_t*, const float*, int64_t, int64_t, float*);

template <int bits, int R>
void qdot_portable_f32(const float* x, int64_t ldx, const uint8_t* q, const float* s, int64_t K, int64_t gs,
                       float* y) {
  qdot_portable<bits, float>(x, ldx, R, q, s, K, gs, y);
}

template <int bits>
void dequant_portable_f32(const uint8_t* q, const float* s, int64_t K, int64_t gs, float* out) {
  dequant_portable<bits, float>(q, s, K, gs, out);
}

// The float32 kernels of one ISA level: dot[rows - 1] and dequant, for int8 and int4.
struct F32Kernels {
  DotFn dot8[kSmallRows], dot4[kSmallRows];
  DequantFn dequant8, dequant4;
};

#define MINAGI_DOTS(fn, bits) {&fn<bits, 1>, &fn<bits, 2>, &fn<bits, 3>, &fn<bits, 4>}
static_assert(kSmallRows == 4, "the tables below list the row counts 1..kSmallRows");

const F32Kernels& f32_kernels() {
  static const F32Kernels portable{MINAGI_DOTS(qdot_portable_f32, 8), MINAGI_DOTS(qdot_portable_f32, 4),
                                   &dequant_portable_f32<8>, &dequant_portable_f32<4>};
#ifdef MINAGI_QUANT_X86
  static const F32Kernels avx2{MINAGI_DOTS(qdot_avx2, 8), MINAGI_DOTS(qdot_avx2, 4), &dequant_avx2<8>,
                               &dequant_avx2<4>};
  // The tile's dequantization is a small share of a prefill's work: AVX2's serves AVX-512 too.
  static const F32Kernels avx512{MINAGI_DOTS(qdot_avx512, 8), MINAGI_DOTS(qdot_avx512, 4), &dequant_avx2<8>,
                                 &dequant_avx2<4>};
  switch (cpu_isa()) {
    case CpuIsa::kAvx512: return avx512;
    case CpuIsa::kAvx2: return avx2;
    default: return portable;
  }
#else
  return portable;
#endif
}
#undef MINAGI_DOTS

// ---------------------------------------------------------------- the op

void check_qgrouped_mm_args(const at::Tensor& a, const at::Tensor& q, const at::Tensor& scale, int64_t bits,
                            int64_t group_size) {
  const char* op = "qgrouped_mm";
  check_dim(a, 2, op, "a");
  check_floating(a, op, "a");
  check_dim(q, 3, op, "q");
  TORCH_CHECK_VALUE(bits == 8 || bits == 4, "minagi.qgrouped_mm: bits must be 8 or 4, got ", bits);
  const auto want = bits == 8 ? at::kChar : at::kByte;
  TORCH_CHECK_VALUE(q.scalar_type() == want, "minagi.qgrouped_mm: int", bits, " weights come as q of dtype ",
                    bits == 8 ? "int8" : "uint8 (two values a byte)", ", got ", q.scalar_type());
  const int64_t K = a.size(1), per_byte = bits == 8 ? 1 : 2;
  TORCH_CHECK_VALUE(q.size(2) * per_byte == K, "minagi.qgrouped_mm: q [S, out, ", bits == 8 ? "in" : "in / 2",
                    "] must match a's ", K, " inputs, got q of shape ", q.sizes());
  TORCH_CHECK_VALUE(group_size >= 0 && group_size % kBlock == 0 && (group_size == 0 || K % group_size == 0),
                    "minagi.qgrouped_mm: group_size must be 0 (one scale per output channel) or a multiple of 32 "
                    "that divides the ", K, " inputs, got ", group_size);
  TORCH_CHECK_VALUE(bits == 8 || (group_size > 0 && K % kBlock == 0), "minagi.qgrouped_mm: int4 needs a group_size ",
                    "(a multiple of 32 dividing the inputs), got ", group_size, " for ", K, " inputs");
  const auto st = scale.scalar_type();
  TORCH_CHECK_VALUE(st == at::kFloat || st == at::kBFloat16 || st == at::kHalf,
                    "minagi.qgrouped_mm: scale must be float32, bfloat16 or float16, got ", st);
  const bool shape_ok = group_size == 0 ? scale.dim() == 2 && scale.size(0) == q.size(0) && scale.size(1) == q.size(1)
                                        : scale.dim() == 3 && scale.size(0) == q.size(0) &&
                                              scale.size(1) == q.size(1) && scale.size(2) == K / group_size;
  TORCH_CHECK_VALUE(shape_ok, "minagi.qgrouped_mm: scale must be [S, out] = [", q.size(0), ", ", q.size(1),
                    "] for group_size 0, else [S, out, in / group_size]; got ", scale.sizes(), " with group_size ",
                    group_size, " and ", K, " inputs");
  check_same_device(a, q, op, "a", "q");
  check_same_device(a, scale, op, "a", "scale");
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

template <typename scale_t, typename acc_t>
inline void scales_to(const scale_t* s, int64_t n, acc_t* out) {
  for (int64_t g = 0; g < n; ++g) out[g] = static_cast<acc_t>(static_cast<float>(s[g]));
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

template <typename scalar_t, typename scale_t>
struct QGemm {
  using acc_t = at::opmath_type<scalar_t>;
  const scalar_t* a;
  const uint8_t* q;
  const scale_t* scale;
  scalar_t* out;
  int64_t K, M, bits, gs, G, q_row;  // inputs, outputs, bits, inputs a scale, scales a channel, bytes a channel
  const F32Kernels* kernels;  // float32's ISA kernels (nullptr: the portable templates in acc_t)

  const uint8_t* channel(int64_t slot, int64_t o) const { return q + (slot * M + o) * q_row; }
  const scale_t* scales(int64_t slot, int64_t o) const { return scale + (slot * M + o) * G; }

  void dot(const acc_t* x, int nr, const uint8_t* qc, const acc_t* s, acc_t* y) const {
    if constexpr (std::is_same_v<acc_t, float>) {
      if (kernels) return (bits == 8 ? kernels->dot8 : kernels->dot4)[nr - 1](x, K, qc, s, K, gs, y);
    }
    bits == 8 ? qdot_portable<8, acc_t>(x, K, nr, qc, s, K, gs, y) : qdot_portable<4, acc_t>(x, K, nr, qc, s, K, gs, y);
  }

  void dequant(const uint8_t* qc, const acc_t* s, acc_t* w) const {
    if constexpr (std::is_same_v<acc_t, float>) {
      if (kernels) return (bits == 8 ? kernels->dequant8 : kernels->dequant4)(qc, s, K, gs, w);
    }
    bits == 8 ? dequant_portable<8, acc_t>(qc, s, K, gs, w) : dequant_portable<4, acc_t>(qc, s, K, gs, w);
  }

  // A few rows: each channel's bytes read once, every row's dot product from them.
  void stream(const QPart& p) const {
    std::vector<acc_t> own;
    acc_t* buf = thread_scratch<acc_t>(G + p.nr * K, own);
    acc_t* s = buf;
    const acc_t* x = reinterpret_cast<const acc_t*>(a + p.r0 * K);
    if constexpr (!std::is_same_v<scalar_t, acc_t>) {
      rows_to(a + p.r0 * K, p.nr * K, buf + G);
      x = buf + G;
    }
    acc_t y[kSmallRows];
    for (int64_t o = p.c0; o < p.c1; ++o) {
      scales_to(scales(p.slot, o), G, s);
      dot(x, static_cast<int>(p.nr), channel(p.slot, o), s, y);
      for (int64_t r = 0; r < p.nr; ++r) out[(p.r0 + r) * M + o] = static_cast<scalar_t>(y[r]);
    }
  }

  // Many rows: the block's channels dequantized into a tile once, the rows multiplied by it in
  // chunks (converted to acc_t where a is not), through ATen's mm.
  void tile(const QPart& p) const {
    const int64_t nc = p.c1 - p.c0;
    const int64_t chunk = std::min<int64_t>(p.nr, std::max<int64_t>(16, (int64_t{1} << 20) / (std::max<int64_t>(K, 1) * sizeof(acc_t))));
    constexpr bool convert = !std::is_same_v<scalar_t, acc_t>;
    std::vector<acc_t> own;
    acc_t* buf = thread_scratch<acc_t>(G + nc * K + chunk * nc + (convert ? chunk * K : 0), own);
    acc_t *s = buf, *w = buf + G, *y = w + nc * K, *xa = y + chunk * nc;
    for (int64_t o = p.c0; o < p.c1; ++o) {
      scales_to(scales(p.slot, o), G, s);
      dequant(channel(p.slot, o), s, w + (o - p.c0) * K);
    }
    const auto opts = at::TensorOptions().dtype(c10::CppTypeToScalarType<acc_t>::value);
    const at::Tensor wt = at::from_blob(w, {nc, K}, opts).t();
    for (int64_t r = 0; r < p.nr; r += chunk) {
      const int64_t nr = std::min(chunk, p.nr - r);
      const scalar_t* ar = a + (p.r0 + r) * K;
      const acc_t* x = reinterpret_cast<const acc_t*>(ar);
      if constexpr (convert) {
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
std::vector<QPart> plan_qparts(const at::Tensor& slot_ids, const std::vector<int64_t>& start, int64_t M,
                               int64_t tile_cols, int64_t threads) {
  const int64_t* ip = slot_ids.data_ptr<int64_t>();
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
  const at::Tensor a = a_in.contiguous(), q = q_in.contiguous(), scale = scale_in.contiguous();
  const int64_t S = q.size(0), M = q.size(1), K = a.size(1);
  const auto start = range_starts(slot_ids, slot_rows, a.size(0), S, "qgrouped_mm", false);
  at::Tensor out = empty_output({a.size(0), M}, a.options());
  if (start.back() > 0 && M > 0) {
    const int64_t gs = group_size > 0 ? group_size : std::max<int64_t>(K, 1);
    MINAGI_DISPATCH_FLOATING(a.scalar_type(), "minagi_qgrouped_mm", [&] {
      using acc_t = at::opmath_type<scalar_t>;
      const auto parts = plan_qparts(slot_ids.contiguous(), start, M, tile_columns(K, M, sizeof(acc_t)),
                                     at::get_num_threads());
      auto run = [&](auto* scale_ptr) {
        using scale_t = std::remove_const_t<std::remove_pointer_t<decltype(scale_ptr)>>;
        const QGemm<scalar_t, scale_t> g{a.data_ptr<scalar_t>(), reinterpret_cast<const uint8_t*>(q.data_ptr()),
                                         scale_ptr, out.data_ptr<scalar_t>(), K, M, bits, gs,
                                         group_size > 0 ? K / group_size : 1, q.size(2),
                                         cpu_isa() == CpuIsa::kPortable ? nullptr : &f32_kernels()};
        run_parts(parts, [&](const QPart& p) { p.nr <= kSmallRows ? g.stream(p) : g.tile(p); });
      };
      switch (scale.scalar_type()) {
        case at::kFloat: return run(scale.data_ptr<float>());
        case at::kBFloat16: return run(scale.data_ptr<at::BFloat16>());
        default: return run(scale.data_ptr<at::Half>());
      }
    });
  }
  zero_tail(out, start.back());
  return out;
}

}  // namespace

// torch.ops.minagi.cpu_isa (csrc/ops.cpp): the level the quantized kernels run at.
std::string cpu_isa_level() { return cpu_isa_name(cpu_isa()); }

TORCH_LIBRARY_IMPL(minagi, CPU, m) {
  m.impl("qgrouped_mm", &qgrouped_mm_cpu);
}

}  // namespace minagi

#ifdef MINAGI_QUANT_X86
#pragma GCC diagnostic pop
#endif
