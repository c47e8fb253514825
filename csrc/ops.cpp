// The compilelm op contract: every custom op is declared here, once (docs/interfaces.md).
// Device kernels register against these schemas in their own TORCH_LIBRARY_IMPL blocks:
// csrc/cpu/cpu_ops.cpp (CPU) and, later, csrc/cuda/*.cu (CUDA). Fake (meta) impls and
// plain-torch references live in compilelm/ops/.
//
// Layout shared by both ops:
//   key_cache, value_cache: [num_blocks, block_size, num_kv_heads, head_size], block 0 = null block
//   slot s of the cache = (block s / block_size, offset s % block_size)
#include <torch/library.h>

TORCH_LIBRARY(compilelm, m) {
  // key, value: [num_tokens, num_kv_heads, head_size]; slot_mapping: int64 [num_tokens], -1 skips.
  m.def(
      "reshape_and_cache(Tensor key, Tensor value, Tensor(a!) key_cache, Tensor(b!) value_cache, "
      "Tensor slot_mapping) -> ()");
  // query: [num_tokens, num_heads, head_size]; cu_seqlens_q: int32 [num_seqs + 1];
  // seq_lens: int32 [num_seqs]; block_tables: int32 [num_seqs, max_blocks_per_seq].
  // Returns [num_tokens, num_heads, head_size]; causal over each sequence's cached context.
  m.def(
      "paged_attention(Tensor query, Tensor key_cache, Tensor value_cache, Tensor cu_seqlens_q, "
      "Tensor seq_lens, Tensor block_tables, float scale) -> Tensor");
}
