// The expert forms' activations, forward and backward, one element (or one gate/up pair) at a
// time in the op-math type: the one definition the CPU kernels and the GPU kernels share. No
// torch here, so the GPU kernel headers can take it in every build (torch, emulator, HIP alone).
//
// A row of h (the first GEMM's output, bias included) holds H values for the plain forms and
// 2H for the gated ones, laid out as the form says:
//   gelu, gelu_tanh, silu, relu2     a = f(h)                                    h: [H]
//   swiglu                           a = silu(gate) * up      h: [gate | up]     (halves)
//   swiglu_interleaved               a = silu(gate) * up      h: gate, up, gate, up, ...
//   swiglu_oai (GPT-OSS)             gate <= limit, -limit <= up <= limit (clamped),
//                                    a = (up + 1) * gate * sigmoid(alpha * gate); interleaved
// A clamped value passes no gradient, as torch's clamp (the bounds themselves pass it).
#pragma once

#include <math.h>

#include <cstdint>

#if defined(__CUDACC__) || defined(__HIPCC__)
#define MINAGI_ACT_HD __host__ __device__
#else
#define MINAGI_ACT_HD
#endif

namespace minagi {

enum class Act : int { Gelu = 0, GeluTanh, Silu, Relu2, Swiglu, SwigluInterleaved, SwigluOai };

// The forms by name, in Act's order (the Python side lists the same names).
constexpr const char* kActNames[] = {"gelu", "gelu_tanh", "silu", "relu2", "swiglu", "swiglu_interleaved",
                                     "swiglu_oai"};
constexpr int kNumActs = 7;

MINAGI_ACT_HD inline bool act_gated(Act a) { return a >= Act::Swiglu; }

namespace act_math {
MINAGI_ACT_HD inline float exp_(float x) { return expf(x); }
MINAGI_ACT_HD inline double exp_(double x) { return exp(x); }
MINAGI_ACT_HD inline float erf_(float x) { return erff(x); }
MINAGI_ACT_HD inline double erf_(double x) { return erf(x); }
MINAGI_ACT_HD inline float tanh_(float x) { return tanhf(x); }
MINAGI_ACT_HD inline double tanh_(double x) { return tanh(x); }

template <typename T>
MINAGI_ACT_HD inline T sigmoid(T x) {
  return T(1) / (T(1) + exp_(-x));
}
}  // namespace act_math

// f(x) and f'(x) of the plain forms.
template <typename T>
MINAGI_ACT_HD inline T act_plain(Act a, T x) {
  using namespace act_math;
  switch (a) {
    case Act::Gelu:
      return T(0.5) * x * (T(1) + erf_(x * T(0.70710678118654752440)));
    case Act::GeluTanh: {
      const T inner = T(0.79788456080286535588) * (x + T(0.044715) * x * x * x);
      return T(0.5) * x * (T(1) + tanh_(inner));
    }
    case Act::Silu:
      return x * sigmoid(x);
    default: {  // Relu2
      const T r = x > T(0) ? x : T(0);
      return r * r;
    }
  }
}

template <typename T>
MINAGI_ACT_HD inline T act_plain_grad(Act a, T x) {
  using namespace act_math;
  switch (a) {
    case Act::Gelu: {
      const T cdf = T(0.5) * (T(1) + erf_(x * T(0.70710678118654752440)));
      const T pdf = exp_(T(-0.5) * x * x) * T(0.39894228040143267794);
      return cdf + x * pdf;
    }
    case Act::GeluTanh: {
      const T k = T(0.79788456080286535588), c = T(0.044715);
      const T th = tanh_(k * (x + c * x * x * x));
      return T(0.5) * (T(1) + th) + T(0.5) * x * (T(1) - th * th) * k * (T(1) + T(3) * c * x * x);
    }
    case Act::Silu: {
      const T s = sigmoid(x);
      return s * (T(1) + x * (T(1) - s));
    }
    default:  // Relu2
      return x > T(0) ? T(2) * x : T(0);
  }
}

// The gated forms: a from (gate, up), and the gradients of gate and up given a's gradient.
template <typename T>
MINAGI_ACT_HD inline T act_gated_fwd(Act a, T gate, T up, T alpha, T limit) {
  using namespace act_math;
  if (a == Act::SwigluOai) {
    const T g = gate > limit ? limit : gate;
    const T u = up > limit ? limit : (up < -limit ? -limit : up);
    return (u + T(1)) * g * sigmoid(alpha * g);
  }
  return gate * sigmoid(gate) * up;
}

template <typename T>
MINAGI_ACT_HD inline void act_gated_bwd(Act a, T gate, T up, T alpha, T limit, T grad, T* d_gate, T* d_up) {
  using namespace act_math;
  if (a == Act::SwigluOai) {
    const bool g_in = !(gate > limit), u_in = !(up > limit) && !(up < -limit);
    const T g = g_in ? gate : limit;
    const T u = u_in ? up : (up > limit ? limit : -limit);
    const T s = sigmoid(alpha * g);
    const T glu = g * s;
    *d_gate = g_in ? grad * (u + T(1)) * (s + alpha * glu * (T(1) - s)) : T(0);
    *d_up = u_in ? grad * glu : T(0);
    return;
  }
  const T s = sigmoid(gate);
  *d_gate = grad * up * s * (T(1) + gate * (T(1) - s));
  *d_up = grad * gate * s;
}

// Where a row's gate and up of output column j sit in h (row length 2H for gated forms).
MINAGI_ACT_HD inline void gated_cols(Act a, int64_t j, int64_t H, int64_t* g, int64_t* u) {
  if (a == Act::Swiglu) {
    *g = j;
    *u = H + j;
  } else {
    *g = 2 * j;
    *u = 2 * j + 1;
  }
}

}  // namespace minagi
