// Which of minagi's hand-written x86 code paths the CPU kernels may take, read once from the
// environment and capped by what CPUID reports:
//   MINAGI_CPU_ISA=portable  the portable C++ loops and ATen only (as a CPU without AVX2 or AVX-512)
//   MINAGI_CPU_ISA=avx2      AVX2 + FMA code at most (as a CPU without AVX-512)
//   MINAGI_CPU_ISA=avx512    everything the CPU has (the default)
//   MINAGI_CPU_BASELINE=1    the same as portable (the older switch; MINAGI_CPU_ISA wins if both are set)
// It is how the tests reach every path on one machine. The AVX-512 kernels (f32_gemm.h,
// bf16_gemm.h, small_rows.h, swiglu_avx512.h) run only at avx512; the quantized kernels
// (quant.cpp) and small_rows.h's AVX2 column kernels at avx2 and avx512; below avx512, slot_gemm.h
// multiplies bfloat16 and float16 in float32 (widened_mm). GCC's target_clones loops (rows.h MINAGI_SIMD_CLONES) are picked
// by the loader and not capped; ATen's own kernels pick their ISA themselves.
#pragma once

#include <c10/util/Exception.h>

#include <cstdlib>
#include <cstring>
#include <string>

namespace minagi {

enum class CpuIsa { kPortable = 0, kAvx2 = 1, kAvx512 = 2 };

// The cap the environment sets (kAvx512 when nothing is set).
inline CpuIsa cpu_isa_cap() {
  static const CpuIsa cap = [] {
    const char* isa = std::getenv("MINAGI_CPU_ISA");
    if (isa != nullptr && *isa != '\0') {
      if (std::strcmp(isa, "portable") == 0) return CpuIsa::kPortable;
      if (std::strcmp(isa, "avx2") == 0) return CpuIsa::kAvx2;
      if (std::strcmp(isa, "avx512") == 0) return CpuIsa::kAvx512;
      TORCH_CHECK_VALUE(false, "MINAGI_CPU_ISA='", std::string(isa),
                        "' is not a level: use portable, avx2 or avx512 (or unset it for everything the CPU has)");
    }
    const char* v = std::getenv("MINAGI_CPU_BASELINE");
    return v != nullptr && std::strcmp(v, "1") == 0 ? CpuIsa::kPortable : CpuIsa::kAvx512;
  }();
  return cap;
}

// Whether the AVX-512 kernels are switched off (MINAGI_CPU_BASELINE=1, or MINAGI_CPU_ISA below
// avx512); read once.
inline bool cpu_baseline_only() { return cpu_isa_cap() < CpuIsa::kAvx512; }

// The highest level both the CPU and the cap allow (CPUID, once).
inline CpuIsa cpu_isa() {
  static const CpuIsa isa = [] {
#if defined(__x86_64__) && defined(__GNUC__)
    CpuIsa have = CpuIsa::kPortable;
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) have = CpuIsa::kAvx2;
    if (have == CpuIsa::kAvx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512vl")) {
      have = CpuIsa::kAvx512;
    }
    return have < cpu_isa_cap() ? have : cpu_isa_cap();
#else
    return CpuIsa::kPortable;
#endif
  }();
  return isa;
}

inline const char* cpu_isa_name(CpuIsa isa) {
  return isa == CpuIsa::kAvx512 ? "avx512" : isa == CpuIsa::kAvx2 ? "avx2" : "portable";
}

}  // namespace minagi
