// skinny_mm: y = x @ weight.T for one or two rows of x (decode at batch 1-2), CUDA cores.
//
// At M <= 2 a linear layer is a stream over its weight: every byte is read once and used for M
// multiply-adds. cuBLAS's tile choices leave bandwidth unused on some shapes (on an H100 at
// M = 1, Llama-3.1-8B's 4096 x 4096 o_proj ran at ~67% of copy bandwidth on 64 CTAs). Here one
// warp computes one output column n (one row of weight) and walks it in steps of kLoads
// 16-byte loads per lane, multiplying each step with the matching slices of x (L1-cached: every
// warp reads the same x) before a warp reduction. Small steps keep registers low, so many warps
// are resident per SM and the memory system always has loads queued; measured on an H100 over
// 4/8/16 loads x 4/8 warps per block x 3 occupancy hints, 4 loads x 4 warps was fastest or
// within 2% on every Llama-3.1-8B and SmolLM2-135M layer shape at M = 1
// (benchmarks/bench_skinny_mm.py has the comparison with cuBLAS).
//
// More than kMaxRows rows, or layouts the kernel does not take (unaligned, strided K, mixed
// dtypes), go to at::mm: the op is correct for every input, the kernel is the fast path.
#include <ATen/ops/empty.h>
#include <ATen/ops/mm.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "cuda/attention_common.cuh"
#include "cuda/cuda_ops.h"

namespace compilelm::cuda {
namespace {

constexpr int kMaxRows = 2;   // M above this: cuBLAS (at M = 2 the kernel is already only level with it on 8B shapes)
constexpr int kWarps = 4;     // warps (output columns) per block
constexpr int kLoads = 4;     // 16-byte weight loads in flight per lane, per step

__device__ __forceinline__ uint4 load_weight(const void* ptr) {  // read once: keep it out of L1
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(ptr));
  return v;
}

template <typename T, int M>
__global__ void __launch_bounds__(kWarps * 32)
    skinny_mm_kernel(const T* __restrict__ x, int64_t x_stride, const T* __restrict__ w, int64_t w_stride,
                     T* __restrict__ y, int64_t y_stride, int n_cols, int k) {
  constexpr int kVec = 16 / sizeof(T);
  const int n = blockIdx.x * kWarps + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (n >= n_cols) return;
  const T* row = w + static_cast<int64_t>(n) * w_stride;
  const int chunks = k / kVec;  // 16-byte chunks of one row

  float acc[M];
#pragma unroll
  for (int m = 0; m < M; ++m) acc[m] = 0.f;
  for (int base = lane; base < chunks; base += 32 * kLoads) {
    uint4 wv[kLoads];
#pragma unroll
    for (int i = 0; i < kLoads; ++i) {
      const int c = base + i * 32;
      wv[i] = c < chunks ? load_weight(row + c * kVec) : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int i = 0; i < kLoads; ++i) {
      const int c = base + i * 32;
      if (c >= chunks) continue;
      float wf[kVec];
      widen<T>(wv[i], wf);
#pragma unroll
      for (int m = 0; m < M; ++m) {
        float xf[kVec];
        widen<T>(__ldg(reinterpret_cast<const uint4*>(x + m * x_stride + c * kVec)), xf);
#pragma unroll
        for (int e = 0; e < kVec; ++e) acc[m] += xf[e] * wf[e];
      }
    }
  }
#pragma unroll
  for (int m = 0; m < M; ++m) {
#pragma unroll
    for (int offset = 16; offset > 0; offset /= 2) acc[m] += __shfl_xor_sync(0xffffffffu, acc[m], offset);
    if (lane == 0) y[m * y_stride + n] = from_float<T>(acc[m]);
  }
}

template <typename T>
void launch(const at::Tensor& x, const at::Tensor& w, at::Tensor& y) {
  const auto* xp = reinterpret_cast<const T*>(x.const_data_ptr());
  const auto* wp = reinterpret_cast<const T*>(w.const_data_ptr());
  auto* yp = reinterpret_cast<T*>(y.mutable_data_ptr());
  const int n = static_cast<int>(w.size(0)), k = static_cast<int>(w.size(1));
  const dim3 grid((n + kWarps - 1) / kWarps), block(kWarps * 32);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  if (x.size(0) == 1) {
    skinny_mm_kernel<T, 1><<<grid, block, 0, stream>>>(xp, x.stride(0), wp, w.stride(0), yp, y.stride(0), n, k);
  } else {
    skinny_mm_kernel<T, 2><<<grid, block, 0, stream>>>(xp, x.stride(0), wp, w.stride(0), yp, y.stride(0), n, k);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

bool aligned_rows(const at::Tensor& t) {  // rows of whole, aligned 16-byte vectors
  const int64_t vec = 16 / t.element_size();
  return t.stride(1) == 1 && t.stride(0) % vec == 0 && t.size(1) % vec == 0 &&
         reinterpret_cast<uintptr_t>(t.const_data_ptr()) % 16 == 0;
}

}  // namespace

at::Tensor skinny_mm(const at::Tensor& x, const at::Tensor& weight) {
  TORCH_CHECK(x.is_cuda() && weight.device() == x.device(), "skinny_mm: x and weight must be on one CUDA device, got ",
              x.device(), " and ", weight.device());
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && x.size(1) == weight.size(1),
              "skinny_mm: x must be [M, K] and weight [N, K], got ", x.sizes(), " and ", weight.sizes());
  TORCH_CHECK(x.scalar_type() == weight.scalar_type(), "skinny_mm: x and weight must have one dtype, got ",
              x.scalar_type(), " and ", weight.scalar_type());
  const auto dtype = x.scalar_type();
  const bool fast = x.size(0) >= 1 && x.size(0) <= kMaxRows && weight.size(0) >= 1 && weight.size(0) < (int64_t{1} << 31) &&
                    weight.size(1) < (int64_t{1} << 31) &&
                    (dtype == at::kBFloat16 || dtype == at::kHalf || dtype == at::kFloat) && aligned_rows(x) &&
                    aligned_rows(weight);
  if (!fast) return at::mm(x, weight.t());
  const c10::cuda::CUDAGuard guard(x.device());
  at::Tensor y = at::empty({x.size(0), weight.size(0)}, x.options());
  switch (dtype) {
    case at::kBFloat16: launch<__nv_bfloat16>(x, weight, y); break;
    case at::kHalf: launch<__half>(x, weight, y); break;
    default: launch<float>(x, weight, y); break;
  }
  return y;
}

}  // namespace compilelm::cuda
