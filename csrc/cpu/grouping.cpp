// Load grouping on the CPU: slot_idx [N, k] -> the dispatch plan (see the schema in ops.cpp).
// A stable counting sort by slot: within a slot, pairs stay in character order, then k order,
// which is also the order in which capacity keeps them.
#include <torch/library.h>

#include <algorithm>
#include <vector>

#include "../common.h"

namespace minagi {
namespace {

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> group_plan_cpu(
    const at::Tensor& slot_idx_in, int64_t n_slots, int64_t capacity, bool bucketed, bool skip_invalid) {
  check_group_plan_args(slot_idx_in, n_slots, capacity, skip_invalid);
  const at::Tensor idx = slot_idx_in.contiguous();
  const int64_t N = idx.size(0), k = idx.size(1), R = N * k;
  const int64_t* ip = idx.data_ptr<int64_t>();
  const auto lopt = idx.options();

  std::vector<int64_t> count(n_slots, 0);
  if (!skip_invalid) check_slot_ids_cpu(idx, n_slots);
  for (int64_t i = 0; i < R; ++i) {
    const int64_t s = ip[i];
    if (s >= 0 && s < n_slots) ++count[s];  // out of range: skipped (checked above unless skip_invalid)
  }
  at::Tensor load = at::empty({n_slots}, lopt);
  int64_t* lp = load.data_ptr<int64_t>();
  std::vector<int64_t> listed;  // the plan's slots, in plan order
  for (int64_t s = 0; s < n_slots; ++s) {
    lp[s] = capacity > 0 ? std::min(count[s], capacity) : count[s];
    if (lp[s] > 0 || !bucketed) listed.push_back(s);
  }
  // Bucketed: the active slots sorted by load, so equal buckets are neighbours and each group is
  // one run of slot_rows. Exact: every slot in id order, so every size depends on the input's
  // shape only (torch.compile, CUDA graphs).
  if (bucketed) {
    std::stable_sort(listed.begin(), listed.end(), [&](int64_t a, int64_t b) { return lp[a] < lp[b]; });
  }
  const int64_t A = static_cast<int64_t>(listed.size());
  at::Tensor slot_order = at::empty({A}, lopt);
  at::Tensor slot_rows = at::empty({A}, lopt);
  std::vector<int64_t> start(n_slots, -1);
  int64_t E = 0;
  for (int64_t a = 0; a < A; ++a) {
    const int64_t s = listed[a];
    const int64_t rows = bucketed ? bucket(lp[s]) : lp[s];
    slot_order.data_ptr<int64_t>()[a] = s;
    slot_rows.data_ptr<int64_t>()[a] = rows;
    start[s] = E;
    E += rows;
  }
  if (!bucketed) E = R;  // dropped pairs' rows are padding at the end
  at::Tensor row_pair = at::full({E}, -1, lopt);
  at::Tensor dest = at::full({N, k}, -1, lopt);
  int64_t* rp = row_pair.data_ptr<int64_t>();
  int64_t* dp = dest.data_ptr<int64_t>();
  std::vector<int64_t> fill(n_slots, 0);
  for (int64_t i = 0; i < R; ++i) {
    const int64_t s = ip[i];
    if (s < 0 || s >= n_slots) continue;  // skipped (checked above)
    const int64_t r = fill[s]++;
    if (r < lp[s]) {
      dp[i] = start[s] + r;
      rp[start[s] + r] = i;
    }
  }
  return {load, slot_order, slot_rows, row_pair, dest};
}

}  // namespace

TORCH_LIBRARY_IMPL(minagi, CPU, m) { m.impl("group_plan", &group_plan_cpu); }

}  // namespace minagi
