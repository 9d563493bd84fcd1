// The one op library of minagi: every schema lives here. Kernels register per device in
// csrc/cpu/*.cpp (CPU) and csrc/cuda/*.cu (CUDA; torch hipifies them for ROCm, key still CUDA).
// Python adds register_fake and register_autograd (minagi/ops.py); the pure-torch twin of every
// op, with the same signature, is minagi/reference.py.
#include <Python.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <string>
#include <vector>

#include "common.h"  // kMaxGpuSlots, and csrc/sizes.h's kSmallRows

#ifdef _OPENMP
#include <omp.h>
#endif

// Importing minagi._C only has to run the static registrations below: no pybind11 module.
extern "C" {
PyObject* PyInit__C(void) {
  static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};
  return PyModule_Create(&module_def);
}
}

namespace minagi {
std::vector<int64_t> cpu_block_cache(int64_t max_idle_bytes);  // csrc/cpu/block_cache.cpp
int64_t tile_bytes(c10::string_view name, int64_t value);        // csrc/cpu/scheduling.cpp
std::string cpu_isa_level();                                     // csrc/cpu/quant.cpp

// The sizes the kernels are built with that Python decides by, read there rather than copied.
int64_t constant(c10::string_view name) {
  if (name == "small_rows") return kSmallRows;
  if (name == "gpu_max_slots") return kMaxGpuSlots;
  TORCH_CHECK_VALUE(false, "minagi.constant: no constant '", std::string(name),
                    "'; the names are 'small_rows' and 'gpu_max_slots'");
}
}  // namespace minagi

namespace {
// How this extension was built, for `python -m minagi doctor`: a build without OpenMP would run
// every at::parallel_for on one thread without saying so.
std::string build_info() {
  std::string info;
#ifdef _OPENMP
  info += "openmp=" + std::to_string(_OPENMP) + " omp_max_threads=" + std::to_string(omp_get_max_threads());
#else
  info += "openmp=no";
#endif
  info += " aten_threads=" + std::to_string(at::get_num_threads());
#ifdef MINAGI_WITH_GPU
#ifdef USE_ROCM
  info += " gpu=rocm";
#else
  info += " gpu=cuda";
#endif
#else
  info += " gpu=none";
#endif
  return info;
}
}  // namespace

TORCH_LIBRARY(minagi, m) {
  m.def("build_info() -> str", &build_info);
  // Not a computation: the cache of large CPU blocks (csrc/cpu/block_cache.cpp) behind
  // MINAGI_ALLOCATOR=keep. max_idle_bytes >= 0 installs it as torch's CPU allocator (once) and caps
  // its idle bytes; -1 only reports. -> [installed, idle bytes, blocks reused, blocks mapped].
  m.def("cpu_block_cache(int max_idle_bytes) -> int[]", &minagi::cpu_block_cache);
  // Not a computation: a fused CPU kernel's tile size ("gather": gather_mm_act, "fused":
  // scatter_mm_backward); value >= 0 sets it. Returns the size before. Past its tile a kernel takes
  // its unfused path (the same results), so these are speed knobs, and tests force both paths.
  m.def("tile_bytes(str name, int value=-1) -> int", &minagi::tile_bytes);
  // Not a computation: "small_rows" (csrc/sizes.h kSmallRows: a call of at most this many
  // characters is dispatch's decode case) and "gpu_max_slots" (csrc/common.h kMaxGpuSlots).
  m.def("constant(str name) -> int", &minagi::constant);
  // Not a computation: the x86 level the CPU's quantized kernels run at, "portable", "avx2" or
  // "avx512": what CPUID reports, capped by MINAGI_CPU_ISA (csrc/cpu/isa.h).
  m.def("cpu_isa() -> str", &minagi::cpu_isa_level);
  // logits [N, S] -> slot_idx [N, k] int64 (best first, ties to the lower slot, NaN ranks as
  // -inf), gates [N, k] = softmax over the k chosen logits, load [S] int64 (pairs per slot).
  m.def("routing(Tensor logits, int top_k) -> (Tensor slot_idx, Tensor gates, Tensor load)");
  // The gradient of routing's gates with respect to its logits: [N, S], zero off the chosen slots.
  m.def("routing_backward(Tensor grad_gates, Tensor gates, Tensor slot_idx, int n_slots) -> Tensor");
  // The dispatch plan of slot_idx [N, k] over n_slots, each slot capped at `capacity` pairs
  // (0 = uncapped; kept pairs are the first in character order, then k order):
  //   load [S]: kept pairs per slot;
  //   bucketed: slot_order [A]: slots with load > 0 sorted by load, then slot; slot_rows [A]:
  //     bucket(load) of each (runs of equal values are the groups); row_pair [E = sum(slot_rows)];
  //   exact (not bucketed): slot_order [S]: every slot in id order; slot_rows [S]: load;
  //     row_pair [N * k], the rows past sum(load) padding: every size from the input's shape;
  //   row_pair: flat pair n * k + j of every buffer row (-1 = padding); dest [N, k]: buffer row
  //   of every pair (-1 = dropped).
  // The ops that take slot_ids / slot_rows give zero rows past the listed ranges.
  // skip_invalid: ids outside [0, n_slots) are dropped pairs (dest -1), not an error (the
  // sentinels of experts that live on another rank); without it such an id is a ValueError.
  // For GPU inputs slot_rows comes back on the CPU: the grouped GEMM sizes its batched matmuls
  // from it (one device-to-host copy).
  m.def(
      "group_plan(Tensor slot_idx, int n_slots, int capacity, bool bucketed, bool skip_invalid=False) -> "
      "(Tensor load, Tensor slot_order, Tensor slot_rows, Tensor row_pair, Tensor dest)");
  // out[e] = gates[p] * x[p // k] for p = row_pair[e] (gates optional), zero rows for padding.
  m.def("bucketed_gather(Tensor x, Tensor row_pair, Tensor dest, Tensor? gates) -> Tensor");
  // out[n] = sum_j gates[n, j] * rows[dest[n, j]] (gates optional), dropped pairs skipped.
  m.def("weighted_scatter(Tensor rows, Tensor dest, Tensor row_pair, Tensor? gates) -> Tensor");
  // out[n, j] = <a[n], rows[dest[n, j]]>, 0 for dropped pairs: the gates' gradient of both above.
  m.def("gate_grad(Tensor a, Tensor rows, Tensor dest, Tensor row_pair) -> Tensor");
  // a [E, K] in consecutive row ranges of slot_rows [A]; range i times b[slot_ids[i]] ([S, K, M]).
  // slot_rows is read on the host (a GPU slot_rows is copied there first).
  m.def("grouped_mm(Tensor a, Tensor b, Tensor slot_ids, Tensor slot_rows) -> Tensor");
  // The weight gradient of grouped_mm: out[slot_ids[i]] = a_i^T @ grad_i, [n_slots, K, M], zero
  // for slots not in slot_ids.
  m.def(
      "grouped_mm_wgrad(Tensor a, Tensor grad, Tensor slot_ids, Tensor slot_rows, int n_slots) "
      "-> Tensor");
  // An expert's first layer: h = grouped_mm(a, b) + bias[slot] per row range (bias [S, M],
  // optional), and out = the activation of h (csrc/activation.h: "gelu", "gelu_tanh", "silu",
  // "relu2" give [E, M]; the gated "swiglu", "swiglu_interleaved", "swiglu_oai" give [E, M / 2];
  // alpha and limit are swiglu_oai's). h is kept for the backward.
  m.def(
      "grouped_mm_act(Tensor a, Tensor b, Tensor? bias, Tensor slot_ids, Tensor slot_rows, str activation, "
      "float alpha, float limit) -> (Tensor h, Tensor out)");
  // The gradient of grouped_mm_act's h given out's gradient, and (bias_grad) the bias's: per
  // listed slot the column sums of its rows' gradient, [n_slots, M] (zero for the others; [0]
  // without bias_grad).
  m.def(
      "expert_act_backward(Tensor grad, Tensor h, Tensor slot_ids, Tensor slot_rows, str activation, float alpha, "
      "float limit, int n_slots, bool bias_grad) -> (Tensor grad_h, Tensor grad_bias)");
  // The backward of y = weighted_scatter(grouped_mm(a, b, slot_ids, slot_rows), dest, row_pair, gates)
  // given grad_y [N, D], fused: a's gradient [E, I], b's (b_grad 1: [S, I, D]; 2: transposed,
  // [S, D, I], the layout of a weight stored that way and passed as its .mT view; 0: none, [0]),
  // and the gates' [N, k] (0 for dropped pairs). A CPU kernel only (_backend.FUSED_OP_NAMES): elsewhere the
  // unfused ops above compute the same.
  m.def(
      "scatter_mm_backward(Tensor grad_y, Tensor a, Tensor b, Tensor gates, Tensor slot_ids, Tensor slot_rows, "
      "Tensor row_pair, Tensor dest, int b_grad) -> (Tensor grad_a, Tensor grad_b, Tensor grad_gates)");
  // weighted_scatter(grouped_mm(a, b, slot_ids, slot_rows), dest, row_pair, gates): an expert's
  // second layer and the gated combine as one op, whose backward is scatter_mm_backward (the [E, D]
  // outputs are not kept for it). A CPU kernel only (_backend.FUSED_OP_NAMES).
  m.def(
      "grouped_mm_scatter(Tensor a, Tensor b, Tensor gates, Tensor slot_ids, Tensor slot_rows, Tensor row_pair, "
      "Tensor dest) -> Tensor");
  // grouped_mm_act(bucketed_gather(x, row_pair, dest), b, bias, ...)'s activation, [E, M] or
  // [E, M / 2], without the gathered rows or h ever written out: for inference, where the backward
  // needs neither. A CPU kernel only (_backend.FUSED_OP_NAMES).
  m.def(
      "gather_mm_act(Tensor x, Tensor b, Tensor? bias, Tensor slot_ids, Tensor slot_rows, Tensor row_pair, "
      "Tensor dest, str activation, float alpha, float limit) -> Tensor");
  // grouped_mm with quantized weights (minagi/moe/quant.py's storage): range i of a [E, in] times the
  // weights of slot slot_ids[i] that q and scale stand for, [E, out]. bits 8: q [S, out, in] int8;
  // bits 4: q [S, out, in / 2] uint8 (32 inputs a 16-byte block: input j in byte j's low nibble,
  // j + 16 in its high one, each nibble the value + 8). scale [S, out] for group_size 0 (one scale
  // per output channel), else [S, out, in / group_size] (group_size a multiple of 32), in float32,
  // bfloat16 or float16; weight = value * scale. Rows past the ranges are zeros. Its gradient goes
  // to a only (minagi/ops.py): the weights are integers.
  m.def(
      "qgrouped_mm(Tensor a, Tensor q, Tensor scale, Tensor slot_ids, Tensor slot_rows, int bits, int group_size) "
      "-> Tensor");
  // Writing's experts in one call: y[n] = sum_j gates[n, j] * (act(x[n] @ w_in[s] + b_in[s]) @
  // w_out[s] + b_out[s]), s = slot_idx[n, j], for a handful of characters (x [N, D]; slot_idx and
  // gates [N, k]; w_in [S, D, M], w_out [S, H, D], H = M / 2 for the gated forms; b_in [S, M] and
  // b_out [S, D] optional). The pairs are sorted by slot on the host, so each routed slot's weights
  // are read once. One call instead of the unfused decode's plan, gather, two GEMMs, scatter and
  // bias. A CPU kernel only (_backend.FUSED_OP_NAMES).
  m.def(
      "decode_experts(Tensor x, Tensor slot_idx, Tensor gates, Tensor w_in, Tensor w_out, Tensor? b_in, "
      "Tensor? b_out, str activation, float alpha, float limit) -> Tensor");
  // decode_experts with quantized weights (qgrouped_mm's storage): w_in stands for q_in and
  // scale_in ([S, M, D] or [S, M, D / 2] bytes, bits_in, group_in), w_out for q_out and scale_out
  // ([S, D, H] or [S, D, H / 2]). Inference: its gradient goes to x, the gates and the biases only
  // (minagi/ops.py). A CPU kernel only (_backend.FUSED_OP_NAMES).
  m.def(
      "qdecode_experts(Tensor x, Tensor slot_idx, Tensor gates, Tensor q_in, Tensor scale_in, int bits_in, "
      "int group_in, Tensor q_out, Tensor scale_out, int bits_out, int group_out, Tensor? b_in, Tensor? b_out, "
      "str activation, float alpha, float limit) -> Tensor");
}
