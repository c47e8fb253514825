// CUDA reshape_and_cache: checks the call and launches the copy kernel of cache_kernels.cu, in
// 16-byte units when sizes, strides and pointers allow it (fp8 caches: the quantizing kernel).
#include <c10/cuda/CUDAGuard.h>

#include "cuda/cuda_ops.h"
#include "op_checks.h"
#include "cuda/launchers.h"

namespace compilelm::cuda {
namespace {

bool aligned_16(const at::Tensor& t) {
  return reinterpret_cast<uintptr_t>(t.const_data_ptr()) % 16 == 0 && t.stride(0) * t.element_size() % 16 == 0;
}

}  // namespace

void reshape_and_cache(
    const at::Tensor& key,
    const at::Tensor& value,
    at::Tensor& key_cache,
    at::Tensor& value_cache,
    const at::Tensor& slot_mapping,
    double k_scale,
    double v_scale) {
  TORCH_CHECK(key_cache.is_cuda(), "key_cache must be a CUDA tensor, got ", key_cache.device());
  check_reshape_and_cache_args(key, value, key_cache, value_cache, slot_mapping);
  check_kv_scale(k_scale, "k_scale");
  check_kv_scale(v_scale, "v_scale");
  if (key.size(0) == 0) return;

  const c10::cuda::CUDAGuard device_guard(key_cache.device());
  const auto slots = slot_mapping.contiguous();
  const int64_t row_bytes = key.size(1) * key.size(2) * key.element_size();
  const bool vectorized = row_bytes % 16 == 0 && aligned_16(key) && aligned_16(value) &&
                          reinterpret_cast<uintptr_t>(key_cache.const_data_ptr()) % 16 == 0 &&
                          reinterpret_cast<uintptr_t>(value_cache.const_data_ptr()) % 16 == 0;
  launch_reshape_and_cache(key, value, key_cache, value_cache, slots, vectorized, static_cast<float>(k_scale),
                           static_cast<float>(v_scale));
}

}  // namespace compilelm::cuda
