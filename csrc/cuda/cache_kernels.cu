// The reshape_and_cache kernel (entry and checks: reshape_and_cache.cpp). One program per
// token copies its key row and value row (num_kv_heads * head_size elements, contiguous in
// source and cache) to cache row slot_mapping[token]. Slots are read on the device only (no
// sync): -1 skips the token, and so does any slot outside the cache (the CPU kernel raises for
// those; here no host is there to tell). A float8_e4m3fn cache (FP8 KV cache) takes the
// quantizing kernel: each thread converts 8 elements (one 16-byte load of bf16/fp16, two of fp32)
// to fp8(x / scale) and stores their 8 bytes.
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>

#include <algorithm>

#include "cuda/convert.cuh"
#include "cuda/launch.cuh"
#include "cuda/launchers.h"

namespace compilelm::cuda {
namespace {

template <typename Unit>
__global__ void reshape_and_cache_kernel(const Unit* __restrict__ key, const Unit* __restrict__ value,
                                         Unit* __restrict__ key_cache, Unit* __restrict__ value_cache,
                                         const int64_t* __restrict__ slot_mapping, int64_t key_stride,
                                         int64_t value_stride, int row_units, int64_t num_slots) {
  wait_for_prior_kernels();  // PDL (launch.cuh): before any read of earlier kernels' outputs
  allow_dependent_kernels();
  const int64_t token = blockIdx.x;
  const int64_t slot = slot_mapping[token];
  if (slot < 0 || slot >= num_slots) return;
  const Unit* k = key + token * key_stride;
  const Unit* v = value + token * value_stride;
  Unit* k_dst = key_cache + slot * row_units;
  Unit* v_dst = value_cache + slot * row_units;
  for (int i = threadIdx.x; i < row_units; i += blockDim.x) {
    k_dst[i] = k[i];
    v_dst[i] = v[i];
  }
}

template <typename Unit>
void launch(const at::Tensor& key, const at::Tensor& value, at::Tensor& key_cache, at::Tensor& value_cache,
            const at::Tensor& slot_mapping) {
  const int64_t unit_elems = sizeof(Unit) / key.element_size();
  const int row_units = static_cast<int>(key.size(1) * key.size(2) / unit_elems);
  const int threads = std::min(256, (row_units + 31) / 32 * 32);
  launch_kernel(
      reshape_and_cache_kernel<Unit>, key.size(0), threads, 0, c10::cuda::getCurrentCUDAStream(),
      static_cast<const Unit*>(key.const_data_ptr()), static_cast<const Unit*>(value.const_data_ptr()),
      static_cast<Unit*>(key_cache.mutable_data_ptr()), static_cast<Unit*>(value_cache.mutable_data_ptr()),
      slot_mapping.const_data_ptr<int64_t>(), key.stride(0) / unit_elems, value.stride(0) / unit_elems, row_units,
      key_cache.size(0) * key_cache.size(1));
}

// FP8 cache: row elements (num_kv_heads * head_size, a multiple of 8: head_size is) in groups of
// 8 per thread; key / value rows contiguous within a token (checked), any token stride.
template <typename T>
__global__ void reshape_and_cache_fp8_kernel(const T* __restrict__ key, const T* __restrict__ value,
                                             uint8_t* __restrict__ key_cache, uint8_t* __restrict__ value_cache,
                                             const int64_t* __restrict__ slot_mapping, int64_t key_stride,
                                             int64_t value_stride, int row, int64_t num_slots, float k_scale,
                                             float v_scale) {
  wait_for_prior_kernels();  // PDL (launch.cuh): before any read of earlier kernels' outputs
  allow_dependent_kernels();
  const int64_t token = blockIdx.x;
  const int64_t slot = slot_mapping[token];
  if (slot < 0 || slot >= num_slots) return;
  for (int i = threadIdx.x * 8; i < row; i += blockDim.x * 8) {
    uint2 k_out, v_out;
    uint8_t* kb = reinterpret_cast<uint8_t*>(&k_out);
    uint8_t* vb = reinterpret_cast<uint8_t*>(&v_out);
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      kb[e] = quantize_kv_fp8(to_float(key[token * key_stride + i + e]), k_scale);
      vb[e] = quantize_kv_fp8(to_float(value[token * value_stride + i + e]), v_scale);
    }
    *reinterpret_cast<uint2*>(key_cache + slot * row + i) = k_out;  // 8-byte aligned: row % 8 == 0
    *reinterpret_cast<uint2*>(value_cache + slot * row + i) = v_out;
  }
}

template <typename T>
void launch_fp8(const at::Tensor& key, const at::Tensor& value, at::Tensor& key_cache, at::Tensor& value_cache,
                const at::Tensor& slot_mapping, float k_scale, float v_scale) {
  const int row = static_cast<int>(key.size(1) * key.size(2));
  const int threads = std::min(256, (row / 8 + 31) / 32 * 32);
  launch_kernel(reshape_and_cache_fp8_kernel<T>, key.size(0), threads, 0, c10::cuda::getCurrentCUDAStream(),
                static_cast<const T*>(key.const_data_ptr()), static_cast<const T*>(value.const_data_ptr()),
                static_cast<uint8_t*>(key_cache.mutable_data_ptr()), static_cast<uint8_t*>(value_cache.mutable_data_ptr()),
                slot_mapping.const_data_ptr<int64_t>(), key.stride(0), value.stride(0), row,
                key_cache.size(0) * key_cache.size(1), k_scale, v_scale);
}

}  // namespace

void launch_reshape_and_cache(const at::Tensor& key, const at::Tensor& value, at::Tensor& key_cache,
                              at::Tensor& value_cache, const at::Tensor& slot_mapping, bool vectorized, float k_scale,
                              float v_scale) {
  if (key_cache.scalar_type() == at::kFloat8_e4m3fn) {  // 8-byte stores: rows of 8k codes, 8-byte aligned caches
    TORCH_CHECK(key.size(1) * key.size(2) % 8 == 0 &&
                    reinterpret_cast<uintptr_t>(key_cache.const_data_ptr()) % 8 == 0 &&
                    reinterpret_cast<uintptr_t>(value_cache.const_data_ptr()) % 8 == 0,
                "reshape_and_cache into an fp8 cache: rows of a multiple of 8 codes, 8-byte aligned caches");
    switch (key.scalar_type()) {
      case at::kBFloat16: return launch_fp8<__nv_bfloat16>(key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale);
      case at::kHalf: return launch_fp8<__half>(key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale);
      default: return launch_fp8<float>(key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale);
    }
  }
  if (vectorized) return launch<uint4>(key, value, key_cache, value_cache, slot_mapping);
  if (key.element_size() == 4) return launch<uint32_t>(key, value, key_cache, value_cache, slot_mapping);
  launch<uint16_t>(key, value, key_cache, value_cache, slot_mapping);
}

}  // namespace compilelm::cuda
