// MINAGI_CPU_BASELINE=1: the CPU kernels leave their hand-written AVX-512 code (f32_gemm.h,
// bf16_gemm.h, small_rows.h, swiglu_avx512.h) for the portable loops and ATen, as on a CPU without
// AVX-512. It is how the tests reach those paths on a machine that has it; read once.
#pragma once

#include <cstdlib>
#include <cstring>

namespace minagi {

inline bool cpu_baseline_only() {
  static const bool on = [] {
    const char* v = std::getenv("MINAGI_CPU_BASELINE");
    return v != nullptr && std::strcmp(v, "1") == 0;
  }();
  return on;
}

}  // namespace minagi
