// CPU reshape_and_cache: scatter this step's keys/values into the paged KV cache.
//
// Layout:
//   key, value     [num_tokens, num_kv_heads, head_size]   token stride free, inner dims contiguous
//   key_cache      [num_blocks, block_size, num_kv_heads, head_size]   contiguous (value_cache alike)
//   slot_mapping   int64 [num_tokens]   token t -> cache row slot_mapping[t]; -1 leaves the cache alone
//
// One cache row (num_kv_heads * head_size elements) is contiguous in both source and cache,
// so the copy is a memcpy per token and works for every element type.
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstring>

#include "cpu/cpu_ops.h"

namespace compilelm::cpu {

namespace {

void check_source(const at::Tensor& src, const char* name, const at::Tensor& cache) {
  TORCH_CHECK(src.device().is_cpu(), name, " must be a CPU tensor, got ", src.device());
  TORCH_CHECK(src.dim() == 3, name, " must be [num_tokens, num_kv_heads, head_size], got ", src.sizes());
  TORCH_CHECK(src.scalar_type() == cache.scalar_type(), name, " dtype ", src.scalar_type(),
              " must match the cache dtype ", cache.scalar_type());
  TORCH_CHECK(src.size(1) == cache.size(2) && src.size(2) == cache.size(3), name, " shape ",
              src.sizes(), " does not match cache shape ", cache.sizes());
  TORCH_CHECK(src.stride(2) == 1 && src.stride(1) == src.size(2),
              name, " must be contiguous within a token (strides ", src.strides(), ")");
}

void check_cache(const at::Tensor& cache, const char* name) {
  TORCH_CHECK(cache.device().is_cpu(), name, " must be a CPU tensor, got ", cache.device());
  TORCH_CHECK(cache.dim() == 4, name, " must be [num_blocks, block_size, num_kv_heads, head_size], got ",
              cache.sizes());
  TORCH_CHECK(cache.is_contiguous(), name, " must be contiguous");
  const auto dtype = cache.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf, name,
              " must be float32, bfloat16 or float16, got ", dtype);
}

}  // namespace

void reshape_and_cache(
    const at::Tensor& key,
    const at::Tensor& value,
    at::Tensor& key_cache,
    at::Tensor& value_cache,
    const at::Tensor& slot_mapping) {
  check_cache(key_cache, "key_cache");
  check_cache(value_cache, "value_cache");
  TORCH_CHECK(key_cache.sizes() == value_cache.sizes() &&
                  key_cache.scalar_type() == value_cache.scalar_type(),
              "key_cache and value_cache must have the same shape and dtype, got ", key_cache.sizes(),
              " ", key_cache.scalar_type(), " vs ", value_cache.sizes(), " ", value_cache.scalar_type());
  check_source(key, "key", key_cache);
  check_source(value, "value", value_cache);
  TORCH_CHECK(key.size(0) == value.size(0), "key and value must have the same number of tokens, got ",
              key.size(0), " and ", value.size(0));
  TORCH_CHECK(slot_mapping.device().is_cpu(), "slot_mapping must be a CPU tensor");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong, "slot_mapping must be int64, got ",
              slot_mapping.scalar_type());
  TORCH_CHECK(slot_mapping.dim() == 1 && slot_mapping.size(0) == key.size(0),
              "slot_mapping must be [num_tokens] = [", key.size(0), "], got ", slot_mapping.sizes());

  const int64_t num_tokens = key.size(0);
  const int64_t num_slots = key_cache.size(0) * key_cache.size(1);
  const auto slots = slot_mapping.contiguous();
  const int64_t* slot = slots.const_data_ptr<int64_t>();
  for (int64_t t = 0; t < num_tokens; ++t) {
    TORCH_CHECK(slot[t] >= -1 && slot[t] < num_slots, "slot_mapping[", t, "] = ", slot[t],
                " is outside the cache (", num_slots, " slots; -1 skips a token)");
  }

  // One cache row = num_kv_heads * head_size elements.
  const int64_t row_bytes = key.size(1) * key.size(2) * key.element_size();
  const char* k_src = static_cast<const char*>(key.const_data_ptr());
  const char* v_src = static_cast<const char*>(value.const_data_ptr());
  const int64_t k_stride = key.stride(0) * key.element_size();
  const int64_t v_stride = value.stride(0) * value.element_size();
  char* k_dst = static_cast<char*>(key_cache.mutable_data_ptr());
  char* v_dst = static_cast<char*>(value_cache.mutable_data_ptr());

  const int64_t grain = std::max<int64_t>(1, (64 * 1024) / std::max<int64_t>(row_bytes, 1));
  at::parallel_for(0, num_tokens, grain, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      if (slot[t] < 0) {
        continue;
      }
      std::memcpy(k_dst + slot[t] * row_bytes, k_src + t * k_stride, row_bytes);
      std::memcpy(v_dst + slot[t] * row_bytes, v_src + t * v_stride, row_bytes);
    }
  });
}

}  // namespace compilelm::cpu
