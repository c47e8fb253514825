// The reshape_and_cache kernel (entry and checks: reshape_and_cache.cpp). One program per
// token copies its key row and value row (num_kv_heads * head_size elements, contiguous in
// source and cache) to cache row slot_mapping[token]. Slots are read on the device only (no
// sync): -1 skips the token, and so does any slot outside the cache (the CPU kernel raises for
// those; here no host is there to tell).
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>

#include <algorithm>

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

}  // namespace

void launch_reshape_and_cache(const at::Tensor& key, const at::Tensor& value, at::Tensor& key_cache,
                              at::Tensor& value_cache, const at::Tensor& slot_mapping, bool vectorized) {
  if (vectorized) return launch<uint4>(key, value, key_cache, value_cache, slot_mapping);
  if (key.element_size() == 4) return launch<uint32_t>(key, value, key_cache, value_cache, slot_mapping);
  launch<uint16_t>(key, value, key_cache, value_cache, slot_mapping);
}

}  // namespace compilelm::cuda
