// Input checks of the ops in csrc/ops.cpp that every device shares: shapes, dtypes, devices.
// Each device file adds only its own limits (CUDA: alignment, head sizes; CPU: index values).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

namespace compilelm {

// key_cache / value_cache: [num_blocks, block_size, num_kv_heads, head_size], contiguous; or, where
// the kernels take strides (`strided`), any strides with head_size contiguous (e.g. a permuted
// view of a [num_blocks, num_kv_heads, block_size, head_size] buffer).
inline void check_kv_cache(const at::Tensor& cache, const char* name, const at::Device& device,
                           bool strided = false) {
  TORCH_CHECK(cache.device() == device, name, " must be on ", device, ", got ", cache.device());
  TORCH_CHECK(cache.dim() == 4, name, " must be [num_blocks, block_size, num_kv_heads, head_size], got ",
              cache.sizes());
  if (strided) {
    TORCH_CHECK(cache.stride(3) == 1, name, " must be contiguous in head_size (strides ", cache.strides(), ")");
  } else {
    TORCH_CHECK(cache.is_contiguous(), name, " must be contiguous");
  }
  const auto dtype = cache.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf || dtype == at::kFloat8_e4m3fn,
              name, " must be float32, bfloat16, float16 or float8_e4m3fn (an FP8 KV cache), got ", dtype);
}

// An FP8 KV cache's scale: finite and > 0 (the writers divide by it).
inline void check_kv_scale(double scale, const char* name) {
  TORCH_CHECK(scale > 0 && scale < 1e30, name, " must be finite and > 0, got ", scale);
}

// The cache holds the source's dtype, or float8_e4m3fn (quantized on write, dequantized on read).
inline bool cache_dtype_matches(at::ScalarType cache, at::ScalarType source) {
  return cache == source || cache == at::kFloat8_e4m3fn;
}

// An int32 metadata tensor (cu_seqlens_q, seq_lens, block_tables) on the query's device.
inline void check_index(const at::Tensor& t, const char* name, int64_t dim, const at::Device& device) {
  TORCH_CHECK(t.device() == device, name, " must be on ", device, ", got ", t.device());
  TORCH_CHECK(t.scalar_type() == at::kInt, name, " must be int32, got ", t.scalar_type());
  TORCH_CHECK(t.dim() == dim, name, " must have ", dim, " dims, got ", t.sizes());
}

// key, value: [num_tokens, num_kv_heads, head_size], contiguous within a token.
inline void check_cache_source(const at::Tensor& src, const char* name, const at::Tensor& cache) {
  TORCH_CHECK(src.device() == cache.device(), name, " must be on ", cache.device(), ", got ", src.device());
  TORCH_CHECK(src.dim() == 3, name, " must be [num_tokens, num_kv_heads, head_size], got ", src.sizes());
  TORCH_CHECK(cache_dtype_matches(cache.scalar_type(), src.scalar_type()) && src.scalar_type() != at::kFloat8_e4m3fn,
              name, " dtype ", src.scalar_type(), " must match the cache dtype ", cache.scalar_type(),
              " (or the cache be float8_e4m3fn)");
  TORCH_CHECK(src.size(1) == cache.size(2) && src.size(2) == cache.size(3), name, " shape ",
              src.sizes(), " does not match cache shape ", cache.sizes());
  TORCH_CHECK(src.stride(2) == 1 && src.stride(1) == src.size(2),
              name, " must be contiguous within a token (strides ", src.strides(), ")");
}

inline void check_reshape_and_cache_args(const at::Tensor& key, const at::Tensor& value,
                                         const at::Tensor& key_cache, const at::Tensor& value_cache,
                                         const at::Tensor& slot_mapping) {
  check_kv_cache(key_cache, "key_cache", key_cache.device());
  check_kv_cache(value_cache, "value_cache", key_cache.device());
  TORCH_CHECK(key_cache.sizes() == value_cache.sizes() && key_cache.scalar_type() == value_cache.scalar_type(),
              "key_cache and value_cache must have the same shape and dtype, got ", key_cache.sizes(),
              " ", key_cache.scalar_type(), " vs ", value_cache.sizes(), " ", value_cache.scalar_type());
  check_cache_source(key, "key", key_cache);
  check_cache_source(value, "value", value_cache);
  TORCH_CHECK(key.size(0) == value.size(0), "key and value must have the same number of tokens, got ",
              key.size(0), " and ", value.size(0));
  TORCH_CHECK(slot_mapping.device() == key_cache.device(), "slot_mapping must be on ", key_cache.device(),
              ", got ", slot_mapping.device());
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong, "slot_mapping must be int64, got ",
              slot_mapping.scalar_type());
  TORCH_CHECK(slot_mapping.dim() == 1 && slot_mapping.size(0) == key.size(0),
              "slot_mapping must be [num_tokens] = [", key.size(0), "], got ", slot_mapping.sizes());
}

inline void check_paged_attention_args(const at::Tensor& query, const at::Tensor& key_cache,
                                       const at::Tensor& value_cache, const at::Tensor& cu_seqlens_q,
                                       const at::Tensor& seq_lens, const at::Tensor& block_tables,
                                       bool strided_cache = false) {
  TORCH_CHECK(query.dim() == 3, "query must be [num_tokens, num_heads, head_size], got ", query.sizes());
  const auto dtype = query.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf,
              "query must be float32, bfloat16 or float16, got ", dtype);
  TORCH_CHECK(query.stride(2) == 1 && query.stride(1) == query.size(2),
              "query must be contiguous within a token (strides ", query.strides(), ")");
  for (const auto& [cache, name] : {std::pair{&key_cache, "key_cache"}, std::pair{&value_cache, "value_cache"}}) {
    check_kv_cache(*cache, name, query.device(), strided_cache);
    TORCH_CHECK(cache_dtype_matches(cache->scalar_type(), dtype), name, " dtype ", cache->scalar_type(),
                " must match the query dtype ", dtype, " (or be float8_e4m3fn)");
    TORCH_CHECK(cache->size(3) == query.size(2), name, " head_size ", cache->size(3),
                " must match the query head_size ", query.size(2));
  }
  TORCH_CHECK(key_cache.sizes() == value_cache.sizes() && key_cache.strides() == value_cache.strides() &&
                  key_cache.scalar_type() == value_cache.scalar_type(),
              "key_cache ", key_cache.sizes(), " and value_cache ", value_cache.sizes(),
              " must have the same shape, strides and dtype");
  const int64_t num_heads = query.size(1);
  const int64_t num_kv_heads = key_cache.size(2);
  TORCH_CHECK(num_kv_heads > 0 && num_heads % num_kv_heads == 0, "num_heads (", num_heads,
              ") must be a multiple of num_kv_heads (", num_kv_heads, ")");
  check_index(cu_seqlens_q, "cu_seqlens_q", 1, query.device());
  check_index(seq_lens, "seq_lens", 1, query.device());
  check_index(block_tables, "block_tables", 2, query.device());
  const int64_t num_seqs = seq_lens.size(0);
  TORCH_CHECK(cu_seqlens_q.size(0) == num_seqs + 1, "cu_seqlens_q must be [num_seqs + 1] = [",
              num_seqs + 1, "], got ", cu_seqlens_q.sizes());
  TORCH_CHECK(block_tables.size(0) == num_seqs, "block_tables must have num_seqs = ", num_seqs,
              " rows, got ", block_tables.sizes());
}

}  // namespace compilelm
