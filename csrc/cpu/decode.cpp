// decode_experts on the CPU: the whole expert MLP for a few characters in one op (plan by a sort,
// gather, both layers through grouped_mm_into's few-row kernels, gated sum), where the unfused
// pipeline's dispatched ops would cost more than its GEMMs.
#include <torch/library.h>

#include <ATen/ATen.h>

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <string>
#include <utility>
#include <vector>

#include "../common.h"
#include "rows.h"
#include "scheduling.h"
#include "slot_gemm.h"

namespace minagi {
namespace {

Act check_decode_experts_args(const at::Tensor& x, const at::Tensor& slot_idx, const at::Tensor& gates,
                              const at::Tensor& w_in, const at::Tensor& w_out, const c10::optional<at::Tensor>& b_in,
                              const c10::optional<at::Tensor>& b_out, const std::string& activation) {
  const char* op = "decode_experts";
  check_dim(x, 2, op, "x");
  check_floating(x, op, "x");
  check_dim(w_in, 3, op, "w_in");
  check_dim(w_out, 3, op, "w_out");
  check_dim(slot_idx, 2, op, "slot_idx");
  check_index(slot_idx, op, "slot_idx");
  const Act act = parse_act(activation, op);
  const int64_t S = w_in.size(0), D = x.size(1), M = w_in.size(2), H = act_gated(act) ? M / 2 : M;
  TORCH_CHECK(!act_gated(act) || M % 2 == 0, "minagi.decode_experts: the gated form '", activation,
              "' needs an even width of w_in (gate and up, 2H), got shape ", w_in.sizes());
  check_size(w_in, 1, D, op, "w_in", "x.shape[1]");
  TORCH_CHECK(w_out.size(0) == S && w_out.size(1) == H && w_out.size(2) == D, "minagi.decode_experts: w_out must be ",
              "[S, H, D] = [", S, ", ", H, ", ", D, "] for x ", x.sizes(), " and w_in ", w_in.sizes(), ", got ",
              w_out.sizes());
  check_size(slot_idx, 0, x.size(0), op, "slot_idx", "x.shape[0]");
  TORCH_CHECK(gates.sizes() == slot_idx.sizes(), "minagi.decode_experts: gates must have slot_idx's shape ",
              slot_idx.sizes(), ", got ", gates.sizes());
  const std::pair<const char*, const c10::optional<at::Tensor>*> biases[] = {{"b_in", &b_in}, {"b_out", &b_out}};
  for (const auto& [name, bias] : biases) {
    if (!bias->has_value()) continue;
    const int64_t width = bias == &b_in ? M : D;
    TORCH_CHECK((*bias)->dim() == 2 && (*bias)->size(0) == S && (*bias)->size(1) == width, "minagi.decode_experts: ",
                name, " must be [", S, ", ", width, "], got shape ", (*bias)->sizes());
    check_same_dtype(x, **bias, op, "x", name);
    check_same_device(x, **bias, op, "x", name);
  }
  for (const auto& [name, t] : {std::pair<const char*, const at::Tensor*>{"gates", &gates}, {"w_in", &w_in},
                                {"w_out", &w_out}}) {
    check_same_dtype(x, *t, op, "x", name);
    check_same_device(x, *t, op, "x", name);
  }
  check_same_device(x, slot_idx, op, "x", "slot_idx");
  return act;
}

// decode_experts (csrc/ops.cpp): the unfused decode's ten or so dispatched ops (plan, gather, two
// GEMMs, scatter, bias) cost more than the GEMMs' own time at 1 character. Here the plan is a sort
// of the pairs (at most 32 where dispatch calls it), both layers go through grouped_mm_into (the
// few-row kernels, their threads' split, the bias and activation as in grouped_mm_act; b_out added
// to each pair's output), and each character's gated sum is one row in the accumulation type.
at::Tensor decode_experts_cpu(const at::Tensor& x_in, const at::Tensor& slot_idx_in, const at::Tensor& gates_in,
                              const at::Tensor& w_in, const at::Tensor& w_out,
                              const c10::optional<at::Tensor>& b_in_opt, const c10::optional<at::Tensor>& b_out_opt,
                              c10::string_view activation, double alpha, double limit) {
  const at::Tensor x = x_in.contiguous();
  const Act act = check_decode_experts_args(x, slot_idx_in, gates_in, w_in, w_out, b_in_opt, b_out_opt,
                                            std::string(activation));
  const at::Tensor idx = slot_idx_in.contiguous(), gates = gates_in.contiguous();
  const int64_t N = x.size(0), D = x.size(1), K = idx.size(1), E = N * K, M = w_in.size(2);
  check_slot_ids_cpu(idx, w_in.size(0));
  const int64_t* ip = idx.data_ptr<int64_t>();
  std::vector<int64_t> pair(E);  // buffer row -> its pair, sorted by slot
  std::iota(pair.begin(), pair.end(), int64_t{0});
  std::stable_sort(pair.begin(), pair.end(), [&](int64_t p, int64_t q) { return ip[p] < ip[q]; });
  std::vector<int64_t> ids, start{0}, dest(E);
  for (int64_t e = 0; e < E; ++e) {
    dest[pair[e]] = e;
    if (e > 0 && ip[pair[e]] != ip[pair[e - 1]]) start.push_back(e);
    if (e == 0 || ip[pair[e]] != ip[pair[e - 1]]) ids.push_back(ip[pair[e]]);
  }
  if (E > 0) start.push_back(E);
  const at::Tensor slot_ids = at::tensor(ids, idx.options());
  const at::Tensor b_in = b_in_opt.has_value() ? b_in_opt->contiguous() : at::Tensor();
  const at::Tensor b_out = b_out_opt.has_value() ? b_out_opt->contiguous() : at::Tensor();
  at::Tensor y = at::empty({N, D}, x.options());
  if (E == 0) return y.zero_();
  at::Tensor a = at::empty({E, D}, x.options());
  at::Tensor h = at::empty({E, M}, x.options());
  at::Tensor hact = at::empty({E, act_gated(act) ? M / 2 : M}, x.options());
  at::Tensor out = at::empty({E, D}, x.options());
  MINAGI_DISPATCH_FLOATING(x.scalar_type(), "minagi_decode_experts", [&] {
    gather_pair_rows(a.data_ptr<scalar_t>(), x.data_ptr<scalar_t>(), pair.data(), E, K, D);
  });
  grouped_mm_into(a, w_in, b_in, slot_ids, start, h, [&](int64_t r0, int64_t nr) {
    act_forward(act, h.narrow(0, r0, nr), hact.narrow(0, r0, nr), alpha, limit);
  });
  grouped_mm_into(hact, w_out, b_out, slot_ids, start, out, [](int64_t, int64_t) {});
  MINAGI_DISPATCH_FLOATING(x.scalar_type(), "minagi_decode_experts", [&] {
    std::vector<at::opmath_type<scalar_t>> acc(D);
    for (int64_t n = 0; n < N; ++n) {
      gated_row_sum(y.data_ptr<scalar_t>() + n * D, out.data_ptr<scalar_t>(), dest.data() + n * K,
                    gates.data_ptr<scalar_t>() + n * K, K, D, acc.data());
    }
  });
  return y;
}

}  // namespace

TORCH_LIBRARY_IMPL(minagi, CPU, m) {
  m.impl("decode_experts", &decode_experts_cpu);
}

}  // namespace minagi
