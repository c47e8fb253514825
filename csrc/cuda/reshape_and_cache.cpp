// CUDA reshape_and_cache: checks the call and launches the copy kernel of cache_kernels.cu, in
// 16-byte units when sizes, strides and pointers allow it.
#include <c10/cuda/CUDAGuard.h>

#include "cuda/cuda_ops.h"
#include "cuda/launchers.h"

namespace compilelm::cuda {
namespace {

bool aligned_16(const at::Tensor& t) {
  return reinterpret_cast<uintptr_t>(t.const_data_ptr()) % 16 == 0 && t.stride(0) * t.element_size() % 16 == 0;
}

void check_source(const at::Tensor& src, const char* name, const at::Tensor& cache) {
  TORCH_CHECK(src.device() == cache.device(), name, " must be on ", cache.device(), ", got ", src.device());
  TORCH_CHECK(src.dim() == 3, name, " must be [num_tokens, num_kv_heads, head_size], got ", src.sizes());
  TORCH_CHECK(src.scalar_type() == cache.scalar_type(), name, " dtype ", src.scalar_type(),
              " must match the cache dtype ", cache.scalar_type());
  TORCH_CHECK(src.size(1) == cache.size(2) && src.size(2) == cache.size(3), name, " shape ",
              src.sizes(), " does not match cache shape ", cache.sizes());
  TORCH_CHECK(src.stride(2) == 1 && src.stride(1) == src.size(2),
              name, " must be contiguous within a token (strides ", src.strides(), ")");
}

void check_cache(const at::Tensor& cache, const char* name) {
  TORCH_CHECK(cache.is_cuda(), name, " must be a CUDA tensor, got ", cache.device());
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
                  key_cache.scalar_type() == value_cache.scalar_type() &&
                  key_cache.device() == value_cache.device(),
              "key_cache and value_cache must have the same shape, dtype and device, got ", key_cache.sizes(),
              " ", key_cache.scalar_type(), " vs ", value_cache.sizes(), " ", value_cache.scalar_type());
  check_source(key, "key", key_cache);
  check_source(value, "value", value_cache);
  TORCH_CHECK(key.size(0) == value.size(0), "key and value must have the same number of tokens, got ",
              key.size(0), " and ", value.size(0));
  TORCH_CHECK(slot_mapping.device() == key_cache.device(), "slot_mapping must be on ", key_cache.device(),
              ", got ", slot_mapping.device());
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong, "slot_mapping must be int64, got ",
              slot_mapping.scalar_type());
  TORCH_CHECK(slot_mapping.dim() == 1 && slot_mapping.size(0) == key.size(0),
              "slot_mapping must be [num_tokens] = [", key.size(0), "], got ", slot_mapping.sizes());
  if (key.size(0) == 0) return;

  const c10::cuda::CUDAGuard device_guard(key_cache.device());
  const auto slots = slot_mapping.contiguous();
  const int64_t row_bytes = key.size(1) * key.size(2) * key.element_size();
  const bool vectorized = row_bytes % 16 == 0 && aligned_16(key) && aligned_16(value) &&
                          reinterpret_cast<uintptr_t>(key_cache.const_data_ptr()) % 16 == 0 &&
                          reinterpret_cast<uintptr_t>(value_cache.const_data_ptr()) % 16 == 0;
  launch_reshape_and_cache(key, value, key_cache, value_cache, slots, vectorized);
}

}  // namespace compilelm::cuda
