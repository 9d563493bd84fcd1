// The expert forms on the GPU: grouped_mm_act (the first grouped GEMM, then its bias and
// activation in one pass over its output) and expert_act_backward. The kernels are in
// activation_kernels.cuh. Outputs are _bucket-sized allocations, as the other kernels' are.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <vector>

#include "activation_kernels.cuh"
#include "launch.cuh"

namespace minagi {
namespace {

at::Tensor grouped_mm_call(const at::Tensor& a, const at::Tensor& b, const at::Tensor& ids, const at::Tensor& rows) {
  static auto op = c10::Dispatcher::singleton().findSchemaOrThrow("minagi::grouped_mm", "").typed<
      at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&)>();
  return op.call(a, b, ids, rows);
}

// The first row and the row count of every listed slot, on the device (slot_rows is on the host).
std::pair<at::Tensor, at::Tensor> ranges(const at::Tensor& slot_rows, const at::Device& device, int64_t E,
                                         const char* op) {
  const at::Tensor rows = slot_rows.to(at::kCPU).contiguous();
  const int64_t A = rows.size(0);
  std::vector<int64_t> row0(A);
  int64_t r = 0;
  for (int64_t i = 0; i < A; ++i) {
    row0[i] = r;
    r += rows.data_ptr<int64_t>()[i];
  }
  TORCH_CHECK(r <= E, "minagi.", op, ": slot_rows sums to ", r, " rows but h has only ", E);
  const auto lopt = at::TensorOptions().dtype(at::kLong);
  return {at::tensor(row0, lopt).to(device), rows.to(device)};
}

std::tuple<at::Tensor, at::Tensor> grouped_mm_act_cuda(const at::Tensor& a, const at::Tensor& b,
                                                       const c10::optional<at::Tensor>& bias_in,
                                                       const at::Tensor& slot_ids, const at::Tensor& slot_rows,
                                                       c10::string_view activation, double alpha, double limit) {
  const Act act = check_grouped_mm_act_args(a, b, bias_in, std::string(activation));
  gpu::check_cuda(a, "grouped_mm_act", "a");
  const c10::cuda::CUDAGuard guard(a.device());
  at::Tensor h = grouped_mm_call(a, b, slot_ids, slot_rows);
  const int64_t E = h.size(0), M = h.size(1), W = act_gated(act) ? M / 2 : M;
  at::Tensor out = gpu::bucketed_empty(E, {W}, a.options());
  if (E * W == 0) return {h, out};
  at::Tensor bias, row_slot;
  if (bias_in.has_value()) {
    const at::Tensor ids = slot_ids.to(a.device()), rows = slot_rows.to(a.device());
    const int64_t listed = slot_rows.to(at::kCPU).sum().item<int64_t>();  // slot_rows is on the host
    if (listed == E) {
      bias = bias_in->contiguous();
      row_slot = at::repeat_interleave(ids, rows, 0, E);
    } else {  // rows past the listed ranges (an exact plan's dropped pairs) take a zero row past the last slot
      bias = at::cat({*bias_in, at::zeros({1, M}, bias_in->options())});
      row_slot = at::full({E}, bias_in->size(0), ids.options());
      row_slot.narrow(0, 0, listed).copy_(at::repeat_interleave(ids, rows, 0, listed));
    }
  }
  MINAGI_DISPATCH_FLOATING(a.scalar_type(), "minagi_grouped_mm_act_cuda", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    gpu::bias_act_kernel<scalar_t><<<gpu::blocks_for(E * W), gpu::kThreads, 0, at::cuda::getCurrentCUDAStream()>>>(
        h.data_ptr<scalar_t>(), bias.defined() ? bias.data_ptr<scalar_t>() : nullptr,
        row_slot.defined() ? row_slot.data_ptr<int64_t>() : nullptr, out.data_ptr<scalar_t>(), E, M,
        static_cast<int>(act), static_cast<acc_t>(alpha), static_cast<acc_t>(limit));
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return {h, out};
}

std::tuple<at::Tensor, at::Tensor> expert_act_backward_cuda(const at::Tensor& grad_in, const at::Tensor& h_in,
                                                            const at::Tensor& slot_ids, const at::Tensor& slot_rows,
                                                            c10::string_view activation, double alpha, double limit,
                                                            int64_t n_slots, bool bias_grad) {
  const char* op = "expert_act_backward";
  const Act act = check_act_backward_args(grad_in, h_in, std::string(activation), n_slots);
  gpu::check_cuda(h_in, op, "h");
  const c10::cuda::CUDAGuard guard(h_in.device());
  const at::Tensor grad = grad_in.contiguous(), h = h_in.contiguous();
  const int64_t E = h.size(0), M = h.size(1), W = act_gated(act) ? M / 2 : M;
  at::Tensor gh = gpu::bucketed_empty(E, {M}, h.options());
  at::Tensor gb = bias_grad ? at::zeros({n_slots, M}, h.options()) : at::empty({0}, h.options());
  if (bias_grad && (slot_ids.device().is_cpu() || debug_checks())) {
    check_unique_slots_cpu(slot_ids.to(at::kCPU), n_slots, op);
  }
  const auto [row0, nrows] = ranges(slot_rows, h.device(), E, op);
  if (E * W == 0) return {gh, gb};
  MINAGI_DISPATCH_FLOATING(h.scalar_type(), "minagi_expert_act_backward_cuda", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const auto stream = at::cuda::getCurrentCUDAStream();
    gpu::act_backward_kernel<scalar_t><<<gpu::blocks_for(E * W), gpu::kThreads, 0, stream>>>(
        grad.data_ptr<scalar_t>(), h.data_ptr<scalar_t>(), gh.data_ptr<scalar_t>(), E, M, static_cast<int>(act),
        static_cast<acc_t>(alpha), static_cast<acc_t>(limit));
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    const int64_t A = slot_ids.size(0);
    if (bias_grad && A > 0) {
      const at::Tensor ids = slot_ids.to(h.device()).contiguous();
      const dim3 grid(static_cast<unsigned>((M + gpu::kThreads - 1) / gpu::kThreads), static_cast<unsigned>(A));
      gpu::bias_grad_kernel<scalar_t><<<grid, gpu::kThreads, 0, stream>>>(
          gh.data_ptr<scalar_t>(), ids.data_ptr<int64_t>(), row0.data_ptr<int64_t>(), nrows.data_ptr<int64_t>(), M,
          n_slots, gb.data_ptr<scalar_t>());
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
  });
  return {gh, gb};
}

}  // namespace

TORCH_LIBRARY_IMPL(minagi, CUDA, m) {
  m.impl("grouped_mm_act", &grouped_mm_act_cuda);
  m.impl("expert_act_backward", &expert_act_backward_cuda);
}

}  // namespace minagi
