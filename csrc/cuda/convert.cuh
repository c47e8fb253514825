// Element conversions of the CUDA kernels: the activation types (float, __nv_bfloat16, __half)
// to and from fp32, rounding to nearest even as torch does; the FP8 KV cache's float8_e4m3fn
// (__nv_fp8_e4m3) to fp32, and fp32 to it as the cache writers store it.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <cstdint>

namespace compilelm::cuda {

template <typename T>
__device__ __forceinline__ float to_float(T x);
template <>
__device__ __forceinline__ float to_float(float x) { return x; }
template <>
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
template <>
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
template <>
__device__ __forceinline__ float to_float(__nv_fp8_e4m3 x) { return static_cast<float>(x); }

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

// An FP8 KV cache's code for x: fp8(clamp(x / scale, -448, 448)), rounded to nearest even
// (the division IEEE-rounded, as torch's `x.float() / scale`; saturating, NaN kept).
__device__ __forceinline__ uint8_t quantize_kv_fp8(float x, float scale) {
  return static_cast<uint8_t>(__nv_cvt_float_to_fp8(__fdiv_rn(x, scale), __NV_SATFINITE, __NV_E4M3));
}

// Two fp8 e4m3 codes (the low byte first) widened to fp32: one cvt to f16x2 (exact: e4m3 is a
// subset of fp16), then f16 -> f32.
__device__ __forceinline__ float2 fp8x2_to_float2(uint16_t codes) {
  const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(codes), __NV_E4M3);
  return __half22float2(__half2(h));
}

// The same two codes as one f16x2 register (the low code in the low half): one cvt, exact.
__device__ __forceinline__ uint32_t fp8x2_to_half2_bits(uint16_t codes) {
  const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(codes), __NV_E4M3);
  return static_cast<uint32_t>(h.x) | (static_cast<uint32_t>(h.y) << 16);
}

}  // namespace compilelm::cuda
