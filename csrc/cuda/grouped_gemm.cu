// Grouped GEMM on the GPU: per group (a run of slots with equal rows in the plan), one batched
// matmul through ATen and the vendor BLAS (cuBLAS / hipBLASLt) at the group's bucketed
// capacity. The listed slots' weights are gathered once per call into one buffer that every
// group takes a view of. The group sizes are read from slot_rows on the host: group_plan
// returns it there, so this adds no synchronisation.
//
// Decoding (a handful of rows per slot: one character puts one row in each of its top_k slots)
// takes a kernel of its own (grouped_gemm_kernels.cuh) that reads each listed slot's weights in
// place, once, like the CPU's small_rows_mm: the gather + bmm would read every weight, write a
// copy and read it again.
#include <torch/library.h>

#include <vector>

#include "grouped_gemm_kernels.cuh"
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
  TORCH_CHECK(row <= E, "minagi.", op, ": slot_rows sums to ", row, " rows but the input has only ", E, " rows");
  return groups;
}

// The rows the listed ranges cover; those past them (an exact plan's dropped pairs) own no slot.
int64_t listed_rows(const std::vector<Group>& groups) {
  return groups.empty() ? 0 : groups.back().row0 + groups.back().slots * groups.back().rows;
}

// The decode case: every listed slot owns at most kSmallRows rows (and the slots fit one grid).
bool small_rows_case(const std::vector<Group>& groups, int64_t A) {
  if (A > gpu::kMaxBlocks) return false;
  for (const Group& g : groups) {
    if (g.rows > gpu::kSmallRows) return false;
  }
  return true;
}

void small_rows_mm_cuda(const at::Tensor& a, const at::Tensor& b, const at::Tensor& slot_ids,
                        const std::vector<Group>& groups, int64_t A, at::Tensor& out) {
  std::vector<int64_t> row0(A), nrows(A);
  for (const Group& g : groups) {
    for (int64_t j = 0; j < g.slots; ++j) {
      row0[g.slot0 + j] = g.row0 + j * g.rows;
      nrows[g.slot0 + j] = g.rows;
    }
  }
  const auto lopt = at::TensorOptions().dtype(at::kLong);
  const at::Tensor r0 = at::tensor(row0, lopt).to(a.device()), nr = at::tensor(nrows, lopt).to(a.device());
  const at::Tensor ids = slot_ids.to(a.device()).contiguous();
  const int64_t K = a.size(1), M = b.size(2);
  const dim3 grid(static_cast<unsigned>((M + gpu::kThreads - 1) / gpu::kThreads), static_cast<unsigned>(A));
  MINAGI_DISPATCH_FLOATING(a.scalar_type(), "minagi_small_rows_mm_cuda", [&] {
    gpu::small_rows_kernel<scalar_t><<<grid, gpu::kThreads, 0, at::cuda::getCurrentCUDAStream()>>>(
        a.data_ptr<scalar_t>(), b.data_ptr<scalar_t>(), b.stride(0), b.stride(1), b.stride(2),
        ids.data_ptr<int64_t>(), r0.data_ptr<int64_t>(), nr.data_ptr<int64_t>(), K, M, b.size(0),
        out.data_ptr<scalar_t>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

at::Tensor grouped_mm_cuda(const at::Tensor& a_in, const at::Tensor& b, const at::Tensor& slot_ids,
                           const at::Tensor& slot_rows) {
  const char* op = "grouped_mm";
  check_grouped_mm_args(a_in, b);
  gpu::check_cuda(a_in, op, "a");
  const c10::cuda::CUDAGuard guard(a_in.device());
  const at::Tensor a = a_in.contiguous();
  const auto groups = host_groups(slot_ids, slot_rows, a.size(0), op);  // checks slot_ids' shape first
  const int64_t E = a.size(0), K = a.size(1), M = b.size(2), A = slot_ids.size(0);
  if (slot_ids.device().is_cpu()) {
    check_range_cpu(slot_ids.contiguous(), 0, b.size(0), op, "slot_ids");
  } else {
    debug_check_range(slot_ids, 0, b.size(0), op, "slot_ids");
  }
  at::Tensor out = gpu::bucketed_empty(E, {M}, a.options());
  if (E == 0) return out;
  const int64_t listed = listed_rows(groups);
  if (listed < E) out.narrow(0, listed, E - listed).zero_();
  if (small_rows_case(groups, A)) {
    small_rows_mm_cuda(a, b, slot_ids, groups, A, out);
    return out;
  }
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
  const auto groups = host_groups(slot_ids, slot_rows, a.size(0), op);  // checks slot_ids' shape first
  const int64_t E = a.size(0), K = a.size(1), M = grad.size(1), A = slot_ids.size(0);
  // Unique and in range, as the CPU kernel requires: index_copy_ below would keep one of two
  // writes to a slot listed twice. Checked on the host where the ids are (a plan's are on the
  // device: there MINAGI_DEBUG_CHECKS=1 copies them over).
  if (slot_ids.device().is_cpu() || debug_checks()) check_unique_slots_cpu(slot_ids.to(at::kCPU), n_slots, op);
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
