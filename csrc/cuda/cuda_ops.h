// CUDA kernels of the ops declared in csrc/ops.cpp (shapes documented there). Each launches on
// the current stream, syncs nothing and allocates only through torch's caching allocator, so
// both can be captured in CUDA graphs.
#pragma once

#include <ATen/core/Tensor.h>

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
    double scale);

}  // namespace compilelm::cuda
