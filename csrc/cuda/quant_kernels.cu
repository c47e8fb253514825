// FP8 quantization row kernels: quant_fp8_per_token, quant_fp8_static, silu_mul_quant_fp8
// (entry points and checks: fused_ops.cpp), and SiLU-and-mul alone (silu_mul_linear's
// fallback above two rows, gate_up_silu_mul's below three). One program per token row (SiLU-and-mul
// alone: several, each a slice of the row; kDynamic on sm_90+ at decode sizes: a cluster of
// blocks; kDynamic elsewhere: the row in registers where it fits; both below):
//
//   y = x, or with silu_mul  y = T(T(silu(gate)) * up)  (torch's roundings of F.silu(gate) * up)
//   kNone     store y (x's dtype)
//   kStatic   store fp8(y / scale)
//   kDynamic  amax(|y|) over the row; scale = max(amax / 448, 1 / (448 * 512)); store fp8(y / scale)
//             (y is recomputed from the row the same thread just read: L1/L2 hits)
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>

#include <cooperative_groups.h>

#include <algorithm>

#include "cuda/fused_common.cuh"
#include "cuda/launch.cuh"
#include "cuda/launchers.h"

namespace compilelm::cuda {
namespace {

template <typename T, int N, bool kSiluMul>
__device__ __forceinline__ void load_y(const T* x_row, int cols, int c, float (&y)[N]) {
  const Vec<T, N> a = load_vec<T, N>(x_row, c);
  if constexpr (kSiluMul) {
    const Vec<T, N> up = load_vec<T, N>(x_row + cols, c);
#pragma unroll
    for (int i = 0; i < N; ++i) {
      const float g = to_float(a.v[i]);
      y[i] = round_to<T>(round_to<T>(g / (1.f + expf(-g))) * to_float(up.v[i]));
    }
  } else {
#pragma unroll
    for (int i = 0; i < N; ++i) y[i] = to_float(a.v[i]);
  }
}

template <typename T, int N, bool kSiluMul, QuantMode kQuant>
__global__ void quant_kernel(const RowParams p) {
  wait_for_prior_kernels();  // PDL (launch.cuh): before any read of earlier kernels' outputs
  allow_dependent_kernels();
  const int64_t row = blockIdx.x;
  const int chunks = p.cols / N;
  const T* x = static_cast<const T*>(p.x) + row * p.x_stride;
  if constexpr (kQuant == QuantMode::kNone) {  // the row's chunks spread over gridDim.y blocks
    for (int c = blockIdx.y * blockDim.x + threadIdx.x; c < chunks; c += gridDim.y * blockDim.x) {
      float y[N];
      load_y<T, N, kSiluMul>(x, p.cols, c, y);
      Vec<T, N> o;
#pragma unroll
      for (int i = 0; i < N; ++i) o.v[i] = from_float<T>(y[i]);
      store_vec<T, N>(static_cast<T*>(p.out) + row * p.cols, c, o);
    }
    return;
  }
  auto* out = static_cast<__nv_fp8_storage_t*>(p.out) + row * p.cols;

  float scale = 1.f;
  if constexpr (kQuant == QuantMode::kStatic) {
    scale = *p.scale;
  } else {
    float amax = 0.f;
    for (int c = threadIdx.x; c < chunks; c += blockDim.x) {
      float y[N];
      load_y<T, N, kSiluMul>(x, p.cols, c, y);
#pragma unroll
      for (int i = 0; i < N; ++i) amax = fmaxf(amax, fabsf(y[i]));
    }
    scale = dynamic_scale(block_reduce<true>(amax));
    if (threadIdx.x == 0) p.scale[row] = scale;
  }
  for (int c = threadIdx.x; c < chunks; c += blockDim.x) {
    float y[N];
    load_y<T, N, kSiluMul>(x, p.cols, c, y);
    Vec<__nv_fp8_storage_t, N> q;
#pragma unroll
    for (int i = 0; i < N; ++i) q.v[i] = quant_fp8(y[i], scale);
    store_vec<__nv_fp8_storage_t, N>(out, c, q);
  }
}

// kDynamic on sm_90+ below two rows an SM (decode batches): a row over a thread block cluster of
// kClusterBlocks blocks. One block a row leaves such a batch on as few SMs as it has rows, and
// SiLU's expf and division make each ALU-bound (docs/perf.md, "FP8 GEMMs by row count"). Each block
// computes y for its slice of the row once, keeps it in registers (at most kClusterChunks vectors
// a thread), takes its slice's amax, reads the other blocks' through distributed shared memory
// after a cluster barrier, and quantizes its slice; the second barrier keeps every block's shared
// memory alive until all reads are done. The same y, amax and scale as quant_kernel: the same
// bits. Prefill's row counts fill the GPU with one block a row (the cluster kernel was measured at
// decode sizes only).
constexpr int kClusterBlocks = 8;  // the portable cluster size
constexpr int kClusterThreads = 256;
constexpr int kClusterChunks = 4;
constexpr int64_t kClusterMaxVectors = int64_t{kClusterBlocks} * kClusterThreads * kClusterChunks;

template <typename T, int N, bool kSiluMul>
__global__ void __launch_bounds__(kClusterThreads) quant_dynamic_cluster_kernel(const RowParams p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  namespace cg = cooperative_groups;
  wait_for_prior_kernels();
  allow_dependent_kernels();
  __shared__ float s_amax;
  const int64_t row = blockIdx.x;  // grid (rows, kClusterBlocks), clusters (1, kClusterBlocks)
  const int rank = static_cast<int>(blockIdx.y);
  const int chunks = p.cols / N;
  const T* x = static_cast<const T*>(p.x) + row * p.x_stride;
  float y[kClusterChunks][N];
  float amax = 0.f;
#pragma unroll
  for (int j = 0; j < kClusterChunks; ++j) {
    const int c = (j * kClusterBlocks + rank) * kClusterThreads + threadIdx.x;
    if (c < chunks) {
      load_y<T, N, kSiluMul>(x, p.cols, c, y[j]);
#pragma unroll
      for (int i = 0; i < N; ++i) amax = fmaxf(amax, fabsf(y[j][i]));
    }
  }
  amax = block_reduce<true>(amax);
  if (threadIdx.x == 0) s_amax = amax;
  cg::cluster_group cluster = cg::this_cluster();
  cluster.sync();
#pragma unroll
  for (int r = 0; r < kClusterBlocks; ++r) amax = fmaxf(amax, *cluster.map_shared_rank(&s_amax, r));
  const float scale = dynamic_scale(amax);
  if (rank == 0 && threadIdx.x == 0) p.scale[row] = scale;
  auto* out = static_cast<__nv_fp8_storage_t*>(p.out) + row * p.cols;
#pragma unroll
  for (int j = 0; j < kClusterChunks; ++j) {
    const int c = (j * kClusterBlocks + rank) * kClusterThreads + threadIdx.x;
    if (c < chunks) {
      Vec<__nv_fp8_storage_t, N> q;
#pragma unroll
      for (int i = 0; i < N; ++i) q.v[i] = quant_fp8(y[j][i], scale);
      store_vec<__nv_fp8_storage_t, N>(out, c, q);
    }
  }
  cluster.sync();
#elif defined(__CUDA_ARCH__)
  __trap();  // launched on sm_90+ only
#endif
}

// kDynamic elsewhere (prefill's row counts), for rows of at most kRegThreads x kMaxRegVectors
// vectors (8192 columns of a 16-bit type): quant_kernel with the row's y in registers, a block of
// at most kRegThreads threads a row, thread t computing vectors t + j * blockDim.x (j < kPer) once,
// all loads issued before the first use: no second pass over the row (nor SiLU computed twice)
// and many rows' loads in flight an SM. The same y, amax and scale.
constexpr int kRegThreads = 256;
constexpr int kMaxRegVectors = 4;  // 8 would hold 14336 columns, at one block an SM: slower (docs/perf.md)
// Rows past that run quant_kernel with at most this many threads a row: more rows an SM than
// 1024-thread blocks, each row's two passes and block reductions out of step with the others'.
constexpr int kLoopThreads = 256;

template <typename T, int N, bool kSiluMul, int kPer>
__global__ void __launch_bounds__(kRegThreads) quant_dynamic_reg_kernel(const RowParams p) {
  wait_for_prior_kernels();
  allow_dependent_kernels();
  const int64_t row = blockIdx.x;
  const int chunks = p.cols / N;
  const T* x = static_cast<const T*>(p.x) + row * p.x_stride;
  // every load first; y then overwrites a (y is a value of T: the reference rounds it to T)
  Vec<T, N> a[kPer], up[kSiluMul ? kPer : 1];
#pragma unroll
  for (int j = 0; j < kPer; ++j) {
    const int c = threadIdx.x + j * blockDim.x;
    if (c < chunks) {
      a[j] = load_vec<T, N>(x, c);
      if constexpr (kSiluMul) up[j] = load_vec<T, N>(x + p.cols, c);
    }
  }
  float amax = 0.f;
#pragma unroll
  for (int j = 0; j < kPer; ++j) {
    if (threadIdx.x + j * blockDim.x < chunks) {
#pragma unroll
      for (int i = 0; i < N; ++i) {
        float y = to_float(a[j].v[i]);
        if constexpr (kSiluMul) y = round_to<T>(round_to<T>(y / (1.f + expf(-y))) * to_float(up[j].v[i]));
        a[j].v[i] = from_float<T>(y);
        amax = fmaxf(amax, fabsf(y));
      }
    }
  }
  const float scale = dynamic_scale(block_reduce<true>(amax));
  if (threadIdx.x == 0) p.scale[row] = scale;
  auto* out = static_cast<__nv_fp8_storage_t*>(p.out) + row * p.cols;
#pragma unroll
  for (int j = 0; j < kPer; ++j) {
    const int c = threadIdx.x + j * blockDim.x;
    if (c < chunks) {
      Vec<__nv_fp8_storage_t, N> q;
#pragma unroll
      for (int i = 0; i < N; ++i) q.v[i] = quant_fp8(to_float(a[j].v[i]), scale);
      store_vec<__nv_fp8_storage_t, N>(out, c, q);
    }
  }
}

// kNone (SiLU-and-mul alone): 128 threads a block, the row split over blocks, so that a few rows
// (decode at batch 1-2) still spread over the SMs: one 1024-thread block for a 14336-column row
// is slower than Inductor's kernel (docs/perf.md, "fuse_act_linear").
constexpr int kNoneThreads = 128;

template <typename T, int N, bool kSiluMul>
void launch(const RowParams& p, QuantMode quant) {
  const int threads = row_threads(p.cols / N);
  const auto stream = c10::cuda::getCurrentCUDAStream();
  if (quant == QuantMode::kNone) {  // no row reduction: a block per kNoneThreads chunks of a row
    const int64_t chunks = p.cols / N, blocks = std::min<int64_t>((chunks + kNoneThreads - 1) / kNoneThreads, 65535);
    launch_kernel(quant_kernel<T, N, kSiluMul, QuantMode::kNone>,
                  dim3(static_cast<unsigned>(p.rows), static_cast<unsigned>(std::max<int64_t>(blocks, 1))),
                  kNoneThreads, 0, stream, p);
  } else if (quant == QuantMode::kStatic) {
    launch_kernel(quant_kernel<T, N, kSiluMul, QuantMode::kStatic>, p.rows, threads, 0, stream, p);
  } else if (const auto* props = at::cuda::getCurrentDeviceProperties();
             props->major >= 9 && p.cols / N <= kClusterMaxVectors && p.rows < 2 * props->multiProcessorCount) {
    launch_kernel_in_clusters(quant_dynamic_cluster_kernel<T, N, kSiluMul>,
                              dim3(static_cast<unsigned>(p.rows), kClusterBlocks), dim3(1, kClusterBlocks, 1),
                              kClusterThreads, 0, stream, p);
  } else {
    const int64_t chunks = p.cols / N;
    const int per = reg_vectors_per_thread(chunks, kRegThreads, kMaxRegVectors);
    const int reg_threads = per > 0 ? row_threads((chunks + per - 1) / per) : 0;
    switch (per) {
      case 1: return launch_kernel(quant_dynamic_reg_kernel<T, N, kSiluMul, 1>, p.rows, reg_threads, 0, stream, p);
      case 2: return launch_kernel(quant_dynamic_reg_kernel<T, N, kSiluMul, 2>, p.rows, reg_threads, 0, stream, p);
      case 4: return launch_kernel(quant_dynamic_reg_kernel<T, N, kSiluMul, 4>, p.rows, reg_threads, 0, stream, p);
      default:  // longer rows: the loop kernel, in blocks of at most kLoopThreads
        launch_kernel(quant_kernel<T, N, kSiluMul, QuantMode::kDynamic>, p.rows, std::min(threads, kLoopThreads), 0,
                      stream, p);
    }
  }
}

template <typename T>
void dispatch(const RowParams& p, bool silu_mul, QuantMode quant, bool vectorized) {
  constexpr int kN = 16 / sizeof(T);
  if (silu_mul) return vectorized ? launch<T, kN, true>(p, quant) : launch<T, 1, true>(p, quant);
  vectorized ? launch<T, kN, false>(p, quant) : launch<T, 1, false>(p, quant);
}

}  // namespace

void launch_quant(const RowParams& p, at::ScalarType dtype, bool silu_mul, QuantMode quant, bool vectorized) {
  switch (dtype) {
    case at::kBFloat16: return dispatch<__nv_bfloat16>(p, silu_mul, quant, vectorized);
    case at::kHalf: return dispatch<__half>(p, silu_mul, quant, vectorized);
    default: return dispatch<float>(p, silu_mul, quant, vectorized);
  }
}

}  // namespace compilelm::cuda
