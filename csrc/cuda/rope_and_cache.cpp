// CUDA rope_and_cache: checks the call and launches the kernel of rope_cache_kernels.cu, which
// rotates query and key (after the optional QK-norm) and writes key and value to their cache
// slots in one pass. Positions and slots are read on the device only (no sync): positions are
// trusted to index cos_sin_cache, slots outside the cache are skipped (as reshape_and_cache).
// An fp8 cache gets fp8(k / k_scale) of the rotated key (rounded to the model dtype first, as the
// reference's rotated tensor) and fp8(v / v_scale).
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAGuard.h>

#include "cuda/cuda_ops.h"
#include "cuda/launchers.h"
#include "op_checks.h"

namespace compilelm::cuda {

RopeCacheCall rope_cache_call(
    const at::Tensor& positions,
    const at::Tensor& query,
    const at::Tensor& key,
    const at::Tensor& value,
    const at::Tensor& cos_sin_cache,
    const std::optional<at::Tensor>& q_norm_weight,
    const std::optional<at::Tensor>& k_norm_weight,
    double eps,
    at::Tensor& key_cache,
    at::Tensor& value_cache,
    const at::Tensor& slot_mapping,
    double k_scale,
    double v_scale) {
  TORCH_CHECK(key_cache.is_cuda(), "key_cache must be a CUDA tensor, got ", key_cache.device());
  check_reshape_and_cache_args(key, value, key_cache, value_cache, slot_mapping);
  check_kv_scale(k_scale, "k_scale");
  check_kv_scale(v_scale, "v_scale");
  const int64_t num_tokens = key.size(0);
  const int64_t head_size = key.size(2);
  TORCH_CHECK(head_size == 64 || head_size == 128 || head_size == 256,
              "rope_and_cache on CUDA supports head_size 64, 128 and 256, got ", head_size);
  TORCH_CHECK(query.device() == key.device() && query.dim() == 3 && query.size(0) == num_tokens &&
                  query.size(2) == head_size && query.scalar_type() == key.scalar_type(),
              "query must be [num_tokens, num_heads, head_size] = [", num_tokens, ", *, ", head_size, "] ",
              key.scalar_type(), " on ", key.device(), ", got ", query.sizes(), " ", query.scalar_type(), " on ",
              query.device());
  TORCH_CHECK(query.stride(2) == 1 && query.stride(1) == head_size,
              "query must be contiguous within a token (strides ", query.strides(), ")");
  TORCH_CHECK(positions.device() == key.device() && positions.scalar_type() == at::kLong && positions.dim() == 1 &&
                  positions.size(0) == num_tokens,
              "positions must be int64 [num_tokens] = [", num_tokens, "] on ", key.device(), ", got ",
              positions.scalar_type(), " ", positions.sizes(), " on ", positions.device());
  const bool cos_sin_fp32 = cos_sin_cache.scalar_type() == at::kFloat;
  TORCH_CHECK(cos_sin_cache.device() == key.device() && cos_sin_cache.dim() == 2 &&
                  cos_sin_cache.size(1) == head_size && (cos_sin_fp32 || cos_sin_cache.scalar_type() == key.scalar_type()),
              "cos_sin_cache must be [max_position, ", head_size, "], float32 or ", key.scalar_type(), ", on ",
              key.device(), ", got ", cos_sin_cache.sizes(), " ", cos_sin_cache.scalar_type(), " on ",
              cos_sin_cache.device());
  TORCH_CHECK(q_norm_weight.has_value() == k_norm_weight.has_value(),
              "q_norm_weight and k_norm_weight must be given together (QK-norm) or not at all");
  RopeCacheCall call;
  if (q_norm_weight.has_value()) {
    for (const auto& [w, name] : {std::pair{&*q_norm_weight, "q_norm_weight"}, std::pair{&*k_norm_weight, "k_norm_weight"}}) {
      TORCH_CHECK(w->device() == key.device() && w->dim() == 1 && w->size(0) == head_size &&
                      w->scalar_type() == key.scalar_type(),
                  name, " must be [", head_size, "] ", key.scalar_type(), " on ", key.device(), ", got ", w->sizes(),
                  " ", w->scalar_type(), " on ", w->device());
    }
    call.q_norm_weight = q_norm_weight->contiguous();
    call.k_norm_weight = k_norm_weight->contiguous();
  }
  TORCH_CHECK(num_tokens < (int64_t{1} << 31) && query.size(1) + 2 * key.size(1) < (int64_t{1} << 18),
              "rope_and_cache on CUDA: too many tokens or heads");
  call.positions = positions.contiguous();
  call.slot_mapping = slot_mapping.contiguous();
  call.cos_sin_cache = cos_sin_cache.contiguous();

  RopeCacheParams& p = call.params;
  p = RopeCacheParams{};
  p.positions = call.positions.const_data_ptr<int64_t>();
  p.query = query.const_data_ptr();
  p.key = key.const_data_ptr();
  p.value = value.const_data_ptr();
  p.cos_sin_cache = call.cos_sin_cache.const_data_ptr();
  p.q_norm_weight = call.q_norm_weight.defined() ? call.q_norm_weight.const_data_ptr() : nullptr;
  p.k_norm_weight = call.k_norm_weight.defined() ? call.k_norm_weight.const_data_ptr() : nullptr;
  p.key_cache = key_cache.mutable_data_ptr();
  p.value_cache = value_cache.mutable_data_ptr();
  p.slot_mapping = call.slot_mapping.const_data_ptr<int64_t>();
  p.q_stride = query.stride(0);
  p.k_stride = key.stride(0);
  p.v_stride = value.stride(0);
  p.num_slots = key_cache.size(0) * key_cache.size(1);
  p.num_tokens = static_cast<int>(num_tokens);
  p.num_heads = static_cast<int>(query.size(1));
  p.num_kv_heads = static_cast<int>(key.size(1));
  p.head_size = static_cast<int>(head_size);
  p.eps = static_cast<float>(eps);
  p.cos_sin_fp32 = cos_sin_fp32;
  p.fp8_cache = key_cache.scalar_type() == at::kFloat8_e4m3fn;
  p.k_scale = static_cast<float>(k_scale);
  p.v_scale = static_cast<float>(v_scale);
  return call;
}

at::Tensor rope_and_cache(
    const at::Tensor& positions,
    const at::Tensor& query,
    const at::Tensor& key,
    const at::Tensor& value,
    const at::Tensor& cos_sin_cache,
    const std::optional<at::Tensor>& q_norm_weight,
    const std::optional<at::Tensor>& k_norm_weight,
    double eps,
    at::Tensor& key_cache,
    at::Tensor& value_cache,
    const at::Tensor& slot_mapping,
    double k_scale,
    double v_scale) {
  RopeCacheCall call = rope_cache_call(positions, query, key, value, cos_sin_cache, q_norm_weight, k_norm_weight,
                                       eps, key_cache, value_cache, slot_mapping, k_scale, v_scale);
  const c10::cuda::CUDAGuard device_guard(key.device());
  return run_rope_and_cache(call, query);
}

at::Tensor run_rope_and_cache(RopeCacheCall& call, const at::Tensor& query) {
  at::Tensor q_out = at::empty(query.sizes(), query.options());
  if (call.params.num_tokens == 0) return q_out;
  call.params.q_out = q_out.mutable_data_ptr();
  launch_rope_and_cache(call.params, query.scalar_type());
  return q_out;
}

}  // namespace compilelm::cuda
