// Element conversions of the CUDA kernels: the activation types (float, __nv_bfloat16, __half)
// to and from fp32, rounding to nearest even as torch does.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace compilelm::cuda {

template <typename T>
__device__ __forceinline__ float to_float(T x);
template <>
__device__ __forceinline__ float to_float(float x) { return x; }
template <>
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
template <>
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }

template <typename T>
__device__ __forceinline__ T from_float(float x);
template <>
__device__ __forceinline__ float from_float(float x) { return x; }
template <>
__device__ __forceinline__ __nv_bfloat16 from_float(float x) { return __float2bfloat16(x); }
template <>
__device__ __forceinline__ __half from_float(float x) { return __float2half(x); }

// x rounded to T and back: the value torch holds after an op whose result has dtype T.
template <typename T>
__device__ __forceinline__ float round_to(float x) { return to_float(from_float<T>(x)); }

}  // namespace compilelm::cuda
