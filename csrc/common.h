// Shared argument checks for every minagi kernel. Every message names the op and the argument,
// and says what was expected, so a user sees the fix rather than a stack trace.
#pragma once

#include <ATen/ATen.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <c10/macros/Macros.h>
#include <c10/util/Exception.h>

#include <cstdint>
#include <cstdlib>
#include <string>
#include <utility>
#include <vector>

#include "activation.h"
#include "sizes.h"  // bucket, kSmallRows

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

// A plan's listed slots and their row counts: 1-D int64 tensors of one length.
inline void check_ranges_args(const at::Tensor& slot_ids, const at::Tensor& slot_rows, const char* op) {
  check_dim(slot_ids, 1, op, "slot_ids");
  check_dim(slot_rows, 1, op, "slot_rows");
  check_index(slot_ids, op, "slot_ids");
  check_index(slot_rows, op, "slot_rows");
  TORCH_CHECK(slot_ids.size(0) == slot_rows.size(0), "minagi.", op, ": slot_ids (", slot_ids.size(0),
              ") and slot_rows (", slot_rows.size(0), ") must have one length");
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

// MINAGI_DEBUG_CHECKS=1: every index tensor a kernel reads is range-checked on the host before
// the kernel runs (on a GPU a copy and a synchronisation per tensor), so a bad index is an error
// that names the op, the argument and the position, where a GPU kernel's own device assert would
// abort the process (ROCm) or leave the GPU unusable for it (CUDA). Off by default. (The CPU
// kernels check their indices on the host anyway; with the switch this check comes first.)
inline bool debug_checks() {
  static const bool on = [] {
    const char* v = std::getenv("MINAGI_DEBUG_CHECKS");
    return v != nullptr && std::string(v) == "1";
  }();
  return on;
}

// With debug_checks(): idx in [lo, hi) elementwise, checked on the host before the kernel runs.
inline void debug_check_range(const at::Tensor& idx, int64_t lo, int64_t hi, const char* op, const char* name) {
  if (!debug_checks() || idx.numel() == 0) return;
  const at::Tensor host = idx.to(at::kCPU).contiguous();
  const int64_t* p = host.data_ptr<int64_t>();
  for (int64_t i = 0; i < host.numel(); ++i) {
    TORCH_CHECK(p[i] >= lo && p[i] < hi, "minagi.", op, ": ", name, " holds ", p[i], " at flat position ", i,
                ", outside [", lo, ", ", hi, ") (found by MINAGI_DEBUG_CHECKS=1 on the host, before the kernel ran)");
  }
}

// ---- Per-op argument checks, shared by the CPU and GPU kernels of each op.

inline void check_routing_args(const at::Tensor& logits, int64_t top_k) {
  check_dim(logits, 2, "routing", "logits");
  check_floating(logits, "routing", "logits");
  const int64_t S = logits.size(1);
  TORCH_CHECK(S >= 1, "minagi.routing: logits must have at least one slot (shape[1] >= 1), got shape ",
              logits.sizes());
  TORCH_CHECK(top_k >= 1 && top_k <= S, "minagi.routing: top_k must be in [1, n_slots=", S, "], got ", top_k);
}

inline void check_routing_backward_args(const at::Tensor& grad_gates, const at::Tensor& gates,
                                        const at::Tensor& slot_idx, int64_t n_slots) {
  const char* op = "routing_backward";
  check_dim(gates, 2, op, "gates");
  check_floating(gates, op, "gates");
  check_same_dtype(gates, grad_gates, op, "gates", "grad_gates");
  TORCH_CHECK(grad_gates.sizes() == gates.sizes() && slot_idx.sizes() == gates.sizes(),
              "minagi.routing_backward: grad_gates ", grad_gates.sizes(), ", gates ", gates.sizes(),
              " and slot_idx ", slot_idx.sizes(), " must have one shape [N, k]");
  check_index(slot_idx, op, "slot_idx");
  check_same_device(gates, grad_gates, op, "gates", "grad_gates");
  check_same_device(gates, slot_idx, op, "gates", "slot_idx");
  TORCH_CHECK(n_slots >= 1, "minagi.routing_backward: n_slots must be >= 1, got ", n_slots);
  debug_check_range(slot_idx, 0, n_slots, op, "slot_idx");
}

// The fix named where a slot id is out of range (the plan, the decode op): ids of experts held
// on another rank are what expert parallelism passes.
constexpr const char* kSkipHint =
    " (ids of experts held elsewhere, as expert parallelism passes them: out_of_range_slots='skip' drops "
    "those pairs)";

// Every id of slot_idx [N, k] (CPU, contiguous) in [0, n_slots), in expert_mlp's words: the ops
// find a bad id, expert_mlp reads no values.
inline void check_slot_ids_cpu(const at::Tensor& idx, int64_t n_slots) {
  const int64_t* p = idx.data_ptr<int64_t>();
  const int64_t k = idx.size(1), R = idx.numel();
  for (int64_t i = 0; i < R; ++i) {
    TORCH_CHECK_VALUE(p[i] >= 0 && p[i] < n_slots, "expert_mlp: slot_idx holds ", p[i], ", outside [0, S = ",
                      n_slots, ") at token ", i / k, ", position ", i % k, kSkipHint);
  }
}

inline void check_group_plan_args(const at::Tensor& slot_idx, int64_t n_slots, int64_t capacity,
                                  bool skip_invalid = false) {
  const char* op = "group_plan";
  check_dim(slot_idx, 2, op, "slot_idx");
  check_index(slot_idx, op, "slot_idx");
  TORCH_CHECK(n_slots >= 1, "minagi.group_plan: n_slots must be >= 1, got ", n_slots);
  TORCH_CHECK(capacity >= 0, "minagi.group_plan: capacity must be >= 0 (0 = uncapped), got ", capacity);
  if (!skip_invalid) debug_check_range(slot_idx, 0, n_slots, op, "slot_idx");
}

// The optional gates of gather and scatter: [N, k] like dest, the rows' dtype and device.
inline void check_gates(const c10::optional<at::Tensor>& gates, const at::Tensor& like, const at::Tensor& dest,
                        const char* op) {
  if (!gates.has_value()) return;
  TORCH_CHECK(gates->sizes() == dest.sizes(), "minagi.", op, ": gates must have the shape of dest ",
              dest.sizes(), " ([N, k]), got ", gates->sizes());
  check_same_dtype(like, *gates, op, "the rows", "gates");
  check_same_device(like, *gates, op, "the rows", "gates");
}

inline void check_gather_args(const at::Tensor& x, const at::Tensor& row_pair, const at::Tensor& dest,
                              const c10::optional<at::Tensor>& gates) {
  const char* op = "bucketed_gather";
  check_dim(x, 2, op, "x");
  check_floating(x, op, "x");
  check_plan_maps(dest, row_pair, op);
  check_same_device(x, dest, op, "x", "dest");
  check_size(dest, 0, x.size(0), op, "dest", "x.shape[0]");
  check_gates(gates, x, dest, op);
  debug_check_range(row_pair, -1, dest.numel(), op, "row_pair");
}

inline void check_scatter_args(const at::Tensor& rows, const at::Tensor& dest, const at::Tensor& row_pair,
                               const c10::optional<at::Tensor>& gates) {
  const char* op = "weighted_scatter";
  check_dim(rows, 2, op, "rows");
  check_floating(rows, op, "rows");
  check_plan_maps(dest, row_pair, op);
  check_same_device(rows, dest, op, "rows", "dest");
  check_size(row_pair, 0, rows.size(0), op, "row_pair", "rows.shape[0]");
  check_gates(gates, rows, dest, op);
  debug_check_range(dest, -1, rows.size(0), op, "dest");
}

inline void check_gate_grad_args(const at::Tensor& a, const at::Tensor& rows, const at::Tensor& dest,
                                 const at::Tensor& row_pair) {
  const char* op = "gate_grad";
  check_dim(a, 2, op, "a");
  check_dim(rows, 2, op, "rows");
  check_floating(a, op, "a");
  check_same_dtype(a, rows, op, "a", "rows");
  check_same_device(a, rows, op, "a", "rows");
  check_plan_maps(dest, row_pair, op);
  check_same_device(a, dest, op, "a", "dest");
  check_size(dest, 0, a.size(0), op, "dest", "a.shape[0]");
  check_size(rows, 1, a.size(1), op, "rows", "a.shape[1]");
  check_size(row_pair, 0, rows.size(0), op, "row_pair", "rows.shape[0]");
  debug_check_range(dest, -1, rows.size(0), op, "dest");
}

// The operands of grouped_mm (a [E, K], b [S, K, M]) and grouped_mm_wgrad (a [E, K], grad [E, M]).
inline void check_grouped_mm_args(const at::Tensor& a, const at::Tensor& b, const char* op = "grouped_mm",
                                  const char* a_name = "a") {
  check_dim(a, 2, op, a_name);
  check_dim(b, 3, op, "b");
  check_floating(a, op, a_name);
  check_same_dtype(a, b, op, a_name, "b");
  check_same_device(a, b, op, a_name, "b");
  check_size(b, 1, a.size(1), op, "b", (std::string(a_name) + ".shape[1]").c_str());
}

inline void check_wgrad_args(const at::Tensor& a, const at::Tensor& grad, int64_t n_slots) {
  const char* op = "grouped_mm_wgrad";
  check_dim(a, 2, op, "a");
  check_dim(grad, 2, op, "grad");
  check_floating(a, op, "a");
  check_same_dtype(a, grad, op, "a", "grad");
  check_same_device(a, grad, op, "a", "grad");
  check_size(grad, 0, a.size(0), op, "grad", "a.shape[0]");
  TORCH_CHECK(n_slots >= 1, "minagi.grouped_mm_wgrad: n_slots must be >= 1, got ", n_slots);
}

// scatter_mm_backward's operands: grad_y [N, D], a [E, I] and b [S, I, D] (grouped_mm's), gates [N,
// k] in a's dtype, the plan's dest [N, k] and row_pair [E]; b_grad 0, 1 or 2.
inline void check_scatter_mm_backward_args(const at::Tensor& grad_y, const at::Tensor& a, const at::Tensor& b,
                                           const at::Tensor& gates, const at::Tensor& row_pair,
                                           const at::Tensor& dest, int64_t b_grad) {
  const char* op = "scatter_mm_backward";
  check_dim(grad_y, 2, op, "grad_y");
  check_dim(gates, 2, op, "gates");
  check_grouped_mm_args(a, b, op);
  const std::pair<const at::Tensor*, const char*> others[] = {{&grad_y, "grad_y"}, {&gates, "gates"}};
  for (const auto& [t, name] : others) {
    check_same_dtype(a, *t, op, "a", name);
    check_same_device(a, *t, op, "a", name);
  }
  check_plan_maps(dest, row_pair, op);
  check_same_device(a, dest, op, "a", "dest");
  check_size(grad_y, 1, b.size(2), op, "grad_y", "b.shape[2]");
  check_size(dest, 0, grad_y.size(0), op, "dest", "grad_y.shape[0]");
  check_size(row_pair, 0, a.size(0), op, "row_pair", "a.shape[0]");
  TORCH_CHECK(gates.sizes() == dest.sizes(), "minagi.scatter_mm_backward: gates must have the shape of dest ",
              dest.sizes(), " ([N, k]), got ", gates.sizes());
  TORCH_CHECK(b_grad >= 0 && b_grad <= 2, "minagi.scatter_mm_backward: b_grad must be 0 (no gradient), 1 (b's "
              "shape [S, I, D]) or 2 (transposed, [S, D, I]), got ", b_grad);
  debug_check_range(row_pair, -1, dest.numel(), op, "row_pair");
  debug_check_range(dest, -1, a.size(0), op, "dest");
}

// An activation by name (csrc/activation.h), or an error that lists the known ones.
inline Act parse_act(const std::string& name, const char* op) {
  for (int i = 0; i < kNumActs; ++i) {
    if (name == kActNames[i]) return static_cast<Act>(i);
  }
  std::string known;
  for (int i = 0; i < kNumActs; ++i) known += std::string(i ? ", " : "") + kActNames[i];
  TORCH_CHECK(false, "minagi.", op, ": unknown activation '", name, "'; the forms are ", known);
}

// grouped_mm_act's operands: grouped_mm's, a gated form's even width, a bias [S, M].
// grouped_mm_act's operands (and gather_mm_act's, whose rows come from x: op and a_name say so).
inline Act check_grouped_mm_act_args(const at::Tensor& a, const at::Tensor& b, const c10::optional<at::Tensor>& bias,
                                     const std::string& activation, const char* op = "grouped_mm_act",
                                     const char* a_name = "a") {
  check_grouped_mm_args(a, b, op, a_name);
  const Act act = parse_act(activation, op);
  TORCH_CHECK(!act_gated(act) || b.size(2) % 2 == 0, "minagi.", op, ": the gated form '", activation,
              "' needs an even width (gate and up, 2H), got b of shape ", b.sizes());
  if (bias.has_value()) {
    TORCH_CHECK(bias->dim() == 2 && bias->size(0) == b.size(0) && bias->size(1) == b.size(2), "minagi.", op,
                ": bias must be [S, M] = [", b.size(0), ", ", b.size(2), "], got shape ", bias->sizes());
    check_same_dtype(a, *bias, op, a_name, "bias");
    check_same_device(a, *bias, op, a_name, "bias");
  }
  return act;
}

inline Act check_act_backward_args(const at::Tensor& grad, const at::Tensor& h, const std::string& activation,
                                   int64_t n_slots) {
  const char* op = "expert_act_backward";
  check_dim(grad, 2, op, "grad");
  check_dim(h, 2, op, "h");
  check_floating(h, op, "h");
  check_same_dtype(h, grad, op, "h", "grad");
  check_same_device(h, grad, op, "h", "grad");
  const Act act = parse_act(activation, op);
  const int64_t width = act_gated(act) ? h.size(1) / 2 : h.size(1);
  TORCH_CHECK(!act_gated(act) || h.size(1) % 2 == 0, "minagi.expert_act_backward: the gated form '", activation,
              "' needs an even width of h, got shape ", h.sizes());
  TORCH_CHECK(grad.size(0) == h.size(0) && grad.size(1) == width, "minagi.expert_act_backward: grad must be [",
              h.size(0), ", ", width, "] for h of shape ", h.sizes(), ", got ", grad.sizes());
  TORCH_CHECK(n_slots >= 1, "minagi.expert_act_backward: n_slots must be >= 1, got ", n_slots);
  return act;
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

// slot_ids of a grouped GEMM weight gradient, on the host: in [0, n_slots), each listed once (a
// listed slot's gradient is written whole, once; the CPU kernel and the GPU one say the same).
inline void check_unique_slots_cpu(const at::Tensor& slot_ids, int64_t n_slots, const char* op) {
  const at::Tensor ids = slot_ids.contiguous();
  const int64_t* ip = ids.data_ptr<int64_t>();
  std::vector<char> seen(n_slots, 0);
  for (int64_t i = 0; i < ids.numel(); ++i) {
    TORCH_CHECK(ip[i] >= 0 && ip[i] < n_slots, "minagi.", op, ": slot_ids holds ", ip[i], " at position ", i,
                ", outside [0, n_slots=", n_slots, ")");
    TORCH_CHECK(!seen[ip[i]], "minagi.", op, ": slot_ids lists slot ", ip[i], " twice; each slot may own one row range");
    seen[ip[i]] = 1;
  }
}

// The most card slots the GPU kernels take, one limit for all of them: group_plan keeps two
// int64 arrays of S in one block's shared memory, and routing keeps S scores and its reduction
// tree there (~22 KiB of the 48 KiB at 2,048 float64 slots). So a card that routes also plans.
// The CPU kernels have no such limit.
constexpr int64_t kMaxGpuSlots = 2048;

inline void check_gpu_slots(int64_t n_slots, const char* op) {
  TORCH_CHECK(n_slots <= kMaxGpuSlots, "minagi.", op, ": the GPU kernels take at most ", kMaxGpuSlots,
              " card slots (model.n_slots), got ", n_slots, "; use a smaller card (the pool can stay larger: "
              "admission picks the card), or run on the CPU");
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
