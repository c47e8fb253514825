// The rope_and_cache kernel (entry and checks: rope_and_cache.cpp). One warp per (token, head
// unit), units = query heads | key heads | value heads:
//
//   query / key head:  optional QK-norm  x = T(w * T(x * rsqrt(mean(x^2) + eps)))  (warp reduce),
//                      then neox RoPE    out[j]     = x[j] * cos[j] - x[j + D/2] * sin[j]
//                                        out[j+D/2] = x[j + D/2] * cos[j] + x[j] * sin[j]
//                      with cos, sin rounded to T (apply_rope's `.to(x.dtype)`), in fp32 and
//                      rounded once (the unfused graph under Inductor does the same; eager rounds
//                      each product too: at most one step of T apart)
//                      -> q_out, or the key cache row of the token's slot
//   value head:        copied to the value cache row of the slot
//   fp8 caches (p.fp8_cache): cache rows get fp8(x / scale) of those values (quantize_kv_fp8)
//
// Lane l holds elements l + 32 e (e < D / 32) of its head, so a rotation pair (j, j + D/2) sits
// in one lane (D / 2 is a multiple of 32). Slots outside [0, num_slots) (-1: padding) write no
// cache rows; the query is rotated regardless.
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>

#include "cuda/attention_common.cuh"
#include "cuda/convert.cuh"
#include "cuda/launch.cuh"
#include "cuda/launchers.h"

namespace compilelm::cuda {
namespace {

constexpr int kWarpsPerBlock = 4;

template <typename T, typename CosT, int D, bool kNorm>
__global__ void rope_and_cache_kernel(const RopeCacheParams p) {
  constexpr int E = D / 32;
  const int token = blockIdx.x;
  const int unit = blockIdx.y * kWarpsPerBlock + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const int q_units = p.num_heads, qk_units = p.num_heads + p.num_kv_heads;
  // The one kernel that may let its dependent start before its own PDL wait (launch.cuh): decode
  // attention, next, then reads its metadata, block table and older context rows while this
  // kernel still waits for the QKV projection.
  if (p.early_dependents) allow_dependent_kernels();
  // Before the PDL wait (launch.cuh): the step's slot and position, and this lane's cos/sin
  // (rounded to T, as apply_rope's `.to(x.dtype)`): none is an earlier kernel's output.
  const int64_t slot = p.slot_mapping[token];
  const bool cached = slot >= 0 && slot < p.num_slots;
  float cos_j[E / 2], sin_j[E / 2];
  if (unit < qk_units) {
    const CosT* cos = static_cast<const CosT*>(p.cos_sin_cache) + p.positions[token] * D;
#pragma unroll
    for (int e = 0; e < E / 2; ++e) {
      cos_j[e] = round_to<T>(to_float(cos[lane + 32 * e]));
      sin_j[e] = round_to<T>(to_float(cos[D / 2 + lane + 32 * e]));
    }
  }
  wait_for_prior_kernels();  // PDL (launch.cuh): before any read of earlier kernels' outputs
  if (!p.early_dependents) allow_dependent_kernels();
  if (unit >= qk_units + p.num_kv_heads) return;

  if (unit >= qk_units) {  // value head: copy
    if (!cached) return;
    const int head = unit - qk_units;
    const T* src = static_cast<const T*>(p.value) + token * p.v_stride + head * D;
    const int64_t row = (slot * p.num_kv_heads + head) * D;
    if (p.fp8_cache) {
      uint8_t* dst = static_cast<uint8_t*>(p.value_cache) + row;
#pragma unroll
      for (int e = 0; e < E; ++e) dst[lane + 32 * e] = quantize_kv_fp8(to_float(src[lane + 32 * e]), p.v_scale);
      return;
    }
    T* dst = static_cast<T*>(p.value_cache) + row;
#pragma unroll
    for (int e = 0; e < E; ++e) dst[lane + 32 * e] = src[lane + 32 * e];
    return;
  }
  const bool is_query = unit < q_units;
  if (!is_query && !cached) return;
  const int head = is_query ? unit : unit - q_units;
  const T* src = is_query ? static_cast<const T*>(p.query) + token * p.q_stride + head * D
                          : static_cast<const T*>(p.key) + token * p.k_stride + head * D;
  float x[E];
#pragma unroll
  for (int e = 0; e < E; ++e) x[e] = to_float(src[lane + 32 * e]);

  if constexpr (kNorm) {
    float sum_sq = 0.f;
#pragma unroll
    for (int e = 0; e < E; ++e) sum_sq += x[e] * x[e];
#pragma unroll
    for (int offset = 16; offset > 0; offset /= 2) sum_sq += __shfl_xor_sync(0xffffffffu, sum_sq, offset);
    const float inv_rms = rsqrtf(sum_sq / D + p.eps);
    const T* w = static_cast<const T*>(is_query ? p.q_norm_weight : p.k_norm_weight);
#pragma unroll
    for (int e = 0; e < E; ++e) x[e] = round_to<T>(to_float(w[lane + 32 * e]) * round_to<T>(x[e] * inv_rms));
  }

  if (!is_query && p.fp8_cache) {  // the rotated key, rounded to T, then quantized
    uint8_t* dst = static_cast<uint8_t*>(p.key_cache) + (slot * p.num_kv_heads + head) * D;
#pragma unroll
    for (int e = 0; e < E / 2; ++e) {
      const int j = lane + 32 * e;  // < D / 2
      const float x1 = x[e], x2 = x[e + E / 2];
      dst[j] = quantize_kv_fp8(round_to<T>(rope_rotate(x1, x2, cos_j[e], sin_j[e], /*upper=*/false)), p.k_scale);
      dst[j + D / 2] = quantize_kv_fp8(round_to<T>(rope_rotate(x2, x1, cos_j[e], sin_j[e], /*upper=*/true)), p.k_scale);
    }
    return;
  }
  T* dst = is_query ? static_cast<T*>(p.q_out) + (static_cast<int64_t>(token) * p.num_heads + head) * D
                    : static_cast<T*>(p.key_cache) + (slot * p.num_kv_heads + head) * D;
#pragma unroll
  for (int e = 0; e < E / 2; ++e) {
    const int j = lane + 32 * e;  // < D / 2
    const float c = cos_j[e], s = sin_j[e];
    const float x1 = x[e], x2 = x[e + E / 2];
    dst[j] = from_float<T>(rope_rotate(x1, x2, c, s, /*upper=*/false));
    dst[j + D / 2] = from_float<T>(rope_rotate(x2, x1, c, s, /*upper=*/true));
  }
}

// Attention may start early (RopeCacheParams::early_dependents) in small models (query width at
// most kSmallModelQueryWidth, launchers.h), whose QKV projection is too short to hide attention's
// loads before its wait; in wider models attention's early blocks would hold SMs while the QKV
// projection streams (docs/perf.md, "Programmatic dependent launch (PDL)").
template <typename T, typename CosT, int D>
void launch(const RopeCacheParams& params) {
  RopeCacheParams p = params;
  p.early_dependents = p.num_heads * p.head_size <= kSmallModelQueryWidth;
  const int units = p.num_heads + 2 * p.num_kv_heads;
  const dim3 grid(p.num_tokens, (units + kWarpsPerBlock - 1) / kWarpsPerBlock);
  const auto stream = c10::cuda::getCurrentCUDAStream();
  if (p.q_norm_weight != nullptr) {
    launch_kernel(rope_and_cache_kernel<T, CosT, D, true>, grid, 32 * kWarpsPerBlock, 0, stream, p);
  } else {
    launch_kernel(rope_and_cache_kernel<T, CosT, D, false>, grid, 32 * kWarpsPerBlock, 0, stream, p);
  }
}

template <typename T, typename CosT>
void dispatch_head_size(const RopeCacheParams& p) {
  switch (p.head_size) {
    case 64: return launch<T, CosT, 64>(p);
    case 128: return launch<T, CosT, 128>(p);
    default: return launch<T, CosT, 256>(p);
  }
}

template <typename T>
void dispatch_cos(const RopeCacheParams& p) {
  if (p.cos_sin_fp32) return dispatch_head_size<T, float>(p);
  dispatch_head_size<T, T>(p);
}

}  // namespace

void launch_rope_and_cache(const RopeCacheParams& p, at::ScalarType dtype) {
  switch (dtype) {
    case at::kBFloat16: return dispatch_cos<__nv_bfloat16>(p);
    case at::kHalf: return dispatch_cos<__half>(p);
    default: return dispatch_head_size<float, float>(p);  // fp32 activations: an fp32 table (checked)
  }
}

}  // namespace compilelm::cuda
