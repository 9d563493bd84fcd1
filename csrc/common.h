// Shared argument checks for every minagi kernel. Every message names the op and the argument,
// and says what was expected, so a user sees the fix rather than a stack trace.
#pragma once

#include <ATen/ATen.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#include <cstdint>

#if defined(__linux__)
#include <sys/mman.h>
#endif

namespace minagi {

inline void check_dim(const at::Tensor& t, int64_t dim, const char* op, const char* name) {
  TORCH_CHECK(t.dim() == dim, "minagi.", op, ": ", name, " must be ", dim,
              "-D, got shape ", t.sizes());
}

inline void check_index(const at::Tensor& t, const char* op, const char* name) {
  TORCH_CHECK(t.scalar_type() == at::kLong, "minagi.", op, ": ", name,
              " must be int64 (torch.long), got ", t.scalar_type());
}

inline void check_floating(const at::Tensor& t, const char* op, const char* name) {
  const auto st = t.scalar_type();
  TORCH_CHECK(st == at::kFloat || st == at::kDouble || st == at::kBFloat16 || st == at::kHalf,
              "minagi.", op, ": ", name,
              " must be float32, float64, bfloat16 or float16, got ", st);
}

inline void check_same_dtype(const at::Tensor& a, const at::Tensor& b, const char* op,
                             const char* name_a, const char* name_b) {
  TORCH_CHECK(a.scalar_type() == b.scalar_type(), "minagi.", op, ": ", name_b, " (", b.scalar_type(),
              ") must have the dtype of ", name_a, " (", a.scalar_type(), ")");
}

inline void check_same_device(const at::Tensor& a, const at::Tensor& b, const char* op,
                              const char* name_a, const char* name_b) {
  TORCH_CHECK(a.device() == b.device(), "minagi.", op, ": ", name_b, " is on ", b.device(),
              " but ", name_a, " is on ", a.device(), "; move them to one device");
}

inline void check_size(const at::Tensor& t, int64_t dim, int64_t expected, const char* op,
                       const char* name, const char* what) {
  TORCH_CHECK(t.size(dim) == expected, "minagi.", op, ": ", name, ".shape[", dim, "] must equal ",
              what, " (", expected, "), got shape ", t.sizes());
}

// The (dest, row_pair) maps of a dispatch plan: dest [N, k] gives each (character, k) pair's
// buffer row (-1 = dropped), row_pair [E] gives each buffer row's flat pair n * k + j (-1 = padding).
inline void check_plan_maps(const at::Tensor& dest, const at::Tensor& row_pair, const char* op) {
  check_dim(dest, 2, op, "dest");
  check_index(dest, op, "dest");
  check_dim(row_pair, 1, op, "row_pair");
  check_index(row_pair, op, "row_pair");
  check_same_device(dest, row_pair, op, "dest", "row_pair");
}

// Host-side range check of an index tensor (CPU kernels only: a GPU check would synchronise).
inline void check_range_cpu(const at::Tensor& idx, int64_t lo, int64_t hi, const char* op,
                            const char* name) {
  const int64_t* p = idx.data_ptr<int64_t>();
  const int64_t n = idx.numel();
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK(p[i] >= lo && p[i] < hi, "minagi.", op, ": ", name, " holds ", p[i],
                " at flat position ", i, ", outside [", lo, ", ", hi, ")");
  }
}

// _bucket(n): powers of two up to 128, then multiples of 128. A few dozen buffer sizes over a
// run, so a caching allocator reuses its blocks instead of fragmenting.
inline int64_t bucket(int64_t n) {
  if (n <= 0) return 0;
  if (n <= 128) {
    int64_t b = 1;
    while (b < n) b <<= 1;
    return b;
  }
  return ((n + 127) / 128) * 128;
}

// A large CPU output, backed by transparent huge pages where Linux allows (THP "madvise" mode).
// A card-sized weight gradient is fresh memory every step, and faulting it in 4 KiB pages cost
// as much as the GEMMs that fill it; 2 MiB pages cut that to a few percent. Advice only: the
// interior 2 MiB-aligned span of a block the allocator has just mapped, before its first touch.
inline at::Tensor empty_output(at::IntArrayRef sizes, const at::TensorOptions& options) {
  at::Tensor t = at::empty(sizes, options);
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  constexpr uintptr_t kHuge = uintptr_t{2} << 20;
  const size_t bytes = t.nbytes();
  if (t.device().is_cpu() && bytes >= 4 * kHuge) {
    const uintptr_t p = reinterpret_cast<uintptr_t>(t.data_ptr());
    const uintptr_t lo = (p + kHuge - 1) & ~(kHuge - 1), hi = (p + bytes) & ~(kHuge - 1);
    if (hi > lo) madvise(reinterpret_cast<void*>(lo), hi - lo, MADV_HUGEPAGE);
  }
#endif
  return t;
}

}  // namespace minagi

// float32, float64, bfloat16, float16: the dtypes every minagi kernel takes.
#define MINAGI_DISPATCH_FLOATING(TYPE, NAME, ...) \
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, TYPE, NAME, __VA_ARGS__)
