// CUDA kernels of the ops declared in csrc/ops.cpp (shapes documented there). Each launches on
// the current stream, syncs nothing and allocates only through torch's caching allocator, so
// all of them can be captured in CUDA graphs.
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>
#include <tuple>

#include "cuda/launchers.h"

namespace compilelm::cuda {

void reshape_and_cache(
    const at::Tensor& key,
    const at::Tensor& value,
    at::Tensor& key_cache,
    at::Tensor& value_cache,
    const at::Tensor& slot_mapping,
    double k_scale,
    double v_scale);

at::Tensor paged_attention(
    const at::Tensor& query,
    const at::Tensor& key_cache,
    const at::Tensor& value_cache,
    const at::Tensor& cu_seqlens_q,
    const at::Tensor& seq_lens,
    const at::Tensor& block_tables,
    double scale,
    int64_t max_query_len,
    bool prefill_rows,
    double k_scale,
    double v_scale);

// rope_and_cache(...), then paged_attention(...) of the rotated query; in one kernel for a
// pure-decode batch (max_query_len == 1) where launch_rope_paged_attention_decode covers it.
at::Tensor rope_paged_attention(
    const at::Tensor& positions,
    const at::Tensor& query,
    const at::Tensor& key,
    const at::Tensor& value,
    const at::Tensor& cos_sin_cache,
    at::Tensor& key_cache,
    at::Tensor& value_cache,
    const at::Tensor& slot_mapping,
    const at::Tensor& cu_seqlens_q,
    const at::Tensor& seq_lens,
    const at::Tensor& block_tables,
    double scale,
    int64_t max_query_len,
    double k_scale,
    double v_scale);

// The checked arguments of one call as kernel parameters, with the contiguous tensors they point
// into (alive as long as the call): shared by the ops that launch the same kernels.
struct AttentionCall {  // paged_attention.cpp; params.out unset
  AttentionParams params;
  at::Tensor cu_seqlens_q, seq_lens, block_tables;
  int64_t max_context;  // block_tables.size(1) * block_size: bounds seq_lens, sizes the split-K
};
AttentionCall attention_call(const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
                             const at::Tensor& cu_seqlens_q, const at::Tensor& seq_lens,
                             const at::Tensor& block_tables, double scale, double k_scale = 1.0,
                             double v_scale = 1.0);
// paged_attention's launch half: writes out (shaped like the call's query, on its device); the
// rows of sequences with q_len > 1 only if prefill_rows.
void run_attention(AttentionCall& call, const at::Tensor& out, int64_t max_query_len, bool prefill_rows = true);

struct RopeCacheCall {  // rope_and_cache.cpp; params.q_out unset
  RopeCacheParams params;
  at::Tensor positions, slot_mapping, cos_sin_cache, q_norm_weight, k_norm_weight;
};
RopeCacheCall rope_cache_call(const at::Tensor& positions, const at::Tensor& query, const at::Tensor& key,
                              const at::Tensor& value, const at::Tensor& cos_sin_cache,
                              const std::optional<at::Tensor>& q_norm_weight,
                              const std::optional<at::Tensor>& k_norm_weight, double eps, at::Tensor& key_cache,
                              at::Tensor& value_cache, const at::Tensor& slot_mapping, double k_scale = 1.0,
                              double v_scale = 1.0);
// rope_and_cache's launch half: returns the rotated query (on query's device, its guard set).
at::Tensor run_rope_and_cache(RopeCacheCall& call, const at::Tensor& query);

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
    const at::Tensor& slot_mapping,
    double k_scale,
    double v_scale);

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
at::Tensor linear(const at::Tensor& x, const at::Tensor& weight);
void linear_out(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& out);
void linear_argmax_out(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& out,
                          const at::Tensor& argmax);
at::Tensor rms_norm_linear(const at::Tensor& x, const at::Tensor& norm_weight, double eps, const at::Tensor& weight);
std::tuple<at::Tensor, at::Tensor> fused_add_rms_norm_linear(const at::Tensor& x, const at::Tensor& residual,
                                                                const at::Tensor& norm_weight, double eps,
                                                                const at::Tensor& weight);
at::Tensor silu_mul_linear(const at::Tensor& x, const at::Tensor& weight);
at::Tensor gate_up_silu_mul(const at::Tensor& x, const at::Tensor& weight);
at::Tensor qkv_rope_cache(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& positions,
                          const at::Tensor& cos_sin_cache, at::Tensor& key_cache, at::Tensor& value_cache,
                          const at::Tensor& slot_mapping, int64_t num_heads);
at::Tensor rms_norm_qkv_rope_cache(const at::Tensor& x, const at::Tensor& norm_weight, double eps,
                                   const at::Tensor& weight, const at::Tensor& positions,
                                   const at::Tensor& cos_sin_cache, at::Tensor& key_cache, at::Tensor& value_cache,
                                   const at::Tensor& slot_mapping, int64_t num_heads);
std::tuple<at::Tensor, at::Tensor> fused_add_rms_norm_qkv_rope_cache(
    const at::Tensor& x, const at::Tensor& residual, const at::Tensor& norm_weight, double eps,
    const at::Tensor& weight, const at::Tensor& positions, const at::Tensor& cos_sin_cache, at::Tensor& key_cache,
    at::Tensor& value_cache, const at::Tensor& slot_mapping, int64_t num_heads);

// fp8_stream_mm.cu
at::Tensor fp8_stream_mm(const at::Tensor& x, const std::optional<at::Tensor>& x_scale, const at::Tensor& weight,
                         const at::Tensor& weight_scale, const std::optional<at::Tensor>& bias,
                         at::ScalarType out_dtype);

// argmax_kernels.cu
at::Tensor argmax_rows(const at::Tensor& x);
at::Tensor sample_rows(const at::Tensor& x, const at::Tensor& inv_temperature, const at::Tensor& keys,
                       const std::optional<at::Tensor>& floor);
void argmax_rows_into(const at::Tensor& x, const at::Tensor& out);  // out: int64 [rows]; a helper

// allreduce_kernels.cu
at::Tensor custom_all_reduce(const at::Tensor& x, at::IntArrayRef buffer_ptrs, int64_t rank, int64_t buffer_bytes);
std::tuple<at::Tensor, at::Tensor> custom_all_reduce_add_rms_norm(const at::Tensor& x, const at::Tensor& residual,
                                                                  const at::Tensor& weight, double eps,
                                                                  at::IntArrayRef buffer_ptrs, int64_t rank,
                                                                  int64_t buffer_bytes);

}  // namespace compilelm::cuda
