// The grouped GEMM family's backward ops on the CPU: expert_act_backward (the activation's
// gradient, and the bias gradient per slot), grouped_mm_wgrad (the weight gradient, one slot's
// rows a GEMM), and scatter_mm_backward (the gradients of the GEMM and weighted scatter together:
// fused, a slot's output gradient in a thread's tile, or unfused, as whole-buffer passes).
#include <torch/library.h>

#include <ATen/ATen.h>
#include <ATen/ThreadLocalState.h>
#include <ATen/ops/mm_cpu_dispatch.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <tuple>
#include <vector>

#include "../common.h"
#include "act_rows.h"
#include "bf16_gemm.h"
#include "rows.h"
#include "scheduling.h"
#include "slot_gemm.h"

namespace minagi {
namespace {

// A weight gradient of at least this many bytes is written past the cache: it is read next by the
// optimizer, after the rest of the backward has passed through the cache.
constexpr size_t kStreamBytes = size_t{16} << 20;

// A matrix by pointer: `rows` rows of `cols` values, rows `ld` values apart, unit column stride.
// The per-slot loops pass these instead of narrowed tensors: a view is three dispatched ops (narrow,
// slice, as_strided) and a TensorImpl, and the weight gradients of 128 slots took ~600 of them a
// call.
struct RawMat {
  void* p;
  int64_t rows, cols, ld;
  template <typename T>
  T* data() const {
    return static_cast<T*>(p);
  }
  at::Tensor tensor(const at::TensorOptions& opts) const { return at::from_blob(p, {rows, cols}, {ld, 1}, opts); }
};

// out = x^T y, the sum over their rows (x [nr, M], y [nr, N], out [M, N]): a weight gradient's
// GEMM. bfloat16 takes bf16_dot_wgrad and float32 f32_gemm where they can, with `stream` writing
// past the cache (stream_rows in f32_gemm.h); else ATen's mm.
void wgrad_mm(at::ScalarType dtype, const RawMat& out, const RawMat& x, const RawMat& y, bool stream) {
  const int64_t nr = x.rows, M = x.cols, N = y.cols;
#ifdef MINAGI_BF16_DOT
  if (dtype == at::kBFloat16 && nr <= kBf16DotMaxInner && bf16_dot_wgrad_scratch(nr, N) * 2 <= kBf16DotMaxScratch &&
      bf16_dot_available()) {
    std::vector<uint16_t> own;
    uint16_t* scratch = thread_scratch<uint16_t, Scratch::kPack>(bf16_dot_wgrad_scratch(nr, N), own);
    bf16_dot_wgrad(x.data<const uint16_t>(), x.ld, y.data<const uint16_t>(), y.ld, out.data<uint16_t>(), out.ld, nr, M, N,
                   scratch, stream);
    return;
  }
#endif
#ifdef MINAGI_AVX512
  if (dtype == at::kFloat && nr <= kF32MaxInner && avx512_available()) {
    std::vector<float> own;
    float* scratch = thread_scratch<float, Scratch::kPack>(nr * f32_fma::kCols, own);
    // x^T's row m is x's column m: values x.ld apart
    f32_gemm(x.data<const float>(), 1, x.ld, y.data<const float>(), y.ld, 1, out.data<float>(), out.ld, M, nr, N, scratch,
             stream);
    return;
  }
#endif
  const auto opts = at::TensorOptions().dtype(dtype);
  at::Tensor o = out.tensor(opts);
  at::cpu::mm_out(o, x.tensor(opts).t(), y.tensor(opts));
}

// h's gradient from the activation's output gradient, for some rows (ATen's kernels as above).
void act_backward(Act act, const at::Tensor& grad, const at::Tensor& h, at::Tensor gh, double alpha, double limit) {
  switch (act) {
    case Act::Gelu: at::gelu_backward_out(gh, grad, h); return;
    case Act::GeluTanh: at::gelu_backward_out(gh, grad, h, "tanh"); return;
    case Act::Silu: at::silu_backward_out(gh, grad, h); return;
    case Act::Relu2:
      at::clamp_min_out(gh, h, 0);
      gh.mul_(grad).mul_(2);
      return;
    case Act::SwigluOai:
      MINAGI_DISPATCH_FLOATING(h.scalar_type(), "minagi_oai_backward_rows",
                               [&] { oai_backward_rows<scalar_t>(grad, h, gh, alpha, limit); });
      return;
    default: {  // d up = grad * silu(gate); d gate = grad * up * silu'(gate)
      if (swiglu_own_takes({&grad, &h, &gh})) {
        MINAGI_DISPATCH_FLOATING(h.scalar_type(), "minagi_swiglu_grad_rows",
                                 [&] { swiglu_grad_rows<scalar_t>(act == Act::SwigluInterleaved, grad, h, gh); });
        return;
      }
      const auto [gate, up] = gate_up(act, h);
      auto [d_gate, d_up] = gate_up(act, gh);
      at::silu_out(d_up, gate);
      d_up.mul_(grad);
      at::silu_backward_out(d_gate, grad, gate);
      d_gate.mul_(up);
    }
  }
}

std::tuple<at::Tensor, at::Tensor> expert_act_backward_cpu(const at::Tensor& grad_in, const at::Tensor& h_in,
                                                           const at::Tensor& slot_ids, const at::Tensor& slot_rows,
                                                           c10::string_view activation, double alpha, double limit,
                                                           int64_t n_slots, bool bias_grad) {
  const Act act = check_act_backward_args(grad_in, h_in, std::string(activation), n_slots);
  const at::Tensor grad = grad_in.contiguous(), h = h_in.contiguous();
  const auto start = range_starts(slot_ids, slot_rows, h.size(0), n_slots, "expert_act_backward", bias_grad);
  const int64_t E = h.size(0), M = h.size(1);
  at::Tensor gh = empty_output({E, M}, h.options());
  if (!bias_grad) {  // elementwise over every row: ATen shares it out over the threads
    act_backward(act, grad, h, gh, alpha, limit);
    zero_tail(gh, start.back());
    return {gh, at::empty({0}, h.options())};
  }
  // Each slot's rows on one thread: its bias gradient is a sum in a fixed order.
  at::Tensor gb = at::zeros({n_slots, M}, h.options());
  const at::Tensor ids = slot_ids.contiguous();
  const int64_t* ip = ids.data_ptr<int64_t>();
  const at::ThreadLocalState tls;
  at::parallel_for(0, ids.size(0), 1, [&](int64_t b, int64_t e) {
    at::ThreadLocalStateGuard guard(tls);
    for (int64_t i = b; i < e; ++i) {
      const int64_t r0 = start[i], nr = start[i + 1] - start[i];
      at::Tensor rows = gh.narrow(0, r0, nr);
      act_backward(act, grad.narrow(0, r0, nr), h.narrow(0, r0, nr), rows, alpha, limit);
      at::Tensor g = gb.select(0, ip[i]);
      at::sum_out(g, rows, {0});
    }
  });
  zero_tail(gh, start.back());
  return {gh, gb};
}

at::Tensor grouped_mm_wgrad_cpu(const at::Tensor& a_in, const at::Tensor& grad_in,
                                const at::Tensor& slot_ids, const at::Tensor& slot_rows,
                                int64_t n_slots) {
  const char* op = "grouped_mm_wgrad";
  check_wgrad_args(a_in, grad_in, n_slots);
  const at::Tensor a = a_in.contiguous(), grad = grad_in.contiguous();
  const auto start = range_starts(slot_ids, slot_rows, a.size(0), n_slots, op, true);
  const int64_t K = a.size(1), M = grad.size(1);
  // Only the slots that own no rows need zeros; the others are overwritten whole.
  at::Tensor out = empty_output({n_slots, K, M}, a.options());
  const bool stream = out.nbytes() >= kStreamBytes;
  const at::Tensor ids = slot_ids.contiguous();
  auto parts = plan_parts(ids, start, at::get_num_threads());
  // Slots with no rows get zeros, as parts of their own so the zeroing is shared out too.
  std::vector<char> owned(n_slots, 0);
  for (const Part& p : parts) owned[p.slot] = 1;
  for (int64_t s = 0; s < n_slots; ++s) {
    if (!owned[s]) parts.push_back({s, 0, 0, 0, 1});
  }
  char* op_ = static_cast<char*>(out.data_ptr());
  char* ap = static_cast<char*>(a.data_ptr());
  char* gp = static_cast<char*>(grad.data_ptr());
  const int64_t elem = a.element_size();
  run_parts(parts, [&](const Part& p) {
    const auto [lo, hi] = part_range(M, p.part, p.parts, 16);
    if (hi <= lo) return;
    const RawMat o{op_ + (p.slot * K * M + lo) * elem, K, hi - lo, M};
    if (p.nr == 0) {
      for (int64_t r = 0; r < K; ++r) std::memset(o.data<char>() + r * M * elem, 0, (hi - lo) * elem);
      return;
    }
    wgrad_mm(a.scalar_type(), o, {ap + p.r0 * K * elem, p.nr, K, K}, {gp + (p.r0 * M + lo) * elem, p.nr, hi - lo, M},
             stream);
  });
  return out;
}

// For each of nr rows holding a pair (row_pair >= 0; a padding row's gradient is zero already):
// the pair's gate gradient <g_r, a_r>, then g_r and (where tile is given) the row's tile row times
// the pair's gate. g_r is the row of grad_y b^T.
template <typename scalar_t>
void gate_rows(scalar_t* g, const scalar_t* a, scalar_t* tile, const int64_t* row_pair, const scalar_t* gates,
               scalar_t* grad_gates, int64_t nr, int64_t I, int64_t D) {
  using acc_t = at::opmath_type<scalar_t>;
  for (int64_t i = 0; i < nr; ++i) {
    const int64_t pair = row_pair[i];
    if (pair < 0) continue;
    grad_gates[pair] = static_cast<scalar_t>(dot_row(g + i * I, a + i * I, I));
    const acc_t w = static_cast<acc_t>(gates[pair]);
    scale_row(g + i * I, w, I);
    if (tile != nullptr) scale_row(tile + i * D, w, D);
  }
}

// The fused backward below keeps one slot's rows of the output gradient in a thread's tile: worth
// it while a tile stays in cache and no slot holds more than a thread's share of the rows (it
// gives each slot to one thread, where the unfused GEMMs split a sink slot across threads).
bool fuses_scatter_backward(const std::vector<int64_t>& start, int64_t row_bytes) {
  const int64_t busiest = busiest_range(start);
  return busiest > 0 && busiest * row_bytes <= g_fused_tile_bytes.load() &&
         busiest * at::get_num_threads() <= start.back();
}

// scatter_mm_backward as whole-buffer passes: each row's character's grad_y gathered into [E, D],
// grad_y b^T by grouped_mm (a sink slot split over threads), the gates' gradient and the gate
// scaling row by row, then the weight gradient by grouped_mm_wgrad.
std::tuple<at::Tensor, at::Tensor, at::Tensor> scatter_mm_backward_unfused(
    const at::Tensor& grad_y, const at::Tensor& a, const at::Tensor& b, const at::Tensor& gates,
    const at::Tensor& slot_ids, const at::Tensor& slot_rows, const at::Tensor& row_pair, at::Tensor& grad_g,
    int64_t b_grad) {
  const int64_t E = a.size(0), I = a.size(1), D = b.size(2);
  at::Tensor dy = gathered_rows(grad_y, row_pair, grad_g.size(1));
  at::Tensor grad_a = grouped_mm_cpu(dy, b.transpose(1, 2), slot_ids, slot_rows);
  MINAGI_DISPATCH_FLOATING(a.scalar_type(), "minagi_scatter_mm_backward_rows", [&] {
    at::parallel_for(0, E, std::max<int64_t>(1, 4096 / std::max<int64_t>(I + D, 1)), [&](int64_t r0, int64_t r1) {
      gate_rows<scalar_t>(grad_a.data_ptr<scalar_t>() + r0 * I, a.data_ptr<scalar_t>() + r0 * I,
                          b_grad ? dy.data_ptr<scalar_t>() + r0 * D : nullptr, row_pair.data_ptr<int64_t>() + r0,
                          gates.data_ptr<scalar_t>(), grad_g.data_ptr<scalar_t>(), r1 - r0, I, D);
    });
  });
  at::Tensor grad_b = at::empty({0}, a.options());
  if (b_grad == 1) grad_b = grouped_mm_wgrad_cpu(a, dy, slot_ids, slot_rows, b.size(0));
  if (b_grad == 2) grad_b = grouped_mm_wgrad_cpu(dy, a, slot_ids, slot_rows, b.size(0));
  return {grad_a, grad_b, grad_g};
}

// The gradients of y = weighted_scatter(grouped_mm(a, b), dest, row_pair, gates) with respect to a,
// b and the gates, one slot's rows at a time on one thread. A row's output gradient (its
// character's grad_y, times its gate) is the gathered operand of both of the slot's GEMMs; here it
// lives in the thread's tile (in cache) where the unfused backward writes an [E, D] buffer and
// reads it three times (for a's gradient, b's, and the gates'). The gates' gradient comes from the
// I-wide rows, <a_r, grad_y b^T>, which equals <grad_y, a_r b>: the D-wide outputs need not be kept
// from the forward. grad_b: b_grad 1 gives [S, I, D], 2 the same transposed ([S, D, I], contiguous:
// the layout of a weight stored [S, D, I] and passed as its .mT view), 0 none ([0]).
std::tuple<at::Tensor, at::Tensor, at::Tensor> scatter_mm_backward_cpu(
    const at::Tensor& grad_y_in, const at::Tensor& a_in, const at::Tensor& b, const at::Tensor& gates_in,
    const at::Tensor& slot_ids, const at::Tensor& slot_rows, const at::Tensor& row_pair_in, const at::Tensor& dest,
    int64_t b_grad) {
  const char* op = "scatter_mm_backward";
  check_scatter_mm_backward_args(grad_y_in, a_in, b, gates_in, row_pair_in, dest, b_grad);
  const at::Tensor grad_y = grad_y_in.contiguous(), a = a_in.contiguous(), gates = gates_in.contiguous();
  const at::Tensor row_pair = row_pair_in.contiguous();
  const int64_t E = a.size(0), I = a.size(1), S = b.size(0), D = b.size(2), N = dest.size(0), k = dest.size(1);
  check_range_cpu(row_pair, -1, N * k, op, "row_pair");
  const auto start = range_starts(slot_ids, slot_rows, E, S, op, true);
  at::Tensor grad_g = at::zeros({N, k}, a.options());  // dropped pairs own no row: their gradient is 0
  if (!fuses_scatter_backward(start, D * a.element_size())) {
    return scatter_mm_backward_unfused(grad_y, a, b, gates, slot_ids, slot_rows, row_pair, grad_g, b_grad);
  }
  at::Tensor grad_a = empty_output({E, I}, a.options());
  const std::vector<int64_t> b_shape = b_grad == 2 ? std::vector<int64_t>{S, D, I} : std::vector<int64_t>{S, I, D};
  at::Tensor grad_b = b_grad ? empty_output(b_shape, a.options()) : at::empty({0}, a.options());
  const bool stream = grad_b.nbytes() >= kStreamBytes;
  // One part per slot, never split (its weight gradient is one GEMM over all its rows); largest
  // first. Slots that own no rows get a zero gradient, as parts of their own.
  const at::Tensor ids = slot_ids.contiguous();
  const int64_t* ip = ids.data_ptr<int64_t>();
  std::vector<Part> parts;
  std::vector<char> owned(S, 0);
  for (int64_t i = 0; i + 1 < static_cast<int64_t>(start.size()); ++i) {
    owned[ip[i]] = 1;
    parts.push_back({ip[i], start[i], start[i + 1] - start[i], 0, 1});
  }
  for (int64_t s = 0; s < S && b_grad; ++s) {
    if (!owned[s]) parts.push_back({s, 0, 0, 0, 1});
  }
  std::stable_sort(parts.begin(), parts.end(), [](const Part& x, const Part& y) { return x.nr > y.nr; });
  const at::Tensor b_t = b.transpose(1, 2);  // [S, D, I]
  MINAGI_DISPATCH_FLOATING(a.scalar_type(), "minagi_scatter_mm_backward", [&] {
    const scalar_t* gy = grad_y.data_ptr<scalar_t>();
    const scalar_t* ap = a.data_ptr<scalar_t>();
    const scalar_t* gp = gates.data_ptr<scalar_t>();
    const int64_t* rp = row_pair.data_ptr<int64_t>();
    scalar_t* ga = grad_a.data_ptr<scalar_t>();
    scalar_t* gg = grad_g.data_ptr<scalar_t>();
    scalar_t* gb = b_grad ? grad_b.data_ptr<scalar_t>() : nullptr;
    run_parts(parts, [&](const Part& p) {
      if (p.nr == 0) {
        if (b_grad) std::fill(gb + p.slot * I * D, gb + (p.slot + 1) * I * D, scalar_t(0));
        return;
      }
      std::vector<scalar_t> own;
      scalar_t* tile = thread_scratch<scalar_t>(p.nr * D, own);
      gather_pair_rows(tile, gy, rp + p.r0, p.nr, k, D);  // each row's character's grad_y
      slot_mm<scalar_t>(tile, b_t, p.slot, ga + p.r0 * I, p.nr);  // grad_y b^T: [nr, I]
      gate_rows<scalar_t>(ga + p.r0 * I, ap + p.r0 * I, b_grad ? tile : nullptr, rp + p.r0, gp, gg, p.nr, I, D);
      if (b_grad == 0) return;
      const RawMat a_rows{const_cast<scalar_t*>(ap) + p.r0 * I, p.nr, I, I}, tile_m{tile, p.nr, D, D};
      if (b_grad == 1) {
        wgrad_mm(a.scalar_type(), {gb + p.slot * I * D, I, D, D}, a_rows, tile_m, stream);  // [I, nr] x [nr, D]
      } else {
        wgrad_mm(a.scalar_type(), {gb + p.slot * I * D, D, I, I}, tile_m, a_rows, stream);  // [D, nr] x [nr, I]
      }
    });
  });
  zero_tail(grad_a, start.back());
  return {grad_a, grad_b, grad_g};
}

}  // namespace

TORCH_LIBRARY_IMPL(minagi, CPU, m) {
  m.impl("grouped_mm_wgrad", &grouped_mm_wgrad_cpu);
  m.impl("expert_act_backward", &expert_act_backward_cpu);
  m.impl("scatter_mm_backward", &scatter_mm_backward_cpu);
}

}  // namespace minagi
