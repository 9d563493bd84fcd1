// Grouped GEMM on the CPU. Rows of `a` come in consecutive ranges, one per listed slot; each
// range is multiplied by its slot's weights read in place from the card (no weight gather, no
// copy of transposed views: the BLAS takes the strides). With exact ranges (an unbucketed plan)
// no padding row is multiplied at all.
//
// This file holds the plain ops, grouped_mm and grouped_mm_scatter. The rest of the family:
// scheduling.h / .cpp (row ranges, parts, threads, tiles), slot_gemm.h (one slot's GEMM and
// grouped_mm_into), grouped_gemm_act.cpp (the GEMM fused with the activation), act_rows.h (the
// activation loops), grouped_gemm_backward.cpp (the backward ops), decode.cpp (decode_experts).
#include <torch/library.h>

#include <ATen/ATen.h>

#include "../common.h"
#include "scheduling.h"
#include "slot_gemm.h"

namespace minagi {

at::Tensor grouped_mm_cpu(const at::Tensor& a_in, const at::Tensor& b, const at::Tensor& slot_ids,
                          const at::Tensor& slot_rows) {
  check_grouped_mm_args(a_in, b);
  const at::Tensor a = a_in.contiguous();
  const auto start = range_starts(slot_ids, slot_rows, a.size(0), b.size(0), "grouped_mm", false);
  at::Tensor out = empty_output({a.size(0), b.size(2)}, a.options());
  grouped_mm_into(a, b, at::Tensor(), slot_ids, start, out, [](int64_t, int64_t) {});
  zero_tail(out, start.back());
  return out;
}

namespace {

at::Tensor grouped_mm_scatter_cpu(const at::Tensor& a, const at::Tensor& b, const at::Tensor& gates,
                                  const at::Tensor& slot_ids, const at::Tensor& slot_rows, const at::Tensor& row_pair,
                                  const at::Tensor& dest) {
  static const auto scatter = c10::Dispatcher::singleton()
                                  .findSchemaOrThrow("minagi::weighted_scatter", "")
                                  .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                                    const c10::optional<at::Tensor>&)>();
  return scatter.call(grouped_mm_cpu(a, b, slot_ids, slot_rows), dest, row_pair, gates);
}

}  // namespace

TORCH_LIBRARY_IMPL(minagi, CPU, m) {
  m.impl("grouped_mm", &grouped_mm_cpu);
  m.impl("grouped_mm_scatter", &grouped_mm_scatter_cpu);
}

}  // namespace minagi
