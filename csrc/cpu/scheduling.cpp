// The grouped GEMM family's scheduling (declared in scheduling.h): the fused kernels' tile sizes
// and the tile_bytes op that reads and sets them, the plan's row ranges checked and turned into
// first rows, and the split of the ranges into parts for the threads.
#include "scheduling.h"

#include <string>

#include "../common.h"

namespace minagi {

std::atomic<int64_t> g_gather_tile_bytes{int64_t{2} << 20};
std::atomic<int64_t> g_fused_tile_bytes{int64_t{1} << 20};

// Validates slot_ids / slot_rows against a [E, ...] and returns each range's first row.
std::vector<int64_t> range_starts(const at::Tensor& slot_ids, const at::Tensor& slot_rows,
                                  int64_t E, int64_t n_slots, const char* op, bool unique,
                                  const char* rows_of) {
  check_ranges_args(slot_ids, slot_rows, op);
  TORCH_CHECK(slot_ids.device().is_cpu() && slot_rows.device().is_cpu(), "minagi.", op,
              ": slot_ids and slot_rows must be on the CPU with the other inputs");
  const at::Tensor ids = slot_ids.contiguous(), rows = slot_rows.contiguous();
  const int64_t A = ids.size(0);
  const int64_t* ip = ids.data_ptr<int64_t>();
  const int64_t* rp = rows.data_ptr<int64_t>();
  std::vector<int64_t> start(A + 1, 0);
  std::vector<char> seen(unique ? n_slots : 0, 0);
  for (int64_t i = 0; i < A; ++i) {
    TORCH_CHECK(ip[i] >= 0 && ip[i] < n_slots, "minagi.", op, ": slot_ids holds ", ip[i],
                " at position ", i, ", outside [0, n_slots=", n_slots, ")");
    TORCH_CHECK(rp[i] >= 0, "minagi.", op, ": slot_rows holds ", rp[i], " at position ", i,
                "; row counts must be >= 0");
    if (unique) {
      TORCH_CHECK(!seen[ip[i]], "minagi.", op, ": slot_ids lists slot ", ip[i],
                  " twice; each slot may own one row range");
      seen[ip[i]] = 1;
    }
    start[i + 1] = start[i] + rp[i];
  }
  TORCH_CHECK(start[A] <= E, "minagi.", op, ": slot_rows sums to ", start[A],
              " rows but ", rows_of, " has only ", E, " rows");
  return start;
}

// Rows from r0 on own no slot (an exact plan's dropped pairs): their outputs are zeros.
void zero_tail(at::Tensor& t, int64_t r0) {
  if (r0 < t.size(0)) t.narrow(0, r0, t.size(0) - r0).zero_();
}

// The most rows any listed range holds.
int64_t busiest_range(const std::vector<int64_t>& start) {
  int64_t busiest = 0;
  for (size_t i = 0; i + 1 < start.size(); ++i) busiest = std::max(busiest, start[i + 1] - start[i]);
  return busiest;
}

std::vector<Part> plan_parts(const at::Tensor& slot_ids, const std::vector<int64_t>& start,
                             int64_t threads) {
  const int64_t* ip = slot_ids.data_ptr<int64_t>();
  const int64_t A = static_cast<int64_t>(start.size()) - 1;
  const int64_t E = start[A];
  std::vector<Part> parts;
  for (int64_t i = 0; i < A; ++i) {
    const int64_t nr = start[i + 1] - start[i];
    if (nr == 0) continue;
    const int64_t n = std::min<int64_t>(threads, std::max<int64_t>(1, (2 * nr * threads) / std::max<int64_t>(E, 1)));
    for (int64_t p = 0; p < n; ++p) parts.push_back({ip[i], start[i], nr, p, n});
  }
  std::stable_sort(parts.begin(), parts.end(),
                   [](const Part& a, const Part& b) { return a.nr / a.parts > b.nr / b.parts; });
  return parts;
}

// torch.ops.minagi.tile_bytes (csrc/ops.cpp): a fused kernel's tile size, "gather" or "fused";
// value >= 0 sets it. Returns the size before.
int64_t tile_bytes(c10::string_view name, int64_t value) {
  std::atomic<int64_t>* size = name == "gather" ? &g_gather_tile_bytes : name == "fused" ? &g_fused_tile_bytes : nullptr;
  TORCH_CHECK_VALUE(size != nullptr, "minagi.tile_bytes: name must be 'gather' or 'fused', got '", std::string(name),
                    "'");
  return value >= 0 ? size->exchange(value) : size->load();
}

}  // namespace minagi
