// CUDA paged_attention: checks the call and routes its rows to the two kernels.
//
//   decode rows (q_len == 1)   paged_attention_decode.cu   CUDA cores, GQA-aware, split-K
//   prefill rows (q_len > 1)   paged_attention_prefill.cu  tiled flash attention, tensor cores;
//                                                          also merges the decode splits
//
// Which rows are which lives in cu_seqlens_q on the device; reading it on the host would sync
// and break CUDA-graph capture. So both kernels are launched over the whole batch and each
// skips the rows that are not its kind (a pure-decode batch costs the prefill kernel one launch
// of programs that exit at once). Shapes the tiled kernel does not cover (fp32, head sizes
// other than 64/128) run every row through the decode kernel, one row per program; so does a
// batch the caller declares pure decode (max_query_len == 1, e.g. a full decode CUDA graph),
// which then costs the decode kernel alone: its last split merges (no prefill launch).
//
// The caches may be any strided view with head_size contiguous: [num_blocks, block_size,
// num_kv_heads, head_size] contiguous, or head-major blocks permuted to that shape.
//
// Values are trusted, as in any kernel that must not sync: cu_seqlens_q non-decreasing from 0,
// q_len <= seq_len <= max_blocks * block_size, block ids inside the cache (the CPU kernel
// checks these; here a bad value reads the wrong rows).
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAGuard.h>

#include "cuda/cuda_ops.h"
#include "cuda/launchers.h"
#include "op_checks.h"

namespace compilelm::cuda {

at::Tensor paged_attention(
    const at::Tensor& query,
    const at::Tensor& key_cache,
    const at::Tensor& value_cache,
    const at::Tensor& cu_seqlens_q,
    const at::Tensor& seq_lens,
    const at::Tensor& block_tables,
    double scale,
    int64_t max_query_len) {
  TORCH_CHECK(query.is_cuda(), "query must be a CUDA tensor, got ", query.device());
  TORCH_CHECK(max_query_len >= 0, "max_query_len must be >= 0 (0 = unknown), got ", max_query_len);
  check_paged_attention_args(query, key_cache, value_cache, cu_seqlens_q, seq_lens, block_tables,
                             /*strided_cache=*/true);
  const int64_t elem = key_cache.element_size();
  TORCH_CHECK(key_cache.stride(0) * elem % 16 == 0 && key_cache.stride(1) * elem % 16 == 0 &&
                  key_cache.stride(2) * elem % 16 == 0 &&
                  reinterpret_cast<uintptr_t>(key_cache.const_data_ptr()) % 16 == 0 &&
                  reinterpret_cast<uintptr_t>(value_cache.const_data_ptr()) % 16 == 0,
              "cache rows must be 16-byte aligned (strides ", key_cache.strides(), ")");
  TORCH_CHECK(query.stride(0) * query.element_size() % 16 == 0 &&
                  reinterpret_cast<uintptr_t>(query.const_data_ptr()) % 16 == 0,
              "query rows must be 16-byte aligned (token stride ", query.stride(0), ")");
  const int64_t num_heads = query.size(1);
  const int64_t num_kv_heads = key_cache.size(2);
  const int64_t num_seqs = seq_lens.size(0);
  const auto dtype = query.scalar_type();
  TORCH_CHECK(query.size(2) == 64 || query.size(2) == 128 || query.size(2) == 256,
              "paged_attention on CUDA supports head_size 64, 128 and 256, got ", query.size(2));
  TORCH_CHECK(query.numel() < (int64_t{1} << 31) && key_cache.size(0) * key_cache.size(1) < (int64_t{1} << 31),
              "paged_attention on CUDA indexes tokens and cache slots with 32-bit ints");

  const c10::cuda::CUDAGuard device_guard(query.device());
  at::Tensor out = at::empty(query.sizes(), query.options());
  if (query.size(0) == 0) return out;
  if (num_seqs == 0) return out.zero_();  // every row is padding

  const auto cu = cu_seqlens_q.contiguous();
  const auto lens = seq_lens.contiguous();
  const auto tables = block_tables.contiguous();
  AttentionParams p{};
  p.query = query.const_data_ptr();
  p.key_cache = key_cache.const_data_ptr();
  p.value_cache = value_cache.const_data_ptr();
  p.out = out.mutable_data_ptr();
  p.cu_seqlens_q = cu.const_data_ptr<int32_t>();
  p.seq_lens = lens.const_data_ptr<int32_t>();
  p.block_tables = tables.const_data_ptr<int32_t>();
  p.q_stride = query.stride(0);
  p.block_stride = key_cache.stride(0);
  p.slot_stride = key_cache.stride(1);
  p.head_stride = key_cache.stride(2);
  p.num_seqs = static_cast<int>(num_seqs);
  p.num_tokens = static_cast<int>(query.size(0));
  p.num_heads = static_cast<int>(num_heads);
  p.num_kv_heads = static_cast<int>(num_kv_heads);
  p.group = static_cast<int>(num_heads / num_kv_heads);
  p.head_size = static_cast<int>(query.size(2));
  p.block_size = static_cast<int>(key_cache.size(1));
  p.max_blocks = static_cast<int>(tables.size(1));
  p.scale_log2 = static_cast<float>(scale) * kLog2e;

  const int64_t max_context = tables.size(1) * key_cache.size(1);
  at::Tensor workspace;  // split-K partials: alive until both kernels are enqueued
  if (max_query_len != 1 && prefill_supported(dtype, p.head_size, p.group)) {
    const SplitParams splits = launch_paged_attention_decode(p, query, /*all_rows=*/false, max_context, workspace);
    launch_paged_attention_prefill(p, splits, query);
  } else {
    launch_paged_attention_decode(p, query, /*all_rows=*/true, max_context, workspace);
  }
  return out;
}

}  // namespace compilelm::cuda
