// decode_experts and qdecode_experts on the CPU: the whole expert MLP for a few characters in one
// op (plan by a sort, gather, both layers through grouped_mm_into's few-row kernels or
// qgrouped_mm_into's, gated sum), where the unfused pipeline's dispatched ops would cost more than
// its GEMMs.
#include <torch/library.h>

#include <ATen/ATen.h>

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <string>
#include <utility>
#include <vector>

#include "../common.h"
#include "quant.h"
#include "rows.h"
#include "scheduling.h"
#include "slot_gemm.h"

namespace minagi {
namespace {

// x, slot_idx and gates as both decode ops take them (op: the name the messages give).
void check_decode_rows(const at::Tensor& x, const at::Tensor& slot_idx, const at::Tensor& gates, const char* op) {
  check_dim(x, 2, op, "x");
  check_floating(x, op, "x");
  check_dim(slot_idx, 2, op, "slot_idx");
  check_index(slot_idx, op, "slot_idx");
  check_size(slot_idx, 0, x.size(0), op, "slot_idx", "x.shape[0]");
  TORCH_CHECK(gates.sizes() == slot_idx.sizes(), "minagi.", op, ": gates must have slot_idx's shape ",
              slot_idx.sizes(), ", got ", gates.sizes());
  check_same_dtype(x, gates, op, "x", "gates");
  check_same_device(x, gates, op, "x", "gates");
  check_same_device(x, slot_idx, op, "x", "slot_idx");
}

// An optional bias [S, width] in x's dtype, on x's device.
void check_decode_bias(const at::Tensor& x, const c10::optional<at::Tensor>& bias, int64_t S, int64_t width,
                       const char* op, const char* name) {
  if (!bias.has_value()) return;
  TORCH_CHECK(bias->dim() == 2 && bias->size(0) == S && bias->size(1) == width, "minagi.", op, ": ", name,
              " must be [", S, ", ", width, "], got shape ", bias->sizes());
  check_same_dtype(x, *bias, op, "x", name);
  check_same_device(x, *bias, op, "x", name);
}

Act check_decode_experts_args(const at::Tensor& x, const at::Tensor& slot_idx, const at::Tensor& gates,
                              const at::Tensor& w_in, const at::Tensor& w_out, const c10::optional<at::Tensor>& b_in,
                              const c10::optional<at::Tensor>& b_out, const std::string& activation) {
  const char* op = "decode_experts";
  check_decode_rows(x, slot_idx, gates, op);
  check_dim(w_in, 3, op, "w_in");
  check_dim(w_out, 3, op, "w_out");
  const Act act = parse_act(activation, op);
  const int64_t S = w_in.size(0), D = x.size(1), M = w_in.size(2), H = act_gated(act) ? M / 2 : M;
  TORCH_CHECK(!act_gated(act) || M % 2 == 0, "minagi.decode_experts: the gated form '", activation,
              "' needs an even width of w_in (gate and up, 2H), got shape ", w_in.sizes());
  check_size(w_in, 1, D, op, "w_in", "x.shape[1]");
  TORCH_CHECK(w_out.size(0) == S && w_out.size(1) == H && w_out.size(2) == D, "minagi.decode_experts: w_out must be ",
              "[S, H, D] = [", S, ", ", H, ", ", D, "] for x ", x.sizes(), " and w_in ", w_in.sizes(), ", got ",
              w_out.sizes());
  check_decode_bias(x, b_in, S, M, op, "b_in");
  check_decode_bias(x, b_out, S, D, op, "b_out");
  for (const auto& [name, t] : {std::pair<const char*, const at::Tensor*>{"w_in", &w_in}, {"w_out", &w_out}}) {
    check_same_dtype(x, *t, op, "x", name);
    check_same_device(x, *t, op, "x", name);
  }
  return act;
}

// A decode call's plan: the pairs sorted by slot (at most 32 where dispatch calls it), each routed
// slot one range of buffer rows.
struct DecodePlan {
  std::vector<int64_t> pair;  // buffer row -> its pair
  std::vector<int64_t> dest;  // pair -> its buffer row
  std::vector<int64_t> ids;   // each range's slot
  std::vector<int64_t> start{0};

  explicit DecodePlan(const at::Tensor& idx) : pair(idx.numel()), dest(idx.numel()) {
    const int64_t* ip = idx.data_ptr<int64_t>();
    const int64_t E = idx.numel();
    std::iota(pair.begin(), pair.end(), int64_t{0});
    std::stable_sort(pair.begin(), pair.end(), [&](int64_t p, int64_t q) { return ip[p] < ip[q]; });
    for (int64_t e = 0; e < E; ++e) {
      dest[pair[e]] = e;
      if (e > 0 && ip[pair[e]] != ip[pair[e - 1]]) start.push_back(e);
      if (e == 0 || ip[pair[e]] != ip[pair[e - 1]]) ids.push_back(ip[pair[e]]);
    }
    if (E > 0) start.push_back(E);
  }
};

// The call around its two layers: x's rows gathered in the plan's order (a [E, D]), layers(plan,
// a, out) writing each pair's expert output (b_out included) to out [E, D], then each character's
// gated sum, one row in the accumulation type.
template <typename Layers>
at::Tensor decode_call(const at::Tensor& x, const at::Tensor& idx, const at::Tensor& gates, Layers&& layers) {
  const int64_t N = x.size(0), D = x.size(1), K = idx.size(1), E = N * K;
  const DecodePlan plan(idx);
  at::Tensor y = at::empty({N, D}, x.options());
  if (E == 0) return y.zero_();
  at::Tensor a = at::empty({E, D}, x.options());
  at::Tensor out = at::empty({E, D}, x.options());
  MINAGI_DISPATCH_FLOATING(x.scalar_type(), "minagi_decode_experts", [&] {
    gather_pair_rows(a.data_ptr<scalar_t>(), x.data_ptr<scalar_t>(), plan.pair.data(), E, K, D);
  });
  layers(plan, a, out);
  MINAGI_DISPATCH_FLOATING(x.scalar_type(), "minagi_decode_experts", [&] {
    std::vector<at::opmath_type<scalar_t>> acc(D);
    for (int64_t n = 0; n < N; ++n) {
      gated_row_sum(y.data_ptr<scalar_t>() + n * D, out.data_ptr<scalar_t>(), plan.dest.data() + n * K,
                    gates.data_ptr<scalar_t>() + n * K, K, D, acc.data());
    }
  });
  return y;
}

// decode_experts (csrc/ops.cpp): the unfused decode's ten or so dispatched ops (plan, gather, two
// GEMMs, scatter, bias) cost more than the GEMMs' own time at 1 character. Here the plan is a sort
// of the pairs, both layers go through grouped_mm_into (the few-row kernels, their threads' split,
// the bias and activation as in grouped_mm_act; b_out added to each pair's output).
at::Tensor decode_experts_cpu(const at::Tensor& x_in, const at::Tensor& slot_idx_in, const at::Tensor& gates_in,
                              const at::Tensor& w_in, const at::Tensor& w_out,
                              const c10::optional<at::Tensor>& b_in_opt, const c10::optional<at::Tensor>& b_out_opt,
                              c10::string_view activation, double alpha, double limit) {
  const at::Tensor x = x_in.contiguous();
  const Act act = check_decode_experts_args(x, slot_idx_in, gates_in, w_in, w_out, b_in_opt, b_out_opt,
                                            std::string(activation));
  const at::Tensor idx = slot_idx_in.contiguous(), gates = gates_in.contiguous();
  check_slot_ids_cpu(idx, w_in.size(0));
  const at::Tensor b_in = b_in_opt.has_value() ? b_in_opt->contiguous() : at::Tensor();
  const at::Tensor b_out = b_out_opt.has_value() ? b_out_opt->contiguous() : at::Tensor();
  return decode_call(x, idx, gates, [&](const DecodePlan& plan, const at::Tensor& a, at::Tensor& out) {
    const int64_t E = a.size(0), M = w_in.size(2);
    const at::Tensor slot_ids = at::tensor(plan.ids, idx.options());
    at::Tensor h = at::empty({E, M}, x.options());
    at::Tensor hact = at::empty({E, act_gated(act) ? M / 2 : M}, x.options());
    grouped_mm_into(a, w_in, b_in, slot_ids, plan.start, h, [&](int64_t r0, int64_t nr) {
      act_forward(act, h.narrow(0, r0, nr), hact.narrow(0, r0, nr), alpha, limit);
    });
    grouped_mm_into(hact, w_out, b_out, slot_ids, plan.start, out, [](int64_t, int64_t) {});
  });
}

// rows [start[i], start[i + 1]) of h += bias[ids[i]], in the accumulation type, rounded once.
void add_range_bias(at::Tensor& h, const at::Tensor& bias, const DecodePlan& plan) {
  const int64_t M = h.size(1);
  MINAGI_DISPATCH_FLOATING(h.scalar_type(), "minagi_qdecode_experts", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    scalar_t* hp = h.data_ptr<scalar_t>();
    const scalar_t* bp = bias.data_ptr<scalar_t>();
    for (size_t i = 0; i + 1 < plan.start.size(); ++i) {
      for (int64_t r = plan.start[i]; r < plan.start[i + 1]; ++r) {
        for (int64_t j = 0; j < M; ++j) {
          hp[r * M + j] = static_cast<scalar_t>(static_cast<acc_t>(hp[r * M + j]) +
                                                static_cast<acc_t>(bp[plan.ids[i] * M + j]));
        }
      }
    }
  });
}

// qdecode_experts (csrc/ops.cpp): decode_experts with quantized weights, both layers through
// qgrouped_mm_into (each routed slot's bytes read once, dequantized in registers).
at::Tensor qdecode_experts_cpu(const at::Tensor& x_in, const at::Tensor& slot_idx_in, const at::Tensor& gates_in,
                               const at::Tensor& q_in, const at::Tensor& scale_in, int64_t bits_in, int64_t group_in,
                               const at::Tensor& q_out, const at::Tensor& scale_out, int64_t bits_out,
                               int64_t group_out, const c10::optional<at::Tensor>& b_in_opt,
                               const c10::optional<at::Tensor>& b_out_opt, c10::string_view activation, double alpha,
                               double limit) {
  const char* op = "qdecode_experts";
  const at::Tensor x = x_in.contiguous();
  check_decode_rows(x, slot_idx_in, gates_in, op);
  const Act act = parse_act(std::string(activation), op);
  const int64_t S = q_in.dim() == 3 ? q_in.size(0) : 0, D = x.size(1);
  check_quantized_weight(x, D, q_in, scale_in, bits_in, group_in, op, "x", "q_in", "scale_in");
  const int64_t M = q_in.size(1), H = act_gated(act) ? M / 2 : M;
  TORCH_CHECK(!act_gated(act) || M % 2 == 0, "minagi.qdecode_experts: the gated form '", activation,
              "' needs an even width of q_in (gate and up, 2H), got shape ", q_in.sizes());
  check_quantized_weight(x, H, q_out, scale_out, bits_out, group_out, op, "the activation", "q_out", "scale_out");
  TORCH_CHECK(q_out.size(0) == S && q_out.size(1) == D, "minagi.qdecode_experts: q_out must hold [S, D] = [", S,
              ", ", D, "] output channels for x ", x.sizes(), " and q_in ", q_in.sizes(), ", got ", q_out.sizes());
  check_decode_bias(x, b_in_opt, S, M, op, "b_in");
  check_decode_bias(x, b_out_opt, S, D, op, "b_out");
  const at::Tensor idx = slot_idx_in.contiguous(), gates = gates_in.contiguous();
  check_slot_ids_cpu(idx, S);
  return decode_call(x, idx, gates, [&](const DecodePlan& plan, const at::Tensor& a, at::Tensor& out) {
    const int64_t E = a.size(0);
    at::Tensor h = at::empty({E, M}, x.options());
    at::Tensor hact = at::empty({E, H}, x.options());
    qgrouped_mm_into(a, q_in, scale_in, bits_in, group_in, plan.ids.data(), plan.start, h);
    if (b_in_opt.has_value()) add_range_bias(h, b_in_opt->contiguous(), plan);
    act_forward(act, h, hact, alpha, limit);
    qgrouped_mm_into(hact, q_out, scale_out, bits_out, group_out, plan.ids.data(), plan.start, out);
    if (b_out_opt.has_value()) add_range_bias(out, b_out_opt->contiguous(), plan);
  });
}

}  // namespace

TORCH_LIBRARY_IMPL(minagi, CPU, m) {
  m.impl("decode_experts", &decode_experts_cpu);
  m.impl("qdecode_experts", &qdecode_experts_cpu);
}

}  // namespace minagi
