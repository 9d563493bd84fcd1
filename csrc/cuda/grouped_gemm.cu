// Grouped GEMM on the GPU: per group (a run of slots with equal rows in the plan), one batched
// matmul through ATen and the vendor BLAS (cuBLAS / hipBLASLt) at the group's bucketed
// capacity. The listed slots' weights are gathered once per call into one buffer that every
// group takes a view of. The group sizes are read from slot_rows on the host: group_plan
// returns it there, so this adds no synchronisation.
#include <torch/library.h>

#include <vector>

#include "launch.cuh"

namespace minagi {
namespace {

struct Group {
  int64_t slot0, slots, rows, row0;  // first listed slot, how many, rows each, first buffer row
};

// The plan's groups from slot_rows on the host (a device slot_rows is copied over: one sync).
std::vector<Group> host_groups(const at::Tensor& slot_ids, const at::Tensor& slot_rows_in, int64_t E,
                               const char* op) {
  check_dim(slot_ids, 1, op, "slot_ids");
  check_dim(slot_rows_in, 1, op, "slot_rows");
  check_index(slot_ids, op, "slot_ids");
  check_index(slot_rows_in, op, "slot_rows");
  TORCH_CHECK(slot_ids.size(0) == slot_rows_in.size(0), "minagi.", op, ": slot_ids (", slot_ids.size(0),
              ") and slot_rows (", slot_rows_in.size(0), ") must have one length");
  const at::Tensor rows = slot_rows_in.to(at::kCPU).contiguous();
  const int64_t* rp = rows.data_ptr<int64_t>();
  std::vector<Group> groups;
  int64_t row = 0;
  for (int64_t i = 0; i < rows.size(0); ++i) {
    TORCH_CHECK(rp[i] >= 0, "minagi.", op, ": slot_rows holds ", rp[i], " at position ", i,
                "; row counts must be >= 0");
    if (!groups.empty() && groups.back().rows == rp[i]) {
      ++groups.back().slots;
    } else {
      groups.push_back({i, 1, rp[i], row});
    }
    row += rp[i];
  }
  TORCH_CHECK(row == E, "minagi.", op, ": slot_rows sums to ", row, " rows but the input has ", E, " rows");
  return groups;
}

at::Tensor grouped_mm_cuda(const at::Tensor& a_in, const at::Tensor& b, const at::Tensor& slot_ids,
                           const at::Tensor& slot_rows) {
  const char* op = "grouped_mm";
  check_grouped_mm_args(a_in, b);
  gpu::check_cuda(a_in, op, "a");
  const c10::cuda::CUDAGuard guard(a_in.device());
  const at::Tensor a = a_in.contiguous();
  const int64_t E = a.size(0), K = a.size(1), M = b.size(2), A = slot_ids.size(0);
  const auto groups = host_groups(slot_ids, slot_rows, E, op);
  at::Tensor out = gpu::bucketed_empty(E, {M}, a.options());
  if (E == 0) return out;
  // Every listed slot's weights once, in plan order (out-of-range ids trip index_select's check).
  at::Tensor w = gpu::bucketed_empty(A, {K, M}, b.options());
  at::index_select_out(w, b, 0, slot_ids.to(a.device()));
  for (const Group& g : groups) {
    if (g.rows == 0) continue;
    const int64_t n = g.slots * g.rows;
    at::Tensor o = out.narrow(0, g.row0, n).view({g.slots, g.rows, M});
    at::bmm_out(o, a.narrow(0, g.row0, n).view({g.slots, g.rows, K}), w.narrow(0, g.slot0, g.slots));
  }
  return out;
}

at::Tensor grouped_mm_wgrad_cuda(const at::Tensor& a_in, const at::Tensor& grad_in, const at::Tensor& slot_ids,
                                 const at::Tensor& slot_rows, int64_t n_slots) {
  const char* op = "grouped_mm_wgrad";
  check_wgrad_args(a_in, grad_in, n_slots);
  gpu::check_cuda(a_in, op, "a");
  const c10::cuda::CUDAGuard guard(a_in.device());
  const at::Tensor a = a_in.contiguous(), grad = grad_in.contiguous();
  const int64_t E = a.size(0), K = a.size(1), M = grad.size(1), A = slot_ids.size(0);
  const auto groups = host_groups(slot_ids, slot_rows, E, op);
  at::Tensor out = at::zeros({n_slots, K, M}, a.options());
  if (A == 0) return out;
  // Each listed slot's gradient in plan order, then one copy to its slot (ids are unique in a
  // plan, so the copy has no write conflicts and is deterministic).
  at::Tensor part = gpu::bucketed_empty(A, {K, M}, a.options());
  for (const Group& g : groups) {
    at::Tensor o = part.narrow(0, g.slot0, g.slots);
    if (g.rows == 0) {
      o.zero_();
      continue;
    }
    const int64_t n = g.slots * g.rows;
    at::bmm_out(o, a.narrow(0, g.row0, n).view({g.slots, g.rows, K}).transpose(1, 2),
                grad.narrow(0, g.row0, n).view({g.slots, g.rows, M}));
  }
  out.index_copy_(0, slot_ids.to(a.device()), part);
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(minagi, CUDA, m) {
  m.impl("grouped_mm", &grouped_mm_cuda);
  m.impl("grouped_mm_wgrad", &grouped_mm_wgrad_cuda);
}

}  // namespace minagi
