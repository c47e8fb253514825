// CPU kernels of the ops declared in csrc/ops.cpp (shapes documented there).
#pragma once

#include <ATen/core/Tensor.h>

namespace compilelm::cpu {

void reshape_and_cache(
    const at::Tensor& key,
    const at::Tensor& value,
    at::Tensor& key_cache,
    at::Tensor& value_cache,
    const at::Tensor& slot_mapping,
    double k_scale,   // float8_e4m3fn caches: key_cache = fp8(key / k_scale)
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
    bool prefill_rows,  // ignored: every row is written
    double k_scale,     // float8_e4m3fn caches: keys = key_cache * k_scale
    double v_scale);

}  // namespace compilelm::cpu
