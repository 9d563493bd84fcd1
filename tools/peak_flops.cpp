// The CPU's arithmetic peak: how many GFLOP/s the AVX-512 float32 FMA (vfmadd231ps) and the
// bfloat16 dot (vdpbf16ps) give on this many threads, with every operand in registers (12
// independent sums a thread, enough to hide their latency). No GEMM can run faster, so a ratio
// over another backend is bounded by that backend's time over FLOPs / peak (docs/transformers.md,
// "How far any backend could go").
//
//   g++ -O3 -funroll-all-loops -mavx512f -mavx512bw -mavx512bf16 -fopenmp tools/peak_flops.cpp -o /tmp/peak_flops
//   /tmp/peak_flops [threads = 2] [iterations = 200000000]
//
// Prints one line per round (3 rounds): GFLOP/s of each (an FMA of 16 lanes counts 32 FLOPs, a
// vdpbf16ps 64). Needs a CPU with AVX-512 BF16 (Zen 4, Sapphire Rapids and later). Nothing else
// may run beside it.
#include <immintrin.h>
#include <omp.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>

namespace {

constexpr int kSums = 12;

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// Each thread: iters FMAs of 16 float32 lanes. Returns GFLOP/s over all threads.
double f32_peak(int threads, long iters) {
  const auto t0 = std::chrono::steady_clock::now();
  float total = 0;
#pragma omp parallel num_threads(threads) reduction(+ : total)
  {
    __m512 sum[kSums];
    const __m512 b = _mm512_set1_ps(1.0000001f), c = _mm512_set1_ps(1e-7f);
    for (int i = 0; i < kSums; ++i) sum[i] = _mm512_set1_ps(static_cast<float>(i));
    for (long k = 0; k < iters / kSums; ++k)
      for (int i = 0; i < kSums; ++i) sum[i] = _mm512_fmadd_ps(sum[i], b, c);
    for (int i = 0; i < kSums; ++i) total += _mm512_reduce_add_ps(sum[i]);  // keeps the sums live
  }
  const double t = seconds_since(t0);
  if (total == 1.2345f) std::printf(" ");
  return 2.0 * 16 * threads * (iters / kSums * kSums) / t / 1e9;
}

// Each thread: iters vdpbf16ps of 32 bfloat16 pairs into 16 float32 lanes.
double bf16_peak(int threads, long iters) {
  const auto t0 = std::chrono::steady_clock::now();
  float total = 0;
#pragma omp parallel num_threads(threads) reduction(+ : total)
  {
    __m512 sum[kSums];
    const __m512bh b = (__m512bh)_mm512_set1_epi16(0x3F80), c = (__m512bh)_mm512_set1_epi16(0x3400);  // 1, 2^-23
    for (int i = 0; i < kSums; ++i) sum[i] = _mm512_set1_ps(static_cast<float>(i));
    for (long k = 0; k < iters / kSums; ++k)
      for (int i = 0; i < kSums; ++i) sum[i] = _mm512_dpbf16_ps(sum[i], b, c);
    for (int i = 0; i < kSums; ++i) total += _mm512_reduce_add_ps(sum[i]);
  }
  const double t = seconds_since(t0);
  if (total == 1.2345f) std::printf(" ");
  return 2.0 * 32 * threads * (iters / kSums * kSums) / t / 1e9;
}

}  // namespace

int main(int argc, char** argv) {
  const int threads = argc > 1 ? std::atoi(argv[1]) : 2;
  const long iters = argc > 2 ? std::atol(argv[2]) : 200000000L;
  if (threads < 1 || iters < kSums) {
    std::fprintf(stderr, "usage: %s [threads >= 1] [iterations >= %d]\n", argv[0], kSums);
    return 2;
  }
  for (int round = 0; round < 3; ++round) {
    const double f32 = f32_peak(threads, iters), bf16 = bf16_peak(threads, iters);
    std::printf("%d thread(s): float32 FMA %.0f GFLOP/s, bfloat16 vdpbf16ps %.0f GFLOP/s\n", threads, f32, bf16);
  }
  return 0;
}
