// The expert forms' activation loops on the CPU, forward and backward, one row at a time: SwiGLU
// (halves and interleaved) and GPT-OSS's clamped form written for the vectoriser, with
// swiglu_avx512.h's rows where the CPU has AVX-512. The forms' maths is csrc/activation.h's; these
// are its fast row loops. Templates, included by grouped_gemm_act.cpp (forward) and
// grouped_gemm_backward.cpp (backward).
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <limits>
#include <type_traits>
#include <utility>

#include "../common.h"
#include "rows.h"
#include "swiglu_avx512.h"

namespace minagi {
namespace {

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
// up * silu'(gate). ATen's silu, mul and silu_backward on the forms' views were slower in the
// backward and in the interleaved forward (docs/log/2026-12-05-swiglu-loops.md); in the halves
// forward they were as fast, but as two ATen calls and four views a slot's part.
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

}  // namespace
}  // namespace minagi
