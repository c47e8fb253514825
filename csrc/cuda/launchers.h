// Host-side entry points of the CUDA kernels (.cu files), called by the op implementations
// (.cpp files): the .cpp side validates the inputs and formats the error messages, so a .cu
// file holds only kernels and the launch logic (grid, split count, workspace).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>

namespace compilelm::cuda {

// One paged_attention call. Layouts as in csrc/ops.cpp; all index tensors contiguous int32.
struct AttentionParams {
  const void* query;            // [num_tokens, num_heads, head_size], token stride q_stride
  const void* key_cache;        // [num_blocks, block_size, num_kv_heads, head_size]
  const void* value_cache;      // [num_blocks, block_size, num_kv_heads, head_size]
  void* out;                    // [num_tokens, num_heads, head_size], contiguous
  const int32_t* cu_seqlens_q;  // [num_seqs + 1]
  const int32_t* seq_lens;      // [num_seqs]
  const int32_t* block_tables;  // [num_seqs, max_blocks]
  int64_t q_stride;
  int num_seqs, num_tokens, num_heads, num_kv_heads, group, head_size, block_size, max_blocks;
  float scale_log2;  // softmax scale * log2(e): scores are exponentiated with exp2
};

// Split-K of the decode kernel: its programs' partial outputs, still to be merged.
struct SplitParams {
  bool all_rows;       // decode program rows are query rows (all rows) or sequences (q_len == 1 rows)
  int num_splits;      // 1: the decode kernel wrote the output itself
  float* partial_out;  // [rows, num_heads, num_splits, head_size]
  float* partial_lse;  // [rows, num_heads, num_splits], log2 of each split's softmax denominator
};

// Launchers (host side, on the current stream; `query` gives dtype and device).
//
// The decode launcher serves the q_len == 1 rows of every sequence, or, with all_rows, every
// query row (the fallback for shapes the tiled kernel does not cover; then it also zeroes
// padding rows and merges its own splits). max_context bounds seq_lens (block_tables.size(1) *
// block_size) and sizes the split-K; the workspace it allocates is returned in `workspace`.
// The prefill launcher serves the q_len > 1 rows, zeroes the padding rows and merges the decode
// rows' splits (one launch fewer than a merge kernel of its own).
SplitParams launch_paged_attention_decode(const AttentionParams& p, const at::Tensor& query, bool all_rows,
                                          int64_t max_context, at::Tensor& workspace);
bool prefill_supported(at::ScalarType dtype, int head_size, int group);
void launch_paged_attention_prefill(const AttentionParams& p, const SplitParams& splits, const at::Tensor& query);

// Copies key/value rows to their cache slots (see reshape_and_cache.cpp), in 16-byte units
// when vectorized, else in elements.
void launch_reshape_and_cache(const at::Tensor& key, const at::Tensor& value, at::Tensor& key_cache,
                              at::Tensor& value_cache, const at::Tensor& slot_mapping, bool vectorized);

constexpr float kLog2e = 1.4426950408889634f;

}  // namespace compilelm::cuda
