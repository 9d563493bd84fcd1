// Bucketed gather and weighted scatter on the CPU, each the other's backward, plus gate_grad.
// Every output row is written by one thread (no atomics), so results are deterministic.
#include <torch/library.h>

#include <vector>

#include "../common.h"
#include "rows.h"

namespace minagi {
namespace {

at::Tensor bucketed_gather_cpu(const at::Tensor& x_in, const at::Tensor& row_pair_in,
                               const at::Tensor& dest_in, const c10::optional<at::Tensor>& gates_in) {
  const char* op = "bucketed_gather";
  check_gather_args(x_in, row_pair_in, dest_in, gates_in);
  const at::Tensor x = x_in.contiguous(), row_pair = row_pair_in.contiguous();
  const int64_t N = x.size(0), D = x.size(1), k = dest_in.size(1), E = row_pair.size(0);
  check_range_cpu(row_pair, -1, N * k, op, "row_pair");
  at::Tensor out = empty_output({E, D}, x.options());
  const at::Tensor gates = gates_in.has_value() ? gates_in->contiguous() : at::Tensor();
  MINAGI_DISPATCH_FLOATING(x.scalar_type(), "minagi_bucketed_gather", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const scalar_t* xp = x.data_ptr<scalar_t>();
    const scalar_t* gp = gates.defined() ? gates.data_ptr<scalar_t>() : nullptr;
    const int64_t* rp = row_pair.data_ptr<int64_t>();
    scalar_t* op_ = out.data_ptr<scalar_t>();
    at::parallel_for(0, E, std::max<int64_t>(1, 16384 / std::max<int64_t>(D, 1)), [&](int64_t b, int64_t e) {
      for (int64_t r = b; r < e; ++r) {
        scalar_t* dst = op_ + r * D;
        const int64_t p = rp[r];
        if (p < 0) {
          std::fill(dst, dst + D, scalar_t(0));
          continue;
        }
        const scalar_t* src = xp + (p / k) * D;
        std::copy(src, src + D, dst);
        if (gp != nullptr) scale_row(dst, static_cast<acc_t>(gp[p]), D);
      }
    });
  });
  return out;
}

at::Tensor weighted_scatter_cpu(const at::Tensor& rows_in, const at::Tensor& dest_in,
                                const at::Tensor& row_pair_in,
                                const c10::optional<at::Tensor>& gates_in) {
  const char* op = "weighted_scatter";
  check_scatter_args(rows_in, dest_in, row_pair_in, gates_in);
  const at::Tensor rows = rows_in.contiguous(), dest = dest_in.contiguous();
  const int64_t E = rows.size(0), D = rows.size(1), N = dest.size(0), k = dest.size(1);
  check_range_cpu(dest, -1, E, op, "dest");
  at::Tensor out = empty_output({N, D}, rows.options());
  const at::Tensor gates = gates_in.has_value() ? gates_in->contiguous() : at::Tensor();
  MINAGI_DISPATCH_FLOATING(rows.scalar_type(), "minagi_weighted_scatter", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const scalar_t* rowp = rows.data_ptr<scalar_t>();
    const scalar_t* gp = gates.defined() ? gates.data_ptr<scalar_t>() : nullptr;
    const int64_t* dp = dest.data_ptr<int64_t>();
    scalar_t* op_ = out.data_ptr<scalar_t>();
    at::parallel_for(0, N, std::max<int64_t>(1, 4096 / std::max<int64_t>(D * k, 1)), [&](int64_t b, int64_t e) {
      std::vector<acc_t> acc(D);
      for (int64_t n = b; n < e; ++n) {
        gated_row_sum(op_ + n * D, rowp, dp + n * k, gp == nullptr ? nullptr : gp + n * k, k, D, acc.data());
      }
    });
  });
  return out;
}

at::Tensor gate_grad_cpu(const at::Tensor& a_in, const at::Tensor& rows_in, const at::Tensor& dest_in,
                         const at::Tensor& row_pair_in) {
  const char* op = "gate_grad";
  check_gate_grad_args(a_in, rows_in, dest_in, row_pair_in);
  const at::Tensor a = a_in.contiguous(), rows = rows_in.contiguous(), dest = dest_in.contiguous();
  const int64_t N = a.size(0), D = a.size(1), k = dest.size(1), E = rows.size(0);
  check_range_cpu(dest, -1, E, op, "dest");
  at::Tensor out = at::empty({N, k}, a.options());
  MINAGI_DISPATCH_FLOATING(a.scalar_type(), "minagi_gate_grad", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const scalar_t* ap = a.data_ptr<scalar_t>();
    const scalar_t* rowp = rows.data_ptr<scalar_t>();
    const int64_t* dp = dest.data_ptr<int64_t>();
    scalar_t* op_ = out.data_ptr<scalar_t>();
    at::parallel_for(0, N, std::max<int64_t>(1, 4096 / std::max<int64_t>(D * k, 1)), [&](int64_t b, int64_t e) {
      for (int64_t n = b; n < e; ++n) {
        for (int64_t j = 0; j < k; ++j) {
          const int64_t r = dp[n * k + j];
          op_[n * k + j] = static_cast<scalar_t>(r >= 0 ? dot_row(ap + n * D, rowp + r * D, D) : acc_t(0));
        }
      }
    });
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(minagi, CPU, m) {
  m.impl("bucketed_gather", &bucketed_gather_cpu);
  m.impl("weighted_scatter", &weighted_scatter_cpu);
  m.impl("gate_grad", &gate_grad_cpu);
}

}  // namespace minagi
