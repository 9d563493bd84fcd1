// Routing on the CPU: per character, top_k slots by logit (ties to the lower slot, NaN ranked as
// -inf so indices are always valid) and the softmax over the k chosen logits.
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <vector>

#include "../common.h"

namespace minagi {
namespace {

template <typename scalar_t>
void route_rows(const scalar_t* logits, int64_t N, int64_t S, int64_t k, int64_t* idx,
                scalar_t* gates) {
  using acc_t = at::opmath_type<scalar_t>;
  at::parallel_for(0, N, std::max<int64_t>(1, 4096 / std::max<int64_t>(S, 1)), [&](int64_t b, int64_t e) {
    std::vector<int64_t> order(S);
    std::vector<acc_t> key(S);
    std::vector<acc_t> val(k);
    for (int64_t n = b; n < e; ++n) {
      const scalar_t* row = logits + n * S;
      for (int64_t s = 0; s < S; ++s) {
        const acc_t v = static_cast<acc_t>(row[s]);
        key[s] = std::isnan(v) ? -std::numeric_limits<acc_t>::infinity() : v;
      }
      std::iota(order.begin(), order.end(), int64_t{0});
      std::partial_sort(order.begin(), order.begin() + k, order.end(), [&](int64_t i, int64_t j) {
        return key[i] > key[j] || (key[i] == key[j] && i < j);
      });
      // Softmax over the chosen logits as torch computes it: a NaN or an all -inf choice gives
      // NaN gates, so a broken router shows in the loss instead of being hidden.
      acc_t m = -std::numeric_limits<acc_t>::infinity();
      for (int64_t j = 0; j < k; ++j) {
        val[j] = static_cast<acc_t>(row[order[j]]);
        if (val[j] > m) m = val[j];
      }
      acc_t sum = 0;
      for (int64_t j = 0; j < k; ++j) {
        val[j] = std::exp(val[j] - m);
        sum += val[j];
      }
      for (int64_t j = 0; j < k; ++j) {
        idx[n * k + j] = order[j];
        gates[n * k + j] = static_cast<scalar_t>(val[j] / sum);
      }
    }
  });
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> routing_cpu(const at::Tensor& logits_in,
                                                          int64_t top_k) {
  check_routing_args(logits_in, top_k);
  const int64_t N = logits_in.size(0), S = logits_in.size(1);
  const at::Tensor logits = logits_in.contiguous();
  at::Tensor idx = at::empty({N, top_k}, logits.options().dtype(at::kLong));
  at::Tensor gates = at::empty({N, top_k}, logits.options());
  at::Tensor load = at::zeros({S}, logits.options().dtype(at::kLong));
  MINAGI_DISPATCH_FLOATING(logits.scalar_type(), "minagi_routing", [&] {
    route_rows<scalar_t>(logits.data_ptr<scalar_t>(), N, S, top_k, idx.data_ptr<int64_t>(),
                         gates.data_ptr<scalar_t>());
  });
  // One pass over N * k indices: cheaper than per-thread histograms at these sizes.
  const int64_t* ip = idx.data_ptr<int64_t>();
  int64_t* lp = load.data_ptr<int64_t>();
  for (int64_t i = 0; i < N * top_k; ++i) ++lp[ip[i]];
  return {idx, gates, load};
}

at::Tensor routing_backward_cpu(const at::Tensor& grad_gates_in, const at::Tensor& gates_in,
                                const at::Tensor& slot_idx_in, int64_t n_slots) {
  check_routing_backward_args(grad_gates_in, gates_in, slot_idx_in, n_slots);
  const at::Tensor gg = grad_gates_in.contiguous(), g = gates_in.contiguous(),
                   idx = slot_idx_in.contiguous();
  check_range_cpu(idx, 0, n_slots, "routing_backward", "slot_idx");
  const int64_t N = g.size(0), k = g.size(1);
  at::Tensor out = at::zeros({N, n_slots}, g.options());
  MINAGI_DISPATCH_FLOATING(g.scalar_type(), "minagi_routing_backward", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const scalar_t* gp = g.data_ptr<scalar_t>();
    const scalar_t* ggp = gg.data_ptr<scalar_t>();
    const int64_t* ip = idx.data_ptr<int64_t>();
    scalar_t* op_ = out.data_ptr<scalar_t>();
    at::parallel_for(0, N, 256, [&](int64_t b, int64_t e) {
      for (int64_t n = b; n < e; ++n) {
        acc_t dot = 0;
        for (int64_t j = 0; j < k; ++j)
          dot += static_cast<acc_t>(gp[n * k + j]) * static_cast<acc_t>(ggp[n * k + j]);
        for (int64_t j = 0; j < k; ++j) {
          const acc_t gj = static_cast<acc_t>(gp[n * k + j]);
          scalar_t& o = op_[n * n_slots + ip[n * k + j]];
          o = static_cast<scalar_t>(static_cast<acc_t>(o) +
                                    gj * (static_cast<acc_t>(ggp[n * k + j]) - dot));
        }
      }
    });
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(minagi, CPU, m) {
  m.impl("routing", &routing_cpu);
  m.impl("routing_backward", &routing_backward_cpu);
}

}  // namespace minagi
