// The expert forms on the GPU: grouped_mm_act (the first grouped GEMM, then its bias and
// activation in one pass over its output) and expert_act_backward. The kernels are in
// activation_kernels.cuh. Each row's slot comes from the ranges summed on the device
// (ranges.cuh): nothing is read on the host, nothing is copied to the device per call.
#include <ATen/ATen.h>
#include <torch/library.h>

#include "activation_kernels.cuh"
#include "launch.cuh"
#include "ranges.cuh"

namespace minagi {
namespace {

at::Tensor grouped_mm_call(const at::Tensor& a, const at::Tensor& b, const at::Tensor& ids, const at::Tensor& rows) {
  static auto op = c10::Dispatcher::singleton().findSchemaOrThrow("minagi::grouped_mm", "").typed<
      at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&)>();
  return op.call(a, b, ids, rows);
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
  at::Tensor bias;
  gpu::Ranges r;
  if (bias_in.has_value()) {
    bias = bias_in->contiguous();
    r = gpu::device_ranges(slot_ids, slot_rows, E, a.device(), "grouped_mm_act", false);
  }
  const int64_t A = bias.defined() ? r.ids.size(0) : 0;
  MINAGI_DISPATCH_FLOATING(a.scalar_type(), "minagi_grouped_mm_act_cuda", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    gpu::bias_act_kernel<scalar_t><<<gpu::blocks_for(E * W), gpu::kThreads, 0, at::cuda::getCurrentCUDAStream()>>>(
        h.data_ptr<scalar_t>(), bias.defined() ? bias.data_ptr<scalar_t>() : nullptr,
        bias.defined() ? r.ids.data_ptr<int64_t>() : nullptr, bias.defined() ? r.row_end.data_ptr<int64_t>() : nullptr,
        A, out.data_ptr<scalar_t>(), E, M, static_cast<int>(act), static_cast<acc_t>(alpha),
        static_cast<acc_t>(limit));
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return {h, out};
}

// grad_bias [n_slots, M]: each listed slot's column sums of grad_h, in row order (no atomics, so
// the bias's gradient has the same bits every run); zeros for slots not listed.
at::Tensor bias_grad_cuda(const at::Tensor& gh, const at::Tensor& slot_ids, const at::Tensor& slot_rows,
                          int64_t n_slots, const char* op) {
  const int64_t E = gh.size(0), M = gh.size(1);
  if (slot_ids.device().is_cpu() || debug_checks()) check_unique_slots_cpu(slot_ids.to(at::kCPU), n_slots, op);
  const gpu::Ranges r = gpu::device_ranges(slot_ids, slot_rows, E, gh.device(), op, false);
  at::Tensor gb = at::zeros({n_slots, M}, gh.options());
  const int64_t A = r.ids.size(0);
  if (A == 0 || M == 0) return gb;
  const dim3 grid(static_cast<unsigned>((M + gpu::kThreads - 1) / gpu::kThreads),
                  static_cast<unsigned>(std::min<int64_t>(A, gpu::kMaxBlocks)));
  MINAGI_DISPATCH_FLOATING(gh.scalar_type(), "minagi_bias_grad_cuda", [&] {
    gpu::bias_grad_kernel<scalar_t><<<grid, gpu::kThreads, 0, at::cuda::getCurrentCUDAStream()>>>(
        gh.data_ptr<scalar_t>(), r.ids.data_ptr<int64_t>(), r.row_end.data_ptr<int64_t>(), A, M, n_slots,
        gb.data_ptr<scalar_t>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return gb;
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
  if (E * W > 0) {
    MINAGI_DISPATCH_FLOATING(h.scalar_type(), "minagi_expert_act_backward_cuda", [&] {
      using acc_t = at::opmath_type<scalar_t>;
      gpu::act_backward_kernel<scalar_t><<<gpu::blocks_for(E * W), gpu::kThreads, 0,
                                           at::cuda::getCurrentCUDAStream()>>>(
          grad.data_ptr<scalar_t>(), h.data_ptr<scalar_t>(), gh.data_ptr<scalar_t>(), E, M, static_cast<int>(act),
          static_cast<acc_t>(alpha), static_cast<acc_t>(limit));
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  }
  if (!bias_grad) return {gh, at::empty({0}, h.options())};
  return {gh, bias_grad_cuda(gh, slot_ids, slot_rows, n_slots, op)};
}

}  // namespace

TORCH_LIBRARY_IMPL(minagi, CUDA, m) {
  m.impl("grouped_mm_act", &grouped_mm_act_cuda);
  m.impl("expert_act_backward", &expert_act_backward_cuda);
}

}  // namespace minagi
