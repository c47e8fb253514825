// fp8_stream_mm: out = (x @ weight.T) * x_scale * weight_scale (+ bias) for 1-16 rows of an FP8
// (float8_e4m3fn) x against an FP8 weight: the decode batch sizes of an FP8 W8A8 linear layer.
//
//   x:            fp8 [M <= 16, K]   activations, quantized per token (or per tensor) by the producer
//   x_scale:      fp32, M values ([M, 1]) or one (static per-tensor)
//                 or None: x is bf16 / fp16 / fp32 [M <= 8, K] (M x K <= 48 KiB: kMaxQuantBytes) and
//                 the kernel quantizes it per token in its prologue, as quant_fp8_per_token would (the
//                 same bits)
//   weight:       fp8 [N, K]         rows contiguous, K a multiple of 16, 16-byte aligned rows
//   weight_scale: fp32, N values ([1, N] / [N]: per channel) or one (per tensor)
//   bias:         [N] in out's dtype, optional
//   out:          [M, N] bf16 / fp16 / fp32: T(fp32 acc * x_scale[m] * weight_scale[n] + bias[n])
//
// At 1-16 rows the layer is a stream over its weight, one byte per element: every byte is read
// once, with 16-byte loads that skip L1. The multiply runs on tensor cores
// (mma.sync m16n8k32 e4m3 -> fp32, sm_89+): a block owns 16 weight rows (the mma's M), x's rows
// are its N (8 per tile, two tiles for 9-16 rows), and the block's warps split K. Converting fp8
// to fp32 on CUDA cores costs ~3 instructions an element and would make the kernel ALU-bound at
// 2-4 rows; the mma makes the inner loop two instructions per 16-byte load.
//
// A GEMV may sum K in any order as long as both operands use the same one, so the mma fragments
// are filled straight from 16-byte loads with no shuffle: lane (g = lane / 4, t = lane % 4) loads
// chunk c of weight rows g and g + 8 and of x row g, and the fragment's k positions 4t..4t+3 and
// 16+4t..16+4t+3 are bytes 0-3 and 4-7 of the chunk (the first mma), bytes 8-11 and 12-15 (the
// second). Every lane with the same t holds the same chunk, so A's and B's k positions agree.
//
// Programmatic dependent launch (launch.cuh): the first weight loads go out before the wait (a
// weight is no kernel's output); x and the scales are read after it. Each warp keeps its next
// step's weight loads in flight while it multiplies the current one. The warps' partial tiles
// are summed through shared memory and the epilogue applies the scales (and bias) once per output.
//
// With the quant prologue (kQuant: o_proj, whose input comes from attention and has no producer
// to fuse the quant into) each block first takes the amax of x's rows and writes them quantized
// to shared memory (fused_common.cuh's dynamic_scale / quant_fp8: quant_fp8_per_token's bits),
// with its first weight loads already in flight; the steps then read x from shared memory. Every
// block redoes the rows (M x K elements, from L2): one kernel instead of the quant kernel and the
// GEMM, and no fp8 copy of x in global memory. Shared memory there: the quantized rows (M x K
// bytes, dynamic, at most kMaxQuantBytes) beside the ~2.2 KB of static arrays (s_acc, s_scale,
// block_reduce's); together past the default 48 KiB a block gets, so the launch raises the
// kernel's dynamic limit to kMaxQuantBytes first (every sm_89+ GPU allows >= 99 KB a block).
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>

#include <ATen/cuda/CUDAContext.h>

#include <atomic>
#include <cstdint>
#include <type_traits>

#include "cuda/attention_common.cuh"
#include "cuda/convert.cuh"
#include "cuda/cuda_ops.h"
#include "cuda/fused_common.cuh"
#include "cuda/launch.cuh"

namespace compilelm::cuda {
namespace {

constexpr int kMaxRows = 16;  // two n8 tiles of x rows
constexpr int kMaxQuantRows = 8;  // the quant prologue: one tile
constexpr int64_t kMaxQuantBytes = 48 * 1024;  // its quantized rows: dynamic shared memory, beside the static
constexpr int kTileRows = 16;  // weight rows per block: the mma's M
constexpr int kLoads = 4;     // 16-byte chunks per lane and weight row, per step
constexpr int kStep = 4 * kLoads;  // chunks of a row one warp covers per step (4 lanes share a row)

struct Fp8StreamParams {
  const uint8_t* x;  // fp8 rows, or (kQuant) the rows to quantize, of type XIn
  int64_t x_stride;
  const float* x_scale;
  int64_t x_scale_stride;  // 0: one scale for every row
  const uint8_t* w;
  int64_t w_stride;
  const float* w_scale;
  int64_t w_scale_stride;  // 0: one scale for every column
  const void* bias;        // [N] in out's type, or nullptr
  void* y;
  int64_t y_stride;
  int m, n, k;
};

__device__ __forceinline__ uint4 load_stream(const uint8_t* ptr) {  // read once: keep it out of L1
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(ptr));
  return v;
}

// d += A (16 x 32 e4m3, row) * B (32 x 8 e4m3, col), fp32 accumulators (PTX fragment layouts).
__device__ __forceinline__ void mma_e4m3(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                         uint32_t b0, uint32_t b1) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  asm volatile(
      "mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
#elif defined(__CUDA_ARCH__)
  __trap();  // the host refuses GPUs below sm_89
#endif
}

// XIn: uint8_t for fp8 x (scales given), else x's type (kQuant: quantized per token in the prologue).
// kWarps: warps per block, splitting K (launch_fp8_stream_mm picks 4 or 8).
template <typename T, int kTiles, typename XIn, int kWarps>
__global__ void __launch_bounds__(kWarps * 32) fp8_stream_mm_kernel(const Fp8StreamParams p) {
  constexpr bool kQuant = !std::is_same_v<XIn, uint8_t>;
  static_assert(!kQuant || kTiles * 8 <= kMaxQuantRows, "the quant prologue takes one tile of rows");
  __shared__ float s_acc[kWarps][kTiles][4][32];  // each warp's accumulator fragments
  __shared__ float s_scale[kQuant ? kMaxQuantRows : 1];  // kQuant: each row's scale
  extern __shared__ uint4 s_xq[];  // kQuant: the quantized rows, [M][K / 16] chunks
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g = lane / 4, t = lane % 4;
  const int n0 = blockIdx.x * kTileRows;
  const bool lo_ok = n0 + g < p.n, hi_ok = n0 + g + 8 < p.n;
  const uint8_t* w_lo = p.w + static_cast<int64_t>(lo_ok ? n0 + g : 0) * p.w_stride;
  const uint8_t* w_hi = p.w + static_cast<int64_t>(hi_ok ? n0 + g + 8 : 0) * p.w_stride;
  const int chunks = p.k / 16;
  const int steps = (chunks + kStep - 1) / kStep;

  uint4 wl[kLoads], wh[kLoads];  // this step's chunks of weight rows g and g + 8
  const auto load_w = [&](int step) {
#pragma unroll
    for (int i = 0; i < kLoads; ++i) {
      const int c = step * kStep + i * 4 + t;
      wl[i] = lo_ok && c < chunks ? load_stream(w_lo + c * 16) : make_uint4(0, 0, 0, 0);
      wh[i] = hi_ok && c < chunks ? load_stream(w_hi + c * 16) : make_uint4(0, 0, 0, 0);
    }
  };
  if (warp < steps) load_w(warp);  // before the wait: weights are no kernel's output
  wait_for_prior_kernels();  // PDL: x and the scales may be the previous kernel's output
  allow_dependent_kernels();

  if constexpr (kQuant) {  // x rows -> fp8 in shared memory, scale = max(amax / 448, 1 / (448 * 512))
    constexpr int kVec = 16 / sizeof(XIn);  // elements of one 16-byte load
    for (int m = 0; m < p.m; ++m) {
      const XIn* row = reinterpret_cast<const XIn*>(p.x) + m * p.x_stride;
      float amax = 0.f;
      for (int c = threadIdx.x; c < p.k / kVec; c += blockDim.x) {
        float f[kVec];
        widen<XIn>(__ldg(reinterpret_cast<const uint4*>(row + c * kVec)), f);
#pragma unroll
        for (int e = 0; e < kVec; ++e) amax = fmaxf(amax, fabsf(f[e]));
      }
      const float scale = dynamic_scale(block_reduce<true>(amax));
      if (threadIdx.x == 0) s_scale[m] = scale;
      for (int c = threadIdx.x; c < chunks; c += blockDim.x) {  // 16 elements -> one 16-byte chunk
        uint4 packed;
        uint8_t* q = reinterpret_cast<uint8_t*>(&packed);
#pragma unroll
        for (int h = 0; h < 16 / kVec; ++h) {
          float f[kVec];
          widen<XIn>(__ldg(reinterpret_cast<const uint4*>(row + c * 16 + h * kVec)), f);
#pragma unroll
          for (int e = 0; e < kVec; ++e) q[h * kVec + e] = quant_fp8(f[e], scale);
        }
        s_xq[m * chunks + c] = packed;
      }
    }
    __syncthreads();
  }

  float acc[kTiles][4] = {};
  for (int step = warp; step < steps; step += kWarps) {
    uint4 xv[kTiles][kLoads];
#pragma unroll
    for (int tile = 0; tile < kTiles; ++tile) {
      const int row = tile * 8 + g;
#pragma unroll
      for (int i = 0; i < kLoads; ++i) {
        const int c = step * kStep + i * 4 + t;
        if (row >= p.m || c >= chunks) {
          xv[tile][i] = make_uint4(0, 0, 0, 0);
        } else if constexpr (kQuant) {
          xv[tile][i] = s_xq[row * chunks + c];
        } else {
          xv[tile][i] = __ldg(reinterpret_cast<const uint4*>(p.x + row * p.x_stride + c * 16));
        }
      }
    }
    uint4 cl[kLoads], ch[kLoads];
#pragma unroll
    for (int i = 0; i < kLoads; ++i) {
      cl[i] = wl[i];
      ch[i] = wh[i];
    }
    if (step + kWarps < steps) load_w(step + kWarps);  // the next step's loads in flight during the mma
    // the step's 8 mma (256 products per output) into fresh accumulators, then one fp32 add: the
    // running sum never stays inside the tensor core's accumulator (DeepSeek-V3's promotion)
    float part[kTiles][4] = {};
#pragma unroll
    for (int i = 0; i < kLoads; ++i) {
#pragma unroll
      for (int tile = 0; tile < kTiles; ++tile) {
        mma_e4m3(part[tile], cl[i].x, ch[i].x, cl[i].y, ch[i].y, xv[tile][i].x, xv[tile][i].y);
        mma_e4m3(part[tile], cl[i].z, ch[i].z, cl[i].w, ch[i].w, xv[tile][i].z, xv[tile][i].w);
      }
    }
#pragma unroll
    for (int tile = 0; tile < kTiles; ++tile) {
#pragma unroll
      for (int j = 0; j < 4; ++j) acc[tile][j] += part[tile][j];
    }
  }

#pragma unroll
  for (int tile = 0; tile < kTiles; ++tile) {
#pragma unroll
    for (int j = 0; j < 4; ++j) s_acc[warp][tile][j][lane] = acc[tile][j];
  }
  __syncthreads();
  // one thread per accumulator element: d[j] of lane l holds weight row g + 8 (j / 2), x row 2t + (j % 2)
  for (int idx = threadIdx.x; idx < kTiles * 4 * 32; idx += blockDim.x) {
    const int tile = idx / 128, j = idx / 32 % 4, l = idx % 32;
    const int n = n0 + l / 4 + (j / 2) * 8;
    const int m = tile * 8 + (l % 4) * 2 + j % 2;
    if (m >= p.m || n >= p.n) continue;
    float sum = 0.f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) sum += s_acc[w][tile][j][l];
    const float x_scale = kQuant ? s_scale[m] : p.x_scale[m * p.x_scale_stride];
    float v = sum * x_scale * p.w_scale[n * p.w_scale_stride];
    if (p.bias != nullptr) v += to_float(static_cast<const T*>(p.bias)[n]);
    static_cast<T*>(p.y)[m * p.y_stride + n] = from_float<T>(v);
  }
}

// Blocks of the one-tile kernel with kWarps warps resident on the GPU at once (the quant prologue's
// at its largest shared memory). Called after the prologue kernels' shared-memory limit is raised.
template <typename T, typename XIn, int kWarps>
int64_t stream_capacity() {
  static const int64_t blocks = resident_blocks(fp8_stream_mm_kernel<T, 1, XIn, kWarps>, kWarps * 32,
                                                std::is_same_v<XIn, uint8_t> ? 0 : kMaxQuantBytes);
  return blocks;
}

// One tile of x rows: 8 warps a block where all the launch's blocks are resident at once, else 4.
// Twice the loads in flight per block pays where the grid is small (a weight of 4096 rows: 256
// blocks, about two an SM); where the blocks would not fit in one wave, the second wave's tail
// costs more (docs/perf.md, "FP8 GEMMs by row count").
template <typename T, typename XIn>
void launch_fp8_stream_mm(const Fp8StreamParams& p) {
  const dim3 grid((p.n + kTileRows - 1) / kTileRows);
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  if constexpr (!std::is_same_v<XIn, uint8_t>) {
    // dynamic + static shared memory may pass the default 48 KiB: raise the kernels' dynamic limit
    // to kMaxQuantBytes, once per device (a function attribute, not a stream operation: capture-safe)
    static std::atomic<uint64_t> raised{0};  // bit d: done on device d (devices past 63: every call)
    const int device = c10::cuda::current_device();
    const uint64_t bit = device < 64 ? uint64_t{1} << device : 0;
    if (bit == 0 || (raised.load(std::memory_order_relaxed) & bit) == 0) {
      for (const auto kernel : {fp8_stream_mm_kernel<T, 1, XIn, 8>, fp8_stream_mm_kernel<T, 1, XIn, 4>}) {
        C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                            static_cast<int>(kMaxQuantBytes)));
      }
      raised.fetch_or(bit, std::memory_order_relaxed);
    }
    const size_t shared = static_cast<size_t>(p.m) * p.k;  // the quantized rows (<= kMaxQuantBytes: checked)
    if (grid.x <= stream_capacity<T, XIn, 8>()) {
      launch_kernel(fp8_stream_mm_kernel<T, 1, XIn, 8>, grid, dim3(8 * 32), shared, stream, p);
    } else {
      launch_kernel(fp8_stream_mm_kernel<T, 1, XIn, 4>, grid, dim3(4 * 32), shared, stream, p);
    }
  } else if (p.m <= 8 && grid.x <= stream_capacity<T, XIn, 8>()) {
    launch_kernel(fp8_stream_mm_kernel<T, 1, XIn, 8>, grid, dim3(8 * 32), 0, stream, p);
  } else if (p.m <= 8) {
    launch_kernel(fp8_stream_mm_kernel<T, 1, XIn, 4>, grid, dim3(4 * 32), 0, stream, p);
  } else {
    launch_kernel(fp8_stream_mm_kernel<T, 2, XIn, 4>, grid, dim3(4 * 32), 0, stream, p);
  }
}

template <typename T>
void dispatch_x(const Fp8StreamParams& p, at::ScalarType x_dtype) {
  switch (x_dtype) {
    case at::kFloat8_e4m3fn: launch_fp8_stream_mm<T, uint8_t>(p); break;
    case at::kBFloat16: launch_fp8_stream_mm<T, __nv_bfloat16>(p); break;
    case at::kHalf: launch_fp8_stream_mm<T, __half>(p); break;
    default: launch_fp8_stream_mm<T, float>(p); break;
  }
}

bool aligned16(const at::Tensor& t) { return reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0; }

}  // namespace

at::Tensor fp8_stream_mm(const at::Tensor& x, const std::optional<at::Tensor>& x_scale, const at::Tensor& weight,
                         const at::Tensor& weight_scale, const std::optional<at::Tensor>& bias,
                         at::ScalarType out_dtype) {
  const bool quant = !x_scale.has_value();
  TORCH_CHECK(x.is_cuda() && weight.device() == x.device() && weight_scale.device() == x.device() &&
                  (quant || x_scale->device() == x.device()),
              "fp8_stream_mm: x, x_scale, weight and weight_scale must be on one CUDA device, got x on ", x.device(),
              ", weight on ", weight.device(), ", weight_scale on ", weight_scale.device());
  const auto x_dtype = x.scalar_type();
  TORCH_CHECK(weight.scalar_type() == at::kFloat8_e4m3fn &&
                  (quant ? x_dtype == at::kBFloat16 || x_dtype == at::kHalf || x_dtype == at::kFloat
                         : x_dtype == at::kFloat8_e4m3fn),
              "fp8_stream_mm: weight must be float8_e4m3fn and x float8_e4m3fn (with x_scale) or bfloat16 / "
              "float16 / float32 (without: quantized per token here), got ", x_dtype, " and ", weight.scalar_type());
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && x.size(1) == weight.size(1),
              "fp8_stream_mm: x must be [M, K] and weight [N, K], got ", x.sizes(), " and ", weight.sizes());
  const int64_t m = x.size(0), n = weight.size(0), k = x.size(1);
  const int64_t elem = x.element_size();
  TORCH_CHECK(m <= kMaxRows, "fp8_stream_mm: at most ", kMaxRows, " rows, got ", m);
  TORCH_CHECK(!quant || (m <= kMaxQuantRows && m * k <= kMaxQuantBytes),
              "fp8_stream_mm: quantizing x in the kernel takes at most ", kMaxQuantRows, " rows and ",
              kMaxQuantBytes, " elements, got ", x.sizes());
  TORCH_CHECK(k > 0 && k % 16 == 0 && x.stride(1) == 1 && weight.stride(1) == 1 && (x.stride(0) * elem) % 16 == 0 &&
                  weight.stride(0) % 16 == 0 && aligned16(x) && aligned16(weight),
              "fp8_stream_mm: x and weight need contiguous, 16-byte aligned rows and K a positive multiple of 16, got "
              "K = ", k, ", strides ", x.strides(), " and ", weight.strides());
  TORCH_CHECK(weight_scale.scalar_type() == at::kFloat && weight_scale.is_contiguous() &&
                  (quant || (x_scale->scalar_type() == at::kFloat && x_scale->is_contiguous())),
              "fp8_stream_mm: the scales must be contiguous float32");
  TORCH_CHECK(quant || x_scale->numel() == m || x_scale->numel() == 1,
              "fp8_stream_mm: x_scale must hold one scale per row (", m, ") or one, got ", x_scale->sizes());
  TORCH_CHECK(weight_scale.numel() == n || weight_scale.numel() == 1,
              "fp8_stream_mm: weight_scale must hold one scale per output channel (", n, ") or one, got ",
              weight_scale.sizes());
  TORCH_CHECK(out_dtype == at::kBFloat16 || out_dtype == at::kHalf || out_dtype == at::kFloat,
              "fp8_stream_mm: out_dtype must be bfloat16, float16 or float32, got ", out_dtype);
  if (bias.has_value()) {
    TORCH_CHECK(bias->device() == x.device() && bias->scalar_type() == out_dtype && bias->numel() == n &&
                    bias->is_contiguous(),
                "fp8_stream_mm: bias must be a contiguous [", n, "] ", out_dtype, " tensor on ", x.device(), ", got ",
                bias->sizes(), " ", bias->scalar_type());
  }
  const c10::cuda::CUDAGuard guard(x.device());
  const auto* props = at::cuda::getCurrentDeviceProperties();
  TORCH_CHECK(props->major * 10 + props->minor >= 89, "fp8_stream_mm: needs FP8 tensor cores (sm_89+), got sm_",
              props->major, props->minor);
  at::Tensor out = at::empty({m, n}, x.options().dtype(out_dtype));
  if (m == 0 || n == 0) return out;
  Fp8StreamParams p{};
  p.x = static_cast<const uint8_t*>(x.data_ptr());
  p.x_stride = x.stride(0);
  p.x_scale = quant ? nullptr : x_scale->data_ptr<float>();
  p.x_scale_stride = quant || x_scale->numel() == 1 ? 0 : 1;
  p.w = static_cast<const uint8_t*>(weight.data_ptr());
  p.w_stride = weight.stride(0);
  p.w_scale = weight_scale.data_ptr<float>();
  p.w_scale_stride = weight_scale.numel() == 1 ? 0 : 1;
  p.bias = bias.has_value() ? bias->data_ptr() : nullptr;
  p.y = out.data_ptr();
  p.y_stride = out.stride(0);
  p.m = static_cast<int>(m);
  p.n = static_cast<int>(n);
  p.k = static_cast<int>(k);
  switch (out_dtype) {
    case at::kBFloat16: dispatch_x<__nv_bfloat16>(p, x_dtype); break;
    case at::kHalf: dispatch_x<__half>(p, x_dtype); break;
    default: dispatch_x<float>(p, x_dtype); break;
  }
  return out;
}

}  // namespace compilelm::cuda
