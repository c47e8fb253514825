// Device helpers of the fused row kernels (norm_quant_kernels.cu, quant_kernels.cu): vector
// accesses, block reductions, and the fp8 rounding of vLLM's scales (x ~= q.float() * scale).
#pragma once

#include <cuda_fp8.h>

#include <cstdint>

#include "cuda/convert.cuh"

namespace compilelm::cuda {

constexpr float kFp8Max = 448.f;                                          // finfo(float8_e4m3fn).max
constexpr float kFp8MinScale = static_cast<float>(1.0 / (448.0 * 512.0));  // as compilelm/ops/quant.py

// N elements of T moved as one access (N * sizeof(T) bytes, aligned to that).
template <typename T, int N>
struct alignas(sizeof(T) * N) Vec {
  T v[N];
};

template <typename T, int N>
__device__ __forceinline__ Vec<T, N> load_vec(const T* row, int chunk) {
  return reinterpret_cast<const Vec<T, N>*>(row)[chunk];
}

template <typename T, int N>
__device__ __forceinline__ void store_vec(T* row, int chunk, const Vec<T, N>& v) {
  reinterpret_cast<Vec<T, N>*>(row)[chunk] = v;
}

// x / scale rounded to float8_e4m3fn (nearest even), saturated to +-448 as the reference's clamp.
__device__ __forceinline__ __nv_fp8_storage_t quant_fp8(float x, float scale) {
  return __nv_cvt_float_to_fp8(__fdiv_rn(x, scale), __NV_SATFINITE, __NV_E4M3);
}

// The per-row scale of dynamic quantization: max(amax / 448, 1 / (448 * 512)).
__device__ __forceinline__ float dynamic_scale(float amax) {
  return fmaxf(__fdiv_rn(amax, kFp8Max), kFp8MinScale);
}

template <bool kMax>
__device__ __forceinline__ float combine(float a, float b) {
  return kMax ? fmaxf(a, b) : a + b;
}

// Sum (or max) of v over the block, returned to every thread. blockDim.x: a multiple of 32, at
// most 1024. 0 is the identity of both (max is taken of absolute values).
template <bool kMax>
__device__ __forceinline__ float block_reduce(float v) {
  __shared__ float partial[32];
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) v = combine<kMax>(v, __shfl_xor_sync(0xffffffffu, v, offset));
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  __syncthreads();  // an earlier call's threads are done reading partial
  if (lane == 0) partial[warp] = v;
  __syncthreads();
  v = lane < static_cast<int>(blockDim.x / 32) ? partial[lane] : 0.f;
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) v = combine<kMax>(v, __shfl_xor_sync(0xffffffffu, v, offset));
  return v;
}

// Threads of a row kernel: one per vector of the row, in whole warps, at most 1024.
inline int row_threads(int64_t vectors) {
  const int64_t warps = (vectors + 31) / 32;
  return static_cast<int>(warps < 1 ? 32 : warps > 32 ? 1024 : warps * 32);
}

// Vectors a thread of a register-row kernel holds: the smallest power of two up to max_per for
// which a row of `vectors` needs at most max_threads threads; 0: the row is too long for that.
inline int reg_vectors_per_thread(int64_t vectors, int max_threads, int max_per) {
  for (int per = 1; per <= max_per; per *= 2) {
    if (vectors <= static_cast<int64_t>(max_threads) * per) return per;
  }
  return 0;
}

}  // namespace compilelm::cuda
