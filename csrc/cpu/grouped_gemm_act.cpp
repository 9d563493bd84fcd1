// The grouped GEMM fused with the expert form's activation on the CPU: grouped_mm_act (h = a b +
// bias, then the activation of each part's rows while they are in cache) and gather_mm_act (the
// same with the rows gathered into a thread's tile, no [E, ...] buffers), and act_forward, the
// activation of a block of rows that decode.cpp shares. The row loops are act_rows.h's.
#include <torch/library.h>

#include <ATen/ATen.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <tuple>
#include <vector>

#include "../common.h"
#include "act_rows.h"
#include "scheduling.h"
#include "slot_gemm.h"

namespace minagi {

void act_forward(Act act, const at::Tensor& h, at::Tensor out, double alpha, double limit) {
  switch (act) {
    case Act::Gelu: at::gelu_out(out, h); return;
    case Act::GeluTanh: at::gelu_out(out, h, "tanh"); return;
    case Act::Silu: at::silu_out(out, h); return;
    case Act::Relu2:
      at::clamp_min_out(out, h, 0);
      out.mul_(out);
      return;
    case Act::SwigluOai:
      MINAGI_DISPATCH_FLOATING(h.scalar_type(), "minagi_oai_rows", [&] { oai_rows<scalar_t>(h, out, alpha, limit); });
      return;
    default: {  // swiglu, swiglu_interleaved
      if (swiglu_own_takes({&h, &out})) {
        MINAGI_DISPATCH_FLOATING(h.scalar_type(), "minagi_swiglu_rows",
                                 [&] { swiglu_rows<scalar_t>(act == Act::SwigluInterleaved, h, out); });
        return;
      }
      const auto [gate, up] = gate_up(act, h);
      at::silu_out(out, gate);
      out.mul_(up);
    }
  }
}

// [E, D]: for each row, the row of src [N, D] of its pair's character (zeros for padding).
at::Tensor gathered_rows(const at::Tensor& src, const at::Tensor& row_pair, int64_t k) {
  const int64_t E = row_pair.size(0), D = src.size(1);
  at::Tensor out = empty_output({E, D}, src.options());
  MINAGI_DISPATCH_FLOATING(src.scalar_type(), "minagi_gathered_rows", [&] {
    at::parallel_for(0, E, std::max<int64_t>(1, 16384 / std::max<int64_t>(D, 1)), [&](int64_t r0, int64_t r1) {
      gather_pair_rows(out.data_ptr<scalar_t>() + r0 * D, src.data_ptr<scalar_t>(),
                       row_pair.data_ptr<int64_t>() + r0, r1 - r0, k, D);
    });
  });
  return out;
}

namespace {

std::tuple<at::Tensor, at::Tensor> grouped_mm_act_cpu(const at::Tensor& a_in, const at::Tensor& b,
                                                      const c10::optional<at::Tensor>& bias_in,
                                                      const at::Tensor& slot_ids, const at::Tensor& slot_rows,
                                                      c10::string_view activation, double alpha, double limit) {
  const Act act = check_grouped_mm_act_args(a_in, b, bias_in, std::string(activation));
  const at::Tensor a = a_in.contiguous();
  const auto start = range_starts(slot_ids, slot_rows, a.size(0), b.size(0), "grouped_mm_act", false);
  const int64_t M = b.size(2);
  at::Tensor h = empty_output({a.size(0), M}, a.options());
  at::Tensor out = empty_output({a.size(0), act_gated(act) ? M / 2 : M}, a.options());
  const at::Tensor bias = bias_in.has_value() ? bias_in->contiguous() : at::Tensor();
  const bool own_swiglu = (act == Act::Swiglu || act == Act::SwigluInterleaved) && swiglu_own_takes({&h, &out});
  grouped_mm_into(a, b, bias, slot_ids, start, h, [&](int64_t r0, int64_t nr) {
    if (!own_swiglu) return act_forward(act, h.narrow(0, r0, nr), out.narrow(0, r0, nr), alpha, limit);
    MINAGI_DISPATCH_FLOATING(h.scalar_type(), "minagi_swiglu_rows", [&] {  // by pointer: no views a part
      swiglu_rows<scalar_t>(act == Act::SwigluInterleaved, h.data_ptr<scalar_t>() + r0 * M, M,
                            out.data_ptr<scalar_t>() + r0 * (M / 2), M / 2, nr, M / 2);
    });
  });
  zero_tail(h, start.back());
  zero_tail(out, start.back());
  return {h, out};
}

// The activation of grouped_mm_act(bucketed_gather(x, row_pair, dest), b, bias, ...) without its
// two [E, ...] buffers: each row's character's x (zeros for a padding row) is copied into the
// thread's tile, multiplied there, and only the activation is written out. The unfused forward
// writes the gathered rows and h to memory and reads both back; in inference neither is kept.
at::Tensor gather_mm_act_cpu(const at::Tensor& x_in, const at::Tensor& b, const c10::optional<at::Tensor>& bias_in,
                             const at::Tensor& slot_ids, const at::Tensor& slot_rows, const at::Tensor& row_pair_in,
                             const at::Tensor& dest, c10::string_view activation, double alpha, double limit) {
  const char* op = "gather_mm_act";
  const Act act = check_grouped_mm_act_args(x_in, b, bias_in, std::string(activation), op, "x");
  check_plan_maps(dest, row_pair_in, op);
  check_same_device(x_in, dest, op, "x", "dest");
  check_size(dest, 0, x_in.size(0), op, "dest", "x.shape[0]");
  const at::Tensor x = x_in.contiguous(), row_pair = row_pair_in.contiguous();
  const int64_t E = row_pair.size(0), D = x.size(1), M = b.size(2), k = dest.size(1);
  check_range_cpu(row_pair, -1, x.size(0) * k, op, "row_pair");
  const auto start = range_starts(slot_ids, slot_rows, E, b.size(0), op, false, "row_pair");
  const int64_t tile_bytes = g_gather_tile_bytes.load();
  if (busiest_range(start) * (D + M) * x.element_size() > tile_bytes) {
    // A slot too large for a tile (hundreds of rows of a wide layer): its rows gathered whole and
    // multiplied by one GEMM, as grouped_mm_act does.
    const at::Tensor buf = gathered_rows(x, row_pair, k);
    return std::get<1>(grouped_mm_act_cpu(buf, b, bias_in, slot_ids, slot_rows, activation, alpha, limit));
  }
  at::Tensor out = empty_output({E, act_gated(act) ? M / 2 : M}, x.options());
  const at::Tensor bias = bias_in.has_value() ? bias_in->contiguous() : at::Tensor();
  const auto parts = plan_parts(slot_ids.contiguous(), start, at::get_num_threads());
  MINAGI_DISPATCH_FLOATING(x.scalar_type(), "minagi_gather_mm_act", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    const int64_t* rp = row_pair.data_ptr<int64_t>();
    run_parts(parts, [&](const Part& p) {
      // One tile a part: the busiest range fits in one (above), so any part of a range does.
      const auto [lo, hi] = part_range(p.nr, p.part, p.parts, 8);
      const int64_t r0 = p.r0 + lo, nr = hi - lo;
      if (nr <= 0) return;
      std::vector<scalar_t> own;
      scalar_t* tile = thread_scratch<scalar_t>(nr * (D + M), own);
      scalar_t* h = tile + nr * D;
      gather_pair_rows(tile, xp, rp + r0, nr, k, D);
      slot_mm<scalar_t>(tile, b, p.slot, h, nr, bias.defined() ? bias.data_ptr<scalar_t>() + p.slot * M : nullptr);
      act_forward(act, at::from_blob(h, {nr, M}, x.options()), out.narrow(0, r0, nr), alpha, limit);
    });
  });
  zero_tail(out, start.back());
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(minagi, CPU, m) {
  m.impl("grouped_mm_act", &grouped_mm_act_cpu);
  m.impl("gather_mm_act", &gather_mm_act_cpu);
}

}  // namespace minagi
