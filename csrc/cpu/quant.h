// The quantized grouped GEMM's pieces that other CPU ops share (quant.cpp): qdecode_experts
// (decode.cpp) runs both of an expert's layers through it.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <vector>

namespace minagi {

// Refuses q and scale as the weights of a product with K inputs (minagi/moe/quant.py's storage),
// naming the op and its arguments; a: the rows (for their device).
void check_quantized_weight(const at::Tensor& a, int64_t K, const at::Tensor& q, const at::Tensor& scale, int64_t bits,
                            int64_t group_size, const char* op, const char* a_name, const char* q_name,
                            const char* scale_name);

// out's rows [start[i], start[i + 1]) = a's same rows times slot slot_ids[i]'s weights (q and scale
// as qgrouped_mm takes them, checked by the caller); a and out contiguous, out [a.size(0), out]
// in a's dtype. Rows past start.back() are left as they are.
void qgrouped_mm_into(const at::Tensor& a, const at::Tensor& q, const at::Tensor& scale, int64_t bits,
                      int64_t group_size, const int64_t* slot_ids, const std::vector<int64_t>& start, at::Tensor& out);

}  // namespace minagi
