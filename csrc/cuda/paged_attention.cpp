// CUDA paged_attention: checks the call and routes its rows to the two kernels.
//
//   decode rows (q_len == 1)   paged_attention_decode.cu   CUDA cores, GQA-aware, split-K
//   prefill rows (q_len > 1)   paged_attention_prefill.cu  tiled flash attention, tensor cores;
//                                                          also merges the decode splits
//                                                          (prefill_rows=False: only that; the
//                                                          caller attends the prefill rows)
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
// FP8 KV caches (float8_e4m3fn beside a bf16/fp16/fp32 query): the decode kernel on CUDA cores
// reads them (16 codes a 16-byte load, k_scale folded into the softmax scale, v_scale applied to
// the output); the tiled prefill kernel and the decode tensor-core kernel take model-dtype caches
// only, so with prefill_rows every row goes through the decode kernel (one row per program), and
// with prefill_rows=False (compilelm/ops/prefill_attention.py attends the prefill rows) the
// prefill kernel only merges and zeroes. rope_paged_attention runs its two ops.
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

AttentionCall attention_call(const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
                             const at::Tensor& cu_seqlens_q, const at::Tensor& seq_lens,
                             const at::Tensor& block_tables, double scale, double k_scale, double v_scale) {
  TORCH_CHECK(query.is_cuda(), "query must be a CUDA tensor, got ", query.device());
  check_paged_attention_args(query, key_cache, value_cache, cu_seqlens_q, seq_lens, block_tables,
                             /*strided_cache=*/true);
  const bool fp8 = key_cache.scalar_type() == at::kFloat8_e4m3fn;
  if (fp8) {
    check_kv_scale(k_scale, "k_scale");
    check_kv_scale(v_scale, "v_scale");
  }
  const int64_t elem = key_cache.element_size();
  TORCH_CHECK(key_cache.stride(0) * elem % 16 == 0 && key_cache.stride(1) * elem % 16 == 0 &&
                  key_cache.stride(2) * elem % 16 == 0 &&
                  reinterpret_cast<uintptr_t>(key_cache.const_data_ptr()) % 16 == 0 &&
                  reinterpret_cast<uintptr_t>(value_cache.const_data_ptr()) % 16 == 0,
              "cache rows must be 16-byte aligned (strides ", key_cache.strides(), ")");
  TORCH_CHECK(query.stride(0) * query.element_size() % 16 == 0 &&
                  reinterpret_cast<uintptr_t>(query.const_data_ptr()) % 16 == 0,
              "query rows must be 16-byte aligned (token stride ", query.stride(0), ")");
  TORCH_CHECK(query.size(2) == 64 || query.size(2) == 128 || query.size(2) == 256,
              "paged_attention on CUDA supports head_size 64, 128 and 256, got ", query.size(2));
  TORCH_CHECK(query.numel() < (int64_t{1} << 31) && key_cache.size(0) * key_cache.size(1) < (int64_t{1} << 31),
              "paged_attention on CUDA indexes tokens and cache slots with 32-bit ints");

  AttentionCall call;
  call.cu_seqlens_q = cu_seqlens_q.contiguous();
  call.seq_lens = seq_lens.contiguous();
  call.block_tables = block_tables.contiguous();
  call.max_context = call.block_tables.size(1) * key_cache.size(1);
  AttentionParams& p = call.params;
  p = AttentionParams{};
  p.query = query.const_data_ptr();
  p.key_cache = key_cache.const_data_ptr();
  p.value_cache = value_cache.const_data_ptr();
  p.cu_seqlens_q = call.cu_seqlens_q.const_data_ptr<int32_t>();
  p.seq_lens = call.seq_lens.const_data_ptr<int32_t>();
  p.block_tables = call.block_tables.const_data_ptr<int32_t>();
  p.q_stride = query.stride(0);
  p.block_stride = key_cache.stride(0);
  p.slot_stride = key_cache.stride(1);
  p.head_stride = key_cache.stride(2);
  p.num_seqs = static_cast<int>(seq_lens.size(0));
  p.num_tokens = static_cast<int>(query.size(0));
  p.num_heads = static_cast<int>(query.size(1));
  p.num_kv_heads = static_cast<int>(key_cache.size(2));
  p.group = p.num_heads / p.num_kv_heads;
  p.head_size = static_cast<int>(query.size(2));
  p.block_size = static_cast<int>(key_cache.size(1));
  p.max_blocks = static_cast<int>(call.block_tables.size(1));
  p.scale_log2 = static_cast<float>(fp8 ? scale * k_scale : scale) * kLog2e;
  p.fp8_cache = fp8;
  p.v_scale = fp8 ? static_cast<float>(v_scale) : 1.f;
  return call;
}

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
    double v_scale) {
  TORCH_CHECK(max_query_len >= 0, "max_query_len must be >= 0 (0 = unknown), got ", max_query_len);
  AttentionCall call = attention_call(query, key_cache, value_cache, cu_seqlens_q, seq_lens, block_tables, scale,
                                      k_scale, v_scale);
  TORCH_CHECK(prefill_rows || prefill_supported(query.scalar_type(), call.params.head_size, call.params.group),
              "paged_attention(prefill_rows=False) needs the tiled prefill kernel's shapes (bf16/fp16, head_size 64 "
              "or 128), got ", query.scalar_type(), ", head_size ", query.size(2));
  const c10::cuda::CUDAGuard device_guard(query.device());
  at::Tensor out = at::empty(query.sizes(), query.options());
  run_attention(call, out, max_query_len, prefill_rows);
  return out;
}

void run_attention(AttentionCall& call, const at::Tensor& out, int64_t max_query_len, bool prefill_rows) {
  AttentionParams& p = call.params;
  if (p.num_tokens == 0) return;
  if (p.num_seqs == 0) {  // every row is padding
    out.zero_();
    return;
  }
  p.out = out.mutable_data_ptr();

  at::Tensor workspace;  // split-K partials: alive until both kernels are enqueued
  // (out: the query's dtype); fp8 caches: the tiled prefill kernel only where it attends no rows
  if (max_query_len != 1 && prefill_supported(out.scalar_type(), p.head_size, p.group) &&
      (!p.fp8_cache || !prefill_rows)) {
    const SplitParams splits = launch_paged_attention_decode(p, out, /*all_rows=*/false, call.max_context, workspace);
    launch_paged_attention_prefill(p, splits, out, prefill_rows);
  } else {
    launch_paged_attention_decode(p, out, /*all_rows=*/true, call.max_context, workspace);
  }
}

// A pure-decode batch in one kernel where the decode kernel covers it (launchers.h) and the model
// is not small, else the two ops: in a small model rope_and_cache lets attention start one
// kernel earlier (kSmallModelQueryWidth), which hides attention's loads before its PDL wait
// better than one kernel fewer would (docs/perf.md, "fuse_rope_attention"). The fused kernel
// writes the cache rows of the batch's sequences only: rows past the last sequence (padding) must
// have slot -1, as the engine's do; rope_and_cache would write any slot it is given.
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
    double v_scale) {
  TORCH_CHECK(max_query_len >= 0, "max_query_len must be >= 0 (0 = unknown), got ", max_query_len);
  // every argument of both ops checked once: rope's here, attention's below (on the raw query
  // where it qualifies for the kernel: the rotated one has its shape, dtype and device)
  RopeCacheCall rope = rope_cache_call(positions, query, key, value, cos_sin_cache, std::nullopt, std::nullopt, 0.0,
                                       key_cache, value_cache, slot_mapping, k_scale, v_scale);
  const c10::cuda::CUDAGuard device_guard(query.device());
  const auto aligned = [](const at::Tensor& t) {  // 16-byte rows: the kernel's vector loads
    return t.stride(0) * t.element_size() % 16 == 0 && reinterpret_cast<uintptr_t>(t.const_data_ptr()) % 16 == 0;
  };
  if (max_query_len == 1 && query.size(0) > 0 && seq_lens.size(0) > 0 && !rope.params.fp8_cache &&
      query.size(1) * query.size(2) > kSmallModelQueryWidth && aligned(query) && aligned(key) && aligned(value) &&
      aligned(rope.cos_sin_cache)) {
    AttentionCall call = attention_call(query, key_cache, value_cache, cu_seqlens_q, seq_lens, block_tables, scale);
    at::Tensor out = at::empty(query.sizes(), query.options());
    call.params.out = out.mutable_data_ptr();
    if (launch_rope_paged_attention_decode(call.params, rope.params, query.scalar_type(), call.max_context)) {
      return out;
    }
    const at::Tensor rotated = run_rope_and_cache(rope, query);  // declined (too many programs): the two ops
    call.params.query = rotated.const_data_ptr();
    call.params.q_stride = rotated.stride(0);
    run_attention(call, out, max_query_len);
    return out;
  }
  const at::Tensor rotated = run_rope_and_cache(rope, query);
  return paged_attention(rotated, key_cache, value_cache, cu_seqlens_q, seq_lens, block_tables, scale, max_query_len,
                         /*prefill_rows=*/true, k_scale, v_scale);
}

}  // namespace compilelm::cuda
