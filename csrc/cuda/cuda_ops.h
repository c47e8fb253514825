// CUDA kernels of the ops declared in csrc/ops.cpp (shapes documented there). Each launches on
// the current stream, syncs nothing and allocates only through torch's caching allocator, so
// all of them can be captured in CUDA graphs.
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>
#include <tuple>

namespace compilelm::cuda {

void reshape_and_cache(
    const at::Tensor& key,
    const at::Tensor& value,
    at::Tensor& key_cache,
    at::Tensor& value_cache,
    const at::Tensor& slot_mapping);

at::Tensor paged_attention(
    const at::Tensor& query,
    const at::Tensor& key_cache,
    const at::Tensor& value_cache,
    const at::Tensor& cu_seqlens_q,
    const at::Tensor& seq_lens,
    const at::Tensor& block_tables,
    double scale,
    int64_t max_query_len);

// rope_and_cache.cpp
at::Tensor rope_and_cache(
    const at::Tensor& positions,
    const at::Tensor& query,
    const at::Tensor& key,
    const at::Tensor& value,
    const at::Tensor& cos_sin_cache,
    const std::optional<at::Tensor>& q_norm_weight,
    const std::optional<at::Tensor>& k_norm_weight,
    double eps,
    at::Tensor& key_cache,
    at::Tensor& value_cache,
    const at::Tensor& slot_mapping);

// fused_ops.cpp
std::tuple<at::Tensor, at::Tensor> quant_fp8_per_token(const at::Tensor& x);
at::Tensor quant_fp8_static(const at::Tensor& x, const at::Tensor& scale);
std::tuple<at::Tensor, at::Tensor> rms_norm_quant_fp8(const at::Tensor& x, const at::Tensor& weight, double eps,
                                                      const std::optional<at::Tensor>& scale);
std::tuple<at::Tensor, at::Tensor, at::Tensor> fused_add_rms_norm_quant_fp8(const at::Tensor& x,
                                                                            const at::Tensor& residual,
                                                                            const at::Tensor& weight, double eps,
                                                                            const std::optional<at::Tensor>& scale);
std::tuple<at::Tensor, at::Tensor> silu_mul_quant_fp8(const at::Tensor& x, const std::optional<at::Tensor>& scale);
std::tuple<at::Tensor, at::Tensor> fused_add_rms_norm(const at::Tensor& x, const at::Tensor& residual,
                                                      const at::Tensor& weight, double eps);
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);  // no op of its own: a helper
at::Tensor silu_and_mul(const at::Tensor& x);  // x: [M, 2K] rows (gate | up) -> [M, K]; a helper too

// skinny_mm.cu
at::Tensor skinny_mm(const at::Tensor& x, const at::Tensor& weight);
at::Tensor rms_norm_skinny_mm(const at::Tensor& x, const at::Tensor& norm_weight, double eps, const at::Tensor& weight);
std::tuple<at::Tensor, at::Tensor> fused_add_rms_norm_skinny_mm(const at::Tensor& x, const at::Tensor& residual,
                                                                const at::Tensor& norm_weight, double eps,
                                                                const at::Tensor& weight);
at::Tensor silu_mul_skinny_mm(const at::Tensor& x, const at::Tensor& weight);

// argmax_kernels.cu
at::Tensor argmax_rows(const at::Tensor& x);

// allreduce_kernels.cu
at::Tensor custom_all_reduce(const at::Tensor& x, at::IntArrayRef buffer_ptrs, int64_t rank, int64_t buffer_bytes);
std::tuple<at::Tensor, at::Tensor> custom_all_reduce_add_rms_norm(const at::Tensor& x, const at::Tensor& residual,
                                                                  const at::Tensor& weight, double eps,
                                                                  at::IntArrayRef buffer_ptrs, int64_t rank,
                                                                  int64_t buffer_bytes);

}  // namespace compilelm::cuda
