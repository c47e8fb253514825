// CPU reshape_and_cache: scatter this step's keys/values into the paged KV cache.
//
// Layout:
//   key, value     [num_tokens, num_kv_heads, head_size]   token stride free, inner dims contiguous
//   key_cache      [num_blocks, block_size, num_kv_heads, head_size]   contiguous (value_cache alike)
//   slot_mapping   int64 [num_tokens]   token t -> cache row slot_mapping[t]; -1 leaves the cache alone
//
// One cache row (num_kv_heads * head_size elements) is contiguous in both source and cache,
// so the copy is a memcpy per token and works for every element type. A float8_e4m3fn cache
// (FP8 KV cache) stores fp8(clamp(x / scale, -448, 448)) per element instead (RNE, saturating).
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <c10/util/Float8_e4m3fn.h>

#include <algorithm>
#include <cstring>

#include "cpu/cpu_ops.h"
#include "op_checks.h"

namespace compilelm::cpu {
namespace {

template <typename scalar_t>
void quantize_row(const scalar_t* src, c10::Float8_e4m3fn* dst, int64_t n, float scale) {
  for (int64_t i = 0; i < n; ++i) {
    const float x = static_cast<float>(src[i]) / scale;
    dst[i] = c10::Float8_e4m3fn(std::clamp(x, -448.f, 448.f));  // std::clamp keeps a NaN a NaN
  }
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
  TORCH_CHECK(key_cache.device().is_cpu(), "key_cache must be a CPU tensor, got ", key_cache.device());
  check_reshape_and_cache_args(key, value, key_cache, value_cache, slot_mapping);
  check_kv_scale(k_scale, "k_scale");
  check_kv_scale(v_scale, "v_scale");

  const int64_t num_tokens = key.size(0);
  const int64_t num_slots = key_cache.size(0) * key_cache.size(1);
  const auto slots = slot_mapping.contiguous();
  const int64_t* slot = slots.const_data_ptr<int64_t>();
  for (int64_t t = 0; t < num_tokens; ++t) {
    TORCH_CHECK(slot[t] >= -1 && slot[t] < num_slots, "slot_mapping[", t, "] = ", slot[t],
                " is outside the cache (", num_slots, " slots; -1 skips a token)");
  }

  if (key_cache.scalar_type() == at::kFloat8_e4m3fn) {  // quantize each element
    const int64_t row = key.size(1) * key.size(2);
    auto* k_dst = static_cast<c10::Float8_e4m3fn*>(key_cache.mutable_data_ptr());
    auto* v_dst = static_cast<c10::Float8_e4m3fn*>(value_cache.mutable_data_ptr());
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, key.scalar_type(), "reshape_and_cache_fp8", [&] {
      const scalar_t* k_src = key.const_data_ptr<scalar_t>();
      const scalar_t* v_src = value.const_data_ptr<scalar_t>();
      at::parallel_for(0, num_tokens, std::max<int64_t>(1, 16384 / std::max<int64_t>(row, 1)),
                       [&](int64_t begin, int64_t end) {
        for (int64_t t = begin; t < end; ++t) {
          if (slot[t] < 0) continue;
          quantize_row(k_src + t * key.stride(0), k_dst + slot[t] * row, row, static_cast<float>(k_scale));
          quantize_row(v_src + t * value.stride(0), v_dst + slot[t] * row, row, static_cast<float>(v_scale));
        }
      });
    });
    return;
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
