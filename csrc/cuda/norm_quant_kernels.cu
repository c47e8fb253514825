// RMSNorm row kernels: rms_norm_quant_fp8, fused_add_rms_norm_quant_fp8, fused_add_rms_norm
// (entry points and checks: fused_ops.cpp). One program per token row:
//
//   pass 1  r = x (+ residual, rounded to T and stored as residual_out); sum of r^2 in fp32
//   pass 2  y = T(weight * T(r * rsqrt(mean + eps)))  -- compilelm.ops.norm.rms_norm's
//           roundings; store y (kNone), or fp8(y / scale) (kStatic), or take amax(|y|) (kDynamic)
//   pass 3  kDynamic only: scale = max(amax / 448, 1 / (448 * 512)); store fp8(y / scale)
//
// Passes 2 and 3 re-read the row, which the same thread just touched (L1/L2 hits): no shared
// copy of the row, so any hidden size runs at full occupancy. With residual, they read the
// residual_out this thread wrote in pass 1.
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>

#include "cuda/fused_common.cuh"
#include "cuda/launch.cuh"
#include "cuda/launchers.h"

namespace compilelm::cuda {
namespace {

template <typename T, int N, bool kAdd, QuantMode kQuant>
__global__ void rms_norm_kernel(const RowParams p) {
  wait_for_prior_kernels();  // PDL (launch.cuh): before any read of earlier kernels' outputs
  allow_dependent_kernels();
  const int64_t row = blockIdx.x;
  const int chunks = p.cols / N;
  const T* x = static_cast<const T*>(p.x) + row * p.x_stride;
  const T* weight = static_cast<const T*>(p.weight);
  T* residual_out = kAdd ? static_cast<T*>(p.residual_out) + row * p.cols : nullptr;
  const T* r_row = kAdd ? residual_out : x;  // the row that is normalized

  float sum_sq = 0.f;
  for (int c = threadIdx.x; c < chunks; c += blockDim.x) {
    Vec<T, N> r = load_vec<T, N>(x, c);
    if constexpr (kAdd) {
      const Vec<T, N> res = load_vec<T, N>(static_cast<const T*>(p.residual) + row * p.residual_stride, c);
#pragma unroll
      for (int i = 0; i < N; ++i) r.v[i] = from_float<T>(to_float(r.v[i]) + to_float(res.v[i]));
      store_vec<T, N>(residual_out, c, r);
    }
#pragma unroll
    for (int i = 0; i < N; ++i) sum_sq += to_float(r.v[i]) * to_float(r.v[i]);
  }
  const float inv_rms = rsqrtf(block_reduce<false>(sum_sq) / p.cols + p.eps);

  // y of chunk c, as the reference rounds it
  auto normed = [&](int c, float (&y)[N]) {
    const Vec<T, N> r = load_vec<T, N>(r_row, c);
    const Vec<T, N> w = load_vec<T, N>(weight, c);
#pragma unroll
    for (int i = 0; i < N; ++i) y[i] = round_to<T>(to_float(w.v[i]) * round_to<T>(to_float(r.v[i]) * inv_rms));
  };

  const float static_scale = kQuant == QuantMode::kStatic ? *p.scale : 1.f;
  float amax = 0.f;
  for (int c = threadIdx.x; c < chunks; c += blockDim.x) {
    float y[N];
    normed(c, y);
    if constexpr (kQuant == QuantMode::kNone) {
      Vec<T, N> out;
#pragma unroll
      for (int i = 0; i < N; ++i) out.v[i] = from_float<T>(y[i]);
      store_vec<T, N>(static_cast<T*>(p.out) + row * p.cols, c, out);
    } else if constexpr (kQuant == QuantMode::kStatic) {
      Vec<__nv_fp8_storage_t, N> q;
#pragma unroll
      for (int i = 0; i < N; ++i) q.v[i] = quant_fp8(y[i], static_scale);
      store_vec<__nv_fp8_storage_t, N>(static_cast<__nv_fp8_storage_t*>(p.out) + row * p.cols, c, q);
    } else {
#pragma unroll
      for (int i = 0; i < N; ++i) amax = fmaxf(amax, fabsf(y[i]));
    }
  }
  if constexpr (kQuant == QuantMode::kDynamic) {
    const float scale = dynamic_scale(block_reduce<true>(amax));
    if (threadIdx.x == 0) p.scale[row] = scale;
    for (int c = threadIdx.x; c < chunks; c += blockDim.x) {
      float y[N];
      normed(c, y);
      Vec<__nv_fp8_storage_t, N> q;
#pragma unroll
      for (int i = 0; i < N; ++i) q.v[i] = quant_fp8(y[i], scale);
      store_vec<__nv_fp8_storage_t, N>(static_cast<__nv_fp8_storage_t*>(p.out) + row * p.cols, c, q);
    }
  }
}

template <typename T, int N, bool kAdd, QuantMode kQuant>
void launch(const RowParams& p) {
  launch_kernel(rms_norm_kernel<T, N, kAdd, kQuant>, p.rows, row_threads(p.cols / N), 0,
                c10::cuda::getCurrentCUDAStream(), p);
}

template <typename T, int N>
void dispatch_mode(const RowParams& p, bool add, QuantMode quant) {
  switch (quant) {
    case QuantMode::kNone:
      return add ? launch<T, N, true, QuantMode::kNone>(p) : launch<T, N, false, QuantMode::kNone>(p);
    case QuantMode::kStatic:
      return add ? launch<T, N, true, QuantMode::kStatic>(p) : launch<T, N, false, QuantMode::kStatic>(p);
    case QuantMode::kDynamic:
      return add ? launch<T, N, true, QuantMode::kDynamic>(p) : launch<T, N, false, QuantMode::kDynamic>(p);
  }
}

template <typename T>
void dispatch_vec(const RowParams& p, bool add, QuantMode quant, bool vectorized) {
  if (vectorized) return dispatch_mode<T, 16 / sizeof(T)>(p, add, quant);
  dispatch_mode<T, 1>(p, add, quant);
}

}  // namespace

void launch_rms_norm(const RowParams& p, at::ScalarType dtype, bool add, QuantMode quant, bool vectorized) {
  switch (dtype) {
    case at::kBFloat16: return dispatch_vec<__nv_bfloat16>(p, add, quant, vectorized);
    case at::kHalf: return dispatch_vec<__half>(p, add, quant, vectorized);
    default: return dispatch_vec<float>(p, add, quant, vectorized);
  }
}

}  // namespace compilelm::cuda
