// What the kernel headers (*_kernels.cuh) take from torch, and from nowhere else: the device
// assert, the op-math type, shared memory and a NaN test (bucket comes from
// csrc/sizes.h, the same in every build). Three builds include the kernels:
//   - the torch launchers (*.cu, nvcc or hipified for ROCm): everything comes from c10 / ATen;
//   - MINAGI_EMULATOR (csrc/emu/emulator.h, the host compiler): plain definitions, the emulator's
//     thread model and shared memory;
//   - MINAGI_NO_TORCH (tools/rocm_build_check.sh, clang -x hip): plain definitions on the device.
// The kernels use only what nvcc and clang's HIP both accept: no unqualified isnan (the HIP
// headers' overloads and the C library's macro disagree), no __align__ (CUDA-only).
#pragma once

#include <cstdint>

#include "../sizes.h"  // bucket: the host's, the kernels' and the emulator's one definition

#if defined(MINAGI_EMULATOR) || defined(MINAGI_NO_TORCH)
#define MINAGI_PLAIN_KERNELS 1
#endif

#if defined(MINAGI_EMULATOR)
#include "../emu/emulator.h"
#endif

#if !defined(MINAGI_PLAIN_KERNELS)

#include <ATen/OpMathType.h>
#include <c10/macros/Macros.h>

#define MINAGI_HOST_DEVICE C10_HOST_DEVICE

namespace minagi {
namespace gpu {
template <typename scalar_t>
using opmath_t = at::opmath_type<scalar_t>;
}  // namespace gpu
}  // namespace minagi

#else  // plain definitions

#if defined(MINAGI_EMULATOR)
#define MINAGI_HOST_DEVICE
#else
#include <cassert>
#define MINAGI_HOST_DEVICE __host__ __device__
#define CUDA_KERNEL_ASSERT(cond) assert(cond)
#endif

namespace minagi {

namespace gpu {

MINAGI_HOST_DEVICE inline uint32_t f32_bits(float v) { return __builtin_bit_cast(uint32_t, v); }
MINAGI_HOST_DEVICE inline float f32_from_bits(uint32_t b) { return __builtin_bit_cast(float, b); }

// float16 and bfloat16 stand-ins with c10::Half's and c10::BFloat16's conversions (round to
// nearest even, NaN kept), so the emulator's half results match the CPU kernels' bits.
struct Half {
  uint16_t bits;
  Half() = default;
  MINAGI_HOST_DEVICE Half(float v) : bits(from_float(v)) {}
  MINAGI_HOST_DEVICE operator float() const {
    const uint32_t w = static_cast<uint32_t>(bits) << 16, sign = w & 0x80000000u, two_w = w + w;
    const float normal = f32_from_bits((two_w >> 4) + (0xE0u << 23)) * 0x1.0p-112f;
    const float subnormal = f32_from_bits((two_w >> 17) | (126u << 23)) - 0.5f;
    return f32_from_bits(sign | (two_w < (1u << 27) ? f32_bits(subnormal) : f32_bits(normal)));
  }
  MINAGI_HOST_DEVICE static uint16_t from_float(float v) {
    const uint32_t w = f32_bits(v), shl1_w = w + w, sign = w & 0x80000000u;
    float base = (__builtin_fabsf(v) * 0x1.0p+112f) * 0x1.0p-110f;
    uint32_t bias = shl1_w & 0xFF000000u;
    if (bias < 0x71000000u) bias = 0x71000000u;
    base = f32_from_bits((bias >> 1) + 0x07800000u) + base;
    const uint32_t b = f32_bits(base);
    const uint32_t nonsign = ((b >> 13) & 0x00007C00u) + (b & 0x00000FFFu);
    return static_cast<uint16_t>((sign >> 16) | (shl1_w > 0xFF000000u ? 0x7E00u : nonsign));
  }
};

struct BFloat16 {
  uint16_t bits;
  BFloat16() = default;
  MINAGI_HOST_DEVICE BFloat16(float v) : bits(from_float(v)) {}
  MINAGI_HOST_DEVICE operator float() const { return f32_from_bits(static_cast<uint32_t>(bits) << 16); }
  MINAGI_HOST_DEVICE static uint16_t from_float(float v) {
    if (v != v) return 0x7FC0;
    const uint32_t u = f32_bits(v);
    return static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
  }
};

template <typename scalar_t>
struct OpMath {
  using type = scalar_t;
};
template <>
struct OpMath<Half> {
  using type = float;
};
template <>
struct OpMath<BFloat16> {
  using type = float;
};
template <typename scalar_t>
using opmath_t = typename OpMath<scalar_t>::type;

}  // namespace gpu
}  // namespace minagi

#endif  // MINAGI_PLAIN_KERNELS

namespace minagi {
namespace gpu {

// x != x rather than isnan: the one NaN test every build spells the same way.
template <typename acc_t>
MINAGI_HOST_DEVICE inline bool is_nan(acc_t v) {
  return v != v;
}

// The block's dynamic shared memory (the launch's third argument), as T. One declaration, of
// one type, for every kernel: typed extern arrays of one name clash within a translation unit,
// and double's alignment suits every type the kernels keep there.
template <typename T>
__device__ inline T* dynamic_smem() {
#if defined(MINAGI_EMULATOR)
  return reinterpret_cast<T*>(emu::dynamic_shared());
#else
  extern __shared__ double minagi_dynamic_smem[];
  return reinterpret_cast<T*>(minagi_dynamic_smem);
#endif
}

}  // namespace gpu
}  // namespace minagi

// A fixed-size array in the block's shared memory: `MINAGI_SHARED_ARRAY(int64_t, slots, 256);`.
#if defined(MINAGI_EMULATOR)
#define MINAGI_SHARED_ARRAY(type, name, count) type* const name = ::minagi::emu::static_shared<type>(count)
#else
#define MINAGI_SHARED_ARRAY(type, name, count) __shared__ type name[count]
#endif
