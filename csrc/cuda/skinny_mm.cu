// linear: y = x @ weight.T for one or two rows of x (decode at batch 1-2), CUDA cores, alone,
// after an RMSNorm (rms_norm_linear, fused_add_rms_norm_linear) or after SiLU-and-mul
// (silu_mul_linear).
//
// At M <= 2 a linear layer is a stream over its weight: every byte is read once and used for M
// multiply-adds. cuBLAS's tile choices leave bandwidth unused on some shapes. Here one
// warp computes one output column n (one row of weight) and walks it in steps of kLoads
// 16-byte loads per lane, multiplying each step with the matching slices of x (L1-cached: every
// warp reads the same x) before a warp reduction. Small steps keep registers low, so many warps
// are resident per SM and the memory system always has loads queued; kLoads and the warps per
// block come from a sweep over Llama-3.1-8B's and SmolLM2-135M's layer shapes
// (benchmarks/bench_skinny_mm.py compares with cuBLAS; docs/perf.md, "Weight streaming at 1-2
// rows").
//
// rms_norm_linear / fused_add_rms_norm_linear put the RMSNorm before a linear (and the
// residual add before it) into the same kernel. Each block first normalizes its rows into shared
// memory (x + residual rounded as the eager add rounds it, block 0 storing that sum as
// residual_out; a block reduction of the squares; the norm's roundings), with its first weight
// loads already in flight; then its warps stream their weight rows against the shared rows. The
// norm is redone per block (4 columns), not per warp: applying it per warp and chunk made the
// kernel ALU-bound.
//
// qkv_rope_cache / rms_norm_qkv_rope_cache / fused_add_rms_norm_qkv_rope_cache are the QKV
// projection with rope_and_cache in its epilogue (kRope): the output columns q | k | v never reach
// memory. A block's four warps compute the rotation pairs (j, j + 1, j + D/2, j + D/2 + 1) of one
// head; after the warp reductions two warps per row rotate the pairs (rope_and_cache's numbers:
// the projection rounded to T, cos/sin rounded to T, one rounding after the rotation) and write
// the query, or the key and value rows to their cache slot. Decode attention, launched next,
// starts at once and finds this step's cache rows after its wait. At 3-64 rows on sm_90 they run
// the norm kernel (if any), then hopper_mm_rope_out (compilelm/ops/hopper_gemm.py): the Hopper
// GEMM with the same rotation in its epilogue.
//
// silu_mul_linear takes the MLP's gate_up output [M, 2K] and applies SiLU-and-mul (eager's
// roundings, T(T(silu(gate)) * up), the exp in fast math) the same way: once per block, into
// shared memory, before the weight stream. (Applied per warp as each chunk was read, it cost
// more than the launch it saved.)
// The pass limits K: every block recomputes all K activations.
//
// linear_argmax_out is the LM head of a full decode graph with greedy sampling's argmax in the
// same kernel: the grid is one wave of resident blocks whose warps walk the vocabulary (a warp's
// next row's first loads go out before it reduces the current one); each warp keeps its best
// logit as a 64-bit key (the value's bits made orderable, then the inverted column: the larger key
// is the larger value, ties go to the lower column, NaN beats everything, -0 equals +0), each
// block merges its warps' keys into the row's running maximum with one atomicMax, and the last
// block to arrive writes the indices and zeroes the keys and the counter. The argmax is that of the
// logits as stored (rounded to T), so it equals argmax_rows of `out`. Without it the argmax is a
// kernel of its own after the graph, plus its launch gap.
//
// More than kMaxRows rows, or layouts the kernel does not take (unaligned, strided K, mixed
// dtypes, rows over kMaxSharedBytes), run the norm kernel of fused_ops.cpp for the norm ops, the
// SiLU-and-mul kernel for silu_mul_linear (as many kernels as the unfused graph), then the
// product (`product`: this file's plain kernel where it takes the rows, else decode_mm): on sm_90,
// 3-64 rows of a large weight to the Triton kernel of compilelm/ops/hopper_gemm.py
// (hopper_mm_out), else cuBLAS. The ops are correct for every
// input, the kernels are the fast path.
//
// gate_up_silu_mul is the MLP's other side, for intermediate sizes too large to recompute per
// block (Llama-3.1-8B's 14336): gate_up_proj with SiLU-and-mul after it. At 3-64 rows on sm_90
// hopper_mm_out's SiLU-and-mul epilogue does both in one kernel; elsewhere it is linear and the
// SiLU-and-mul kernel.
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/mm.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <ATen/cuda/CUDAContext.h>

#include "cuda/arrival_counters.h"
#include "cuda/attention_common.cuh"
#include "cuda/convert.cuh"
#include "cuda/cuda_ops.h"
#include "cuda/launch.cuh"
#include "cuda/launchers.h"

namespace compilelm::cuda {
namespace {

constexpr int kMaxRows = 2;   // M above this: cuBLAS (at M = 2 the kernel is already only level with it on 8B shapes)
constexpr int kWarps = 4;     // warps (output columns) per block
constexpr int kLoads = 4;     // 16-byte weight loads in flight per lane, per step
constexpr int64_t kMaxSharedBytes = 48 * 1024;  // the prologue variants' shared rows (M x K): the default limit

__device__ __forceinline__ uint4 load_weight(const void* ptr) {  // read once: keep it out of L1
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(ptr));
  return v;
}

// What the kernel applies to x before the GEMV: nothing, (add +) RMSNorm, or SiLU-and-mul.
enum class Prologue { kNone, kRms, kAddRms, kSiluMul };

struct SkinnyParams {
  const void* x;
  int64_t x_stride;
  const void* w;
  int64_t w_stride;
  void* y;
  int64_t y_stride;
  int n_cols, k;
  // the norm variants: y = rms_norm(x (+ residual)) @ w.T
  const void* residual = nullptr;
  int64_t residual_stride = 0;
  void* residual_out = nullptr;  // [M, k], contiguous
  const void* norm_weight = nullptr;
  float eps = 0.f;
};

// acc[m] += the dot product of the weight chunks in flight (wv: chunks base + 32 i of one row)
// with the same chunks of row m of the GEMV's input (load_x(m, c): 16 bytes).
template <typename T, int M, typename LoadX>
__device__ __forceinline__ void dot_step(const uint4 (&wv)[kLoads], int base, int chunks, const LoadX& load_x,
                                         float (&acc)[M]) {
  constexpr int kVec = 16 / sizeof(T);
#pragma unroll
  for (int i = 0; i < kLoads; ++i) {
    const int c = base + i * 32;
    if (c >= chunks) continue;
    float wf[kVec];
    widen<T>(wv[i], wf);
#pragma unroll
    for (int m = 0; m < M; ++m) {
      float xf[kVec];
      widen<T>(load_x(m, c), xf);
#pragma unroll
      for (int e = 0; e < kVec; ++e) acc[m] += xf[e] * wf[e];
    }
  }
}

// kRope: the column of `warp` in block b: the block holds rotation pairs j, j + 1 (warps 0, 1)
// and j + D/2, j + D/2 + 1 (warps 2, 3) of head b / (D / kWarps).
__device__ __forceinline__ int rope_column(int block, int warp, int head_size) {
  const int blocks_per_head = head_size / kWarps;
  const int j = block % blocks_per_head * 2 + warp % 2;
  return block / blocks_per_head * head_size + j + warp / 2 * (head_size / 2);
}

template <typename T, int M, Prologue kPro, bool kRope>
__global__ void __launch_bounds__(kWarps * 32) skinny_mm_kernel(const SkinnyParams p, const RopeCacheParams r) {
  static_assert(!kRope || kPro != Prologue::kSiluMul, "RoPE: the QKV projection's variants");
  constexpr int kVec = 16 / sizeof(T);
  extern __shared__ uint4 s_rows[];  // the prologue variants: the GEMV's input rows as T, [M][k]
  __shared__ float s_sum_sq[kWarps][M];
  __shared__ float s_pair[kWarps][M];  // kRope: the block's columns, rounded to T
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int n = kRope ? rope_column(blockIdx.x, warp, r.head_size) : blockIdx.x * kWarps + warp;
  const bool active = n < p.n_cols;  // (no early return: the norm's block syncs need every thread)
  const T* row = static_cast<const T*>(p.w) + static_cast<int64_t>(active ? n : 0) * p.w_stride;
  const int chunks = p.k / kVec;  // 16-byte chunks of one row

  uint4 wv[kLoads];
  const auto load_step = [&](int base) {
#pragma unroll
    for (int i = 0; i < kLoads; ++i) {
      const int c = base + i * 32;
      wv[i] = active && c < chunks ? load_weight(row + c * kVec) : make_uint4(0, 0, 0, 0);
    }
  };
  // The first weight loads go out before the PDL wait (launch.cuh: a weight is no kernel's
  // output), overlapping the kernel before; they stay in flight through the prologue. The norm
  // variants (QKV and gate_up projections) let their dependent start at once (launch.cuh). (kRope
  // without a norm does not: in a wide model decode attention's blocks would wait on SMs where the
  // QKV projection's stream; docs/perf.md, "Programmatic dependent launch (PDL)".)
  constexpr bool kEarlyDependents = kPro == Prologue::kRms || kPro == Prologue::kAddRms;
  if constexpr (kEarlyDependents) allow_dependent_kernels();
  load_step(lane);
  // kRope: lane m of warps 0 and 1 rotates row m's pair of this warp's column (j < D/2); its
  // slot, and cos/sin at its position rounded to T, are loaded before the wait (metadata)
  const bool rotates = kRope && warp < 2 && lane < M;
  int64_t rope_slot = -1;
  float rope_cos = 0.f, rope_sin = 0.f;
  if (rotates) {
    const int64_t at = r.positions[lane] * r.head_size + n % r.head_size;
    rope_slot = r.slot_mapping[lane];
    if (r.cos_sin_fp32) {
      rope_cos = round_to<T>(static_cast<const float*>(r.cos_sin_cache)[at]);
      rope_sin = round_to<T>(static_cast<const float*>(r.cos_sin_cache)[at + r.head_size / 2]);
    } else {
      rope_cos = to_float(static_cast<const T*>(r.cos_sin_cache)[at]);
      rope_sin = to_float(static_cast<const T*>(r.cos_sin_cache)[at + r.head_size / 2]);
    }
  }
  wait_for_prior_kernels();  // PDL (launch.cuh): before any read of earlier kernels' outputs
  if constexpr (!kEarlyDependents) allow_dependent_kernels();

  if constexpr (kPro == Prologue::kSiluMul) {  // x row: gate [k] | up [k] -> T(T(silu(gate)) * up)
#pragma unroll
    for (int m = 0; m < M; ++m) {
      const T* x_row = static_cast<const T*>(p.x) + m * p.x_stride;
      for (int c = threadIdx.x; c < chunks; c += blockDim.x) {
        float gate[kVec], up[kVec];
        widen<T>(__ldg(reinterpret_cast<const uint4*>(x_row + c * kVec)), gate);
        widen<T>(__ldg(reinterpret_cast<const uint4*>(x_row + p.k + c * kVec)), up);
        T out[kVec];
#pragma unroll
        for (int e = 0; e < kVec; ++e) {
          out[e] = from_float<T>(round_to<T>(__fdividef(gate[e], 1.f + __expf(-gate[e]))) * up[e]);
        }
        s_rows[m * chunks + c] = *reinterpret_cast<const uint4*>(out);
      }
    }
    __syncthreads();
  }

  if constexpr (kPro == Prologue::kRms || kPro == Prologue::kAddRms) {
    // pass 1: h = x (+ residual, rounded to T) into shared memory; sum of h^2 per row
    float sum_sq[M];
#pragma unroll
    for (int m = 0; m < M; ++m) {
      sum_sq[m] = 0.f;
      for (int c = threadIdx.x; c < chunks; c += blockDim.x) {
        float h[kVec];
        widen<T>(__ldg(reinterpret_cast<const uint4*>(static_cast<const T*>(p.x) + m * p.x_stride + c * kVec)), h);
        if constexpr (kPro == Prologue::kAddRms) {
          float r[kVec];
          widen<T>(__ldg(reinterpret_cast<const uint4*>(static_cast<const T*>(p.residual) + m * p.residual_stride +
                                                        c * kVec)), r);
#pragma unroll
          for (int e = 0; e < kVec; ++e) h[e] = round_to<T>(h[e] + r[e]);
        }
        T out[kVec];
#pragma unroll
        for (int e = 0; e < kVec; ++e) {
          sum_sq[m] += h[e] * h[e];
          out[e] = from_float<T>(h[e]);
        }
        const uint4 packed = *reinterpret_cast<const uint4*>(out);
        s_rows[m * chunks + c] = packed;
        if (kPro == Prologue::kAddRms && blockIdx.x == 0) {
          reinterpret_cast<uint4*>(static_cast<T*>(p.residual_out) + m * p.k)[c] = packed;
        }
      }
#pragma unroll
      for (int offset = 16; offset > 0; offset /= 2) sum_sq[m] += __shfl_xor_sync(0xffffffffu, sum_sq[m], offset);
      if (lane == 0) s_sum_sq[warp][m] = sum_sq[m];
    }
    __syncthreads();
    // pass 2: the norm in place, as compilelm.ops.norm.rms_norm rounds it: T(w * T(h * inv_rms))
#pragma unroll
    for (int m = 0; m < M; ++m) {
      float total = 0.f;
#pragma unroll
      for (int w = 0; w < kWarps; ++w) total += s_sum_sq[w][m];
      const float inv_rms = rsqrtf(total / p.k + p.eps);
      for (int c = threadIdx.x; c < chunks; c += blockDim.x) {  // the chunks this thread wrote
        float h[kVec], gamma[kVec];
        widen<T>(s_rows[m * chunks + c], h);
        widen<T>(__ldg(reinterpret_cast<const uint4*>(static_cast<const T*>(p.norm_weight) + c * kVec)), gamma);
        T out[kVec];
#pragma unroll
        for (int e = 0; e < kVec; ++e) out[e] = from_float<T>(gamma[e] * round_to<T>(h[e] * inv_rms));
        s_rows[m * chunks + c] = *reinterpret_cast<const uint4*>(out);
      }
    }
    __syncthreads();
  }
  if (!active) return;

  // chunk c of row m of the GEMV's input: x, its norm, or silu(gate) * up
  const auto load_x = [&](int m, int c) -> uint4 {
    if constexpr (kPro == Prologue::kNone) {
      return __ldg(reinterpret_cast<const uint4*>(static_cast<const T*>(p.x) + m * p.x_stride + c * kVec));
    } else {
      return s_rows[m * chunks + c];
    }
  };
  float acc[M];
#pragma unroll
  for (int m = 0; m < M; ++m) acc[m] = 0.f;
  for (int base = lane; base < chunks; base += 32 * kLoads) {
    if (base != lane) load_step(base);
    dot_step<T, M>(wv, base, chunks, load_x, acc);
  }
#pragma unroll
  for (int m = 0; m < M; ++m) {
#pragma unroll
    for (int offset = 16; offset > 0; offset /= 2) acc[m] += __shfl_xor_sync(0xffffffffu, acc[m], offset);
    if (lane == 0) {
      if constexpr (kRope) {
        s_pair[warp][m] = round_to<T>(acc[m]);
      } else {
        static_cast<T*>(p.y)[m * p.y_stride + n] = from_float<T>(acc[m]);
      }
    }
  }
  if constexpr (kRope) {  // (every warp of a kRope block is active: whole heads of columns)
    __syncthreads();
    if (!rotates) return;
    const int m = lane, head = n / r.head_size, j = n % r.head_size, half = r.head_size / 2;
    const float lo = s_pair[warp][m], hi = s_pair[warp + 2][m];
    T* dst;
    if (head < r.num_heads) {
      dst = static_cast<T*>(r.q_out) + (static_cast<int64_t>(m) * r.num_heads + head) * r.head_size;
    } else if (rope_slot >= 0 && rope_slot < r.num_slots) {
      const int kv = head - r.num_heads;  // key heads, then value heads
      dst = static_cast<T*>(kv < r.num_kv_heads ? r.key_cache : r.value_cache) +
            (rope_slot * r.num_kv_heads + kv % r.num_kv_heads) * r.head_size;
      if (kv >= r.num_kv_heads) {  // value: as it is
        dst[j] = from_float<T>(lo);
        dst[j + half] = from_float<T>(hi);
        return;
      }
    } else {
      return;  // padding row: no cache write
    }
    dst[j] = from_float<T>(rope_rotate(lo, hi, rope_cos, rope_sin, /*upper=*/false));
    dst[j + half] = from_float<T>(rope_rotate(hi, lo, rope_cos, rope_sin, /*upper=*/true));
  }
}


// The LM head's argmax (linear_argmax_out): each row's running maximum, and the count of the
// blocks that merged into it (arrival_counters.h: kLmHeadArgmax). (Spreading the blocks' atomics
// over 32 addresses gains nothing.)
struct ArgmaxSink {
  int* arrivals;             // zero between launches
  unsigned long long* keys;  // [kMaxRows], zero between launches
  int64_t* ids;              // [M]: the argmax of each row
};
constexpr int kArgmaxCounterInts = 2 + 2 * kMaxRows;  // the counter, then (8-byte aligned) the keys

// Orders (value, column) as argmax_rows does: larger value, then lower column; NaN is the maximum.
__device__ __forceinline__ unsigned long long argmax_key(float v, int n) {
  unsigned int bits = __float_as_uint(v == 0.f ? 0.f : v);  // -0 == +0
  bits = isnan(v) ? 0xffffffffu : (bits & 0x80000000u) ? ~bits : bits | 0x80000000u;
  return (static_cast<unsigned long long>(bits) << 32) | (0xffffffffu - static_cast<unsigned int>(n));
}

template <typename T, int M>
__global__ void __launch_bounds__(kWarps * 32) skinny_mm_argmax_kernel(const SkinnyParams p, const ArgmaxSink sink) {
  constexpr int kVec = 16 / sizeof(T);
  __shared__ unsigned long long s_best[kWarps][M];
  __shared__ bool s_last;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int stride = gridDim.x * kWarps, chunks = p.k / kVec;
  int n = blockIdx.x * kWarps + warp;  // this warp's columns: n, n + stride, ...
  const auto load_x = [&](int m, int c) {
    return __ldg(reinterpret_cast<const uint4*>(static_cast<const T*>(p.x) + m * p.x_stride + c * kVec));
  };
  uint4 wv[kLoads];
  const auto load_step = [&](int col, int base) {
    const T* row = static_cast<const T*>(p.w) + static_cast<int64_t>(col < p.n_cols ? col : 0) * p.w_stride;
#pragma unroll
    for (int i = 0; i < kLoads; ++i) {
      const int c = base + i * 32;
      wv[i] = col < p.n_cols && c < chunks ? load_weight(row + c * kVec) : make_uint4(0, 0, 0, 0);
    }
  };
  load_step(n, lane);  // before the PDL wait, as skinny_mm_kernel
  wait_for_prior_kernels();
  allow_dependent_kernels();
  unsigned long long best[M];
#pragma unroll
  for (int m = 0; m < M; ++m) best[m] = 0;
  for (; n < p.n_cols; n += stride) {
    float acc[M];
#pragma unroll
    for (int m = 0; m < M; ++m) acc[m] = 0.f;
    for (int base = lane; base < chunks; base += 32 * kLoads) {
      if (base != lane) load_step(n, base);
      dot_step<T, M>(wv, base, chunks, load_x, acc);
    }
    load_step(n + stride, lane);  // the next column's first loads fly during this one's reduction
#pragma unroll
    for (int m = 0; m < M; ++m) {
#pragma unroll
      for (int offset = 16; offset > 0; offset /= 2) acc[m] += __shfl_xor_sync(0xffffffffu, acc[m], offset);
      if (lane == 0) {
        const T y = from_float<T>(acc[m]);
        static_cast<T*>(p.y)[m * p.y_stride + n] = y;
        best[m] = max(best[m], argmax_key(to_float(y), n));
      }
    }
  }
  if (lane == 0) {
#pragma unroll
    for (int m = 0; m < M; ++m) s_best[warp][m] = best[m];
  }
  __syncthreads();
  if (threadIdx.x == 0) {
#pragma unroll
    for (int m = 0; m < M; ++m) {
      unsigned long long b = s_best[0][m];
#pragma unroll
      for (int w = 1; w < kWarps; ++w) b = max(b, s_best[w][m]);
      if (b != 0) atomicMax(sink.keys + m, b);
    }
    __threadfence();  // the keys before the count (release)
    s_last = atomicAdd(sink.arrivals, 1) == static_cast<int>(gridDim.x) - 1;
  }
  __syncthreads();
  if (!s_last) return;
  if (threadIdx.x < M) {  // every block's atomicMax came before its count: the keys are final
    const unsigned long long key = atomicExch(sink.keys + threadIdx.x, 0ull);  // read, and zero for the next launch
    sink.ids[threadIdx.x] = 0xffffffffu - static_cast<unsigned int>(key & 0xffffffffu);
  }
  if (threadIdx.x == 0) *sink.arrivals = 0;
}

template <typename T, Prologue kPro, bool kRope = false>
void launch(const SkinnyParams& p, int64_t rows, const RopeCacheParams& r = {}) {
  const dim3 grid((p.n_cols + kWarps - 1) / kWarps), block(kWarps * 32);
  const size_t shared = kPro == Prologue::kNone ? 0 : rows * p.k * sizeof(T);  // <= kMaxSharedBytes
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  if (rows == 1) {
    launch_kernel(skinny_mm_kernel<T, 1, kPro, kRope>, grid, block, shared, stream, p, r);
  } else {
    launch_kernel(skinny_mm_kernel<T, 2, kPro, kRope>, grid, block, shared, stream, p, r);
  }
}

// One wave: as many blocks as are resident at once (fewer if the columns run out first).
template <typename T, int M>
void launch_argmax_rows(const SkinnyParams& p, const ArgmaxSink& sink, cudaStream_t stream) {
  static const int64_t wave = resident_blocks(skinny_mm_argmax_kernel<T, M>, kWarps * 32, 0);  // per instance
  const dim3 grid(static_cast<unsigned>(std::min<int64_t>((p.n_cols + kWarps - 1) / kWarps, wave)));
  launch_kernel(skinny_mm_argmax_kernel<T, M>, grid, dim3(kWarps * 32), 0, stream, p, sink);
}

template <typename T>
void launch_argmax(const SkinnyParams& p, const ArgmaxSink& sink, int64_t rows, cudaStream_t stream) {
  if (rows == 1) {
    launch_argmax_rows<T, 1>(p, sink, stream);
  } else {
    launch_argmax_rows<T, 2>(p, sink, stream);
  }
}

template <Prologue kPro, bool kRope = false>
void dispatch(const SkinnyParams& p, at::ScalarType dtype, int64_t rows, const RopeCacheParams& r = {}) {
  switch (dtype) {
    case at::kBFloat16: return launch<__nv_bfloat16, kPro, kRope>(p, rows, r);
    case at::kHalf: return launch<__half, kPro, kRope>(p, rows, r);
    default: return launch<float, kPro, kRope>(p, rows, r);
  }
}

bool aligned_rows(const at::Tensor& t) {  // rows of whole, aligned 16-byte vectors
  const int64_t vec = 16 / t.element_size();
  return t.stride(1) == 1 && t.stride(0) % vec == 0 && t.size(1) % vec == 0 &&
         reinterpret_cast<uintptr_t>(t.const_data_ptr()) % 16 == 0;
}

void check_mm(const at::Tensor& x, const at::Tensor& weight, const char* op) {
  TORCH_CHECK(x.is_cuda() && weight.device() == x.device(), op, ": x and weight must be on one CUDA device, got ",
              x.device(), " and ", weight.device());
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && x.size(1) == weight.size(1), op,
              ": x must be [M, K] and weight [N, K], got ", x.sizes(), " and ", weight.sizes());
  TORCH_CHECK(x.scalar_type() == weight.scalar_type(), op, ": x and weight must have one dtype, got ",
              x.scalar_type(), " and ", weight.scalar_type());
}

void linear_out_check(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& out, const char* op) {
  TORCH_CHECK(out.device() == x.device() && out.scalar_type() == x.scalar_type() && out.dim() == 2 &&
                  out.size(0) == x.size(0) && out.size(1) == weight.size(0) && out.stride(1) == 1,
              op, ": out must be [", x.size(0), ", ", weight.size(0), "] ", x.scalar_type(), " on ", x.device(),
              " with contiguous rows, got ", out.sizes(), " ", out.scalar_type(), " on ", out.device(),
              " with strides ", out.strides());
}

// The kernel takes x and weight: M <= kMaxRows, a dtype it has, whole aligned 16-byte rows.
bool fast_path(const at::Tensor& x, const at::Tensor& weight) {
  const auto dtype = x.scalar_type();
  return x.size(0) >= 1 && x.size(0) <= kMaxRows && weight.size(0) >= 1 && weight.size(0) < (int64_t{1} << 31) &&
         weight.size(1) < (int64_t{1} << 31) && (dtype == at::kBFloat16 || dtype == at::kHalf || dtype == at::kFloat) &&
         aligned_rows(x) && aligned_rows(weight);
}

// compilelm::hopper_mm_out (compilelm/ops/hopper_gemm.py: Triton, TMA + wgmma, PDL), looked up once.
const c10::TypedOperatorHandle<void(const at::Tensor&, const at::Tensor&, const at::Tensor&, bool, bool)>&
hopper_mm_op() {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("compilelm::hopper_mm_out", "")
                             .typed<void(const at::Tensor&, const at::Tensor&, const at::Tensor&, bool, bool)>();
  return op;
}

// compilelm::hopper_mm_rope_out (the same kernel with RoPE in its epilogue), looked up once.
using HopperRopeFn = void(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                          const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, bool);
const c10::TypedOperatorHandle<HopperRopeFn>& hopper_rope_op() {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("compilelm::hopper_mm_rope_out", "")
                             .typed<HopperRopeFn>();
  return op;
}

// The Hopper kernels take the rows above kMaxRows up to 64 on sm_90 for weights of at least 8M
// elements and K >= 1024 (a few K steps per block gained nothing: SmolLM2-135M's LM head), where
// their CUDA kernels are registered (Triton importable) and set_hopper_gemm has not turned them off.
bool hopper_gemm_takes(const at::Tensor& x, const at::Tensor& weight) {
  const auto dtype = x.scalar_type();
  const auto tma_rows = [](const at::Tensor& t) {  // a TMA descriptor's layout: unit stride, 16-byte rows
    return t.stride(1) == 1 && (t.stride(0) * t.element_size()) % 16 == 0 &&
           reinterpret_cast<uintptr_t>(t.const_data_ptr()) % 16 == 0;
  };
  return hopper_gemm_enabled() && x.size(0) > kMaxRows && x.size(0) <= 64 && weight.size(1) >= 1024 &&
         weight.size(0) * weight.size(1) >= (int64_t{8} << 20) && (dtype == at::kBFloat16 || dtype == at::kHalf) &&
         tma_rows(x) && tma_rows(weight) && at::cuda::getCurrentDeviceProperties()->major == 9 &&
         hopper_mm_op().hasKernelForDispatchKey(c10::DispatchKey::CUDA);
}

// hopper_mm_out: out [M, N], or [M, N / 2] for its SiLU-and-mul epilogue, in x's dtype.
bool hopper_mm_takes(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& out) {
  return out.scalar_type() == x.scalar_type() && out.stride(1) == 1 && hopper_gemm_takes(x, weight);
}

// hopper_mm_rope_out: caches of x's dtype, contiguous, head_size a multiple of 64 (blocks of 32
// rotation pairs).
bool hopper_rope_takes(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& key_cache,
                       const at::Tensor& value_cache) {
  return key_cache.size(3) % 64 == 0 && key_cache.scalar_type() == x.scalar_type() &&
         value_cache.scalar_type() == x.scalar_type() && key_cache.is_contiguous() && value_cache.is_contiguous() &&
         hopper_gemm_takes(x, weight);
}

// x @ weight.T into out (allocated if undefined) where the kernel here does not take the rows:
// hopper_mm_out where it takes them, else cuBLAS.
at::Tensor decode_mm(const at::Tensor& x, const at::Tensor& weight, at::Tensor out = at::Tensor()) {
  if (!out.defined()) out = at::empty({x.size(0), weight.size(0)}, x.options());
  if (hopper_mm_takes(x, weight, out)) {
    hopper_mm_op().call(x, weight, out, programmatic_launch_enabled(), /*silu_mul=*/false);
  } else {
    at::mm_out(out, x, weight.t());
  }
  return out;
}

SkinnyParams mm_params(const at::Tensor& x, const at::Tensor& weight, at::Tensor& y) {
  SkinnyParams p{};
  p.x = x.const_data_ptr();
  p.x_stride = x.stride(0);
  p.w = weight.const_data_ptr();
  p.w_stride = weight.stride(0);
  p.y = y.mutable_data_ptr();
  p.y_stride = y.stride(0);
  p.n_cols = static_cast<int>(weight.size(0));
  p.k = static_cast<int>(weight.size(1));
  return p;
}

// linear's kernel where it takes x (M <= 2), else decode_mm: the product after a fused op's
// first kernel where its one kernel does not take the call.
at::Tensor product(const at::Tensor& x, const at::Tensor& weight) {
  if (!fast_path(x, weight)) return decode_mm(x, weight);
  const c10::cuda::CUDAGuard guard(x.device());
  at::Tensor y = at::empty({x.size(0), weight.size(0)}, x.options());
  dispatch<Prologue::kNone>(mm_params(x, weight, y), x.scalar_type(), x.size(0));
  return y;
}

// Checks a norm op's arguments; true where its kernel takes them (else the norm kernel and product).
bool norm_mm_fuses(const at::Tensor& x, const at::Tensor* residual, const at::Tensor& norm_weight,
                   const at::Tensor& weight, const char* op) {
  check_mm(x, weight, op);
  TORCH_CHECK(norm_weight.device() == x.device() && norm_weight.dim() == 1 && norm_weight.size(0) == x.size(1) &&
                  norm_weight.scalar_type() == x.scalar_type(),
              op, ": norm_weight must be [", x.size(1), "] ", x.scalar_type(), " on ", x.device(), ", got ",
              norm_weight.sizes(), " ", norm_weight.scalar_type(), " on ", norm_weight.device());
  if (residual != nullptr) {
    TORCH_CHECK(residual->sizes() == x.sizes() && residual->scalar_type() == x.scalar_type() &&
                    residual->device() == x.device(),
                op, ": residual must match x (", x.sizes(), " ", x.scalar_type(), "), got ", residual->sizes(), " ",
                residual->scalar_type(), " on ", residual->device());
  }
  return fast_path(x, weight) && (residual == nullptr || aligned_rows(*residual)) && norm_weight.stride(0) == 1 &&
         reinterpret_cast<uintptr_t>(norm_weight.const_data_ptr()) % 16 == 0 &&
         x.size(0) * x.size(1) * x.element_size() <= kMaxSharedBytes;
}

// rms_norm(x (+ residual)) @ weight.T -> (y, residual_out or undefined). With `rope` (where
// norm_mm_fuses) the kernel leaves y unwritten: its epilogue rotates the columns q | k | v as
// rope_and_cache with those params would.
std::tuple<at::Tensor, at::Tensor> norm_mm(const at::Tensor& x, const at::Tensor* residual,
                                           const at::Tensor& norm_weight, double eps, const at::Tensor& weight,
                                           const char* op, const RopeCacheParams* rope = nullptr) {
  if (!norm_mm_fuses(x, residual, norm_weight, weight, op)) {  // the norm kernel, then the product
    if (residual == nullptr) return {product(rms_norm(x, norm_weight, eps), weight), at::Tensor()};
    auto [normed, residual_out] = fused_add_rms_norm(x, *residual, norm_weight, eps);
    return {product(normed, weight), residual_out};
  }
  const c10::cuda::CUDAGuard guard(x.device());
  at::Tensor y = at::empty({x.size(0), weight.size(0)}, x.options());  // (with rope: not written)
  SkinnyParams p = mm_params(x, weight, y);
  p.norm_weight = norm_weight.const_data_ptr();
  p.eps = static_cast<float>(eps);
  at::Tensor residual_out;
  if (residual != nullptr) {
    residual_out = at::empty(x.sizes(), x.options());
    p.residual = residual->const_data_ptr();
    p.residual_stride = residual->stride(0);
    p.residual_out = residual_out.mutable_data_ptr();
  }
  const auto dtype = x.scalar_type();
  const int64_t rows = x.size(0);
  if (rope == nullptr) {
    residual == nullptr ? dispatch<Prologue::kRms>(p, dtype, rows) : dispatch<Prologue::kAddRms>(p, dtype, rows);
  } else {
    residual == nullptr ? dispatch<Prologue::kRms, true>(p, dtype, rows, *rope)
                        : dispatch<Prologue::kAddRms, true>(p, dtype, rows, *rope);
  }
  return {y, residual_out};
}

// The QKV projection (of rms_norm(x (+ residual)) where norm_weight is given, else of x) with
// rope_and_cache after it: (rotated q [M, num_heads, head_size], residual_out or undefined). One
// kernel where this file's kernel takes the call (kRope; the norm variants where norm_mm_fuses).
// Else the norm kernel (if any), then hopper_mm_rope_out where it takes the rows, else the
// product and rope_and_cache of its q | k | v.
std::tuple<at::Tensor, at::Tensor> mm_rope(const at::Tensor& x, const at::Tensor* residual,
                                           const at::Tensor* norm_weight, double eps, const at::Tensor& weight,
                                           const at::Tensor& positions, const at::Tensor& cos_sin_cache,
                                           at::Tensor& key_cache, at::Tensor& value_cache,
                                           const at::Tensor& slot_mapping, int64_t num_heads, const char* op) {
  TORCH_CHECK(key_cache.dim() == 4, op, ": key_cache must be [num_blocks, block_size, num_kv_heads, head_size], got ",
              key_cache.sizes());
  TORCH_CHECK(key_cache.scalar_type() != at::kFloat8_e4m3fn, op, ": fp8 KV caches are written by rope_and_cache "
              "(with the layer's scales); the QKV graph ops route them there (compilelm/ops/qkv_rope.py)");
  const int64_t head_size = key_cache.size(3), kv_width = key_cache.size(2) * head_size;
  TORCH_CHECK(num_heads > 0 && weight.dim() == 2 && weight.size(0) == num_heads * head_size + 2 * kv_width, op,
              ": weight must be [(num_heads + 2 * num_kv_heads) * head_size, K] = [", num_heads * head_size + 2 * kv_width,
              ", K] (num_heads ", num_heads, ", the cache's num_kv_heads and head_size), got ", weight.sizes());
  if (norm_weight == nullptr) check_mm(x, weight, op);
  const bool one_kernel =
      norm_weight != nullptr ? norm_mm_fuses(x, residual, *norm_weight, weight, op) : fast_path(x, weight);
  at::Tensor h = x, residual_out;  // the projection's input
  if (!one_kernel && norm_weight != nullptr) {
    if (residual == nullptr) {
      h = rms_norm(x, *norm_weight, eps);
    } else {
      std::tie(h, residual_out) = fused_add_rms_norm(x, *residual, *norm_weight, eps);
    }
  }
  const bool hopper = !one_kernel && hopper_rope_takes(h, weight, key_cache, value_cache);
  // (with one of the kernels qkv is never written: rope_and_cache's checks see its views)
  const at::Tensor qkv =
      one_kernel || hopper ? at::empty({x.size(0), weight.size(0)}, x.options()) : product(h, weight);
  const auto parts = qkv.split_with_sizes({num_heads * head_size, kv_width, kv_width}, 1);
  const at::Tensor query = parts[0].view({x.size(0), num_heads, head_size});
  RopeCacheCall call = rope_cache_call(positions, query, parts[1].view({x.size(0), -1, head_size}),
                                       parts[2].view({x.size(0), -1, head_size}), cos_sin_cache, std::nullopt,
                                       std::nullopt, 0.0, key_cache, value_cache, slot_mapping);
  const c10::cuda::CUDAGuard guard(x.device());
  if (!one_kernel && !hopper) return {run_rope_and_cache(call, query), residual_out};
  at::Tensor q_out = at::empty(query.sizes(), query.options());
  if (hopper) {
    hopper_rope_op().call(h, weight, call.positions, call.cos_sin_cache, key_cache, value_cache, call.slot_mapping,
                          q_out, programmatic_launch_enabled());
    return {q_out, residual_out};
  }
  call.params.q_out = q_out.mutable_data_ptr();
  if (norm_weight != nullptr) {
    residual_out = std::get<1>(norm_mm(x, residual, *norm_weight, eps, weight, op, &call.params));
  } else {
    at::Tensor y = qkv;  // (a handle: never written)
    dispatch<Prologue::kNone, true>(mm_params(x, weight, y), x.scalar_type(), x.size(0), call.params);
  }
  return {q_out, residual_out};
}

}  // namespace

at::Tensor linear(const at::Tensor& x, const at::Tensor& weight) {
  check_mm(x, weight, "linear");
  return product(x, weight);
}

void linear_out(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& out) {
  check_mm(x, weight, "linear_out");
  linear_out_check(x, weight, out, "linear_out");
  at::Tensor y = out;  // (a handle: the kernels and cuBLAS write out's memory)
  if (!fast_path(x, weight)) {
    decode_mm(x, weight, y);
    return;
  }
  const c10::cuda::CUDAGuard guard(x.device());
  dispatch<Prologue::kNone>(mm_params(x, weight, y), x.scalar_type(), x.size(0));
}

void linear_argmax_out(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& out,
                          const at::Tensor& argmax) {
  check_mm(x, weight, "linear_argmax_out");
  TORCH_CHECK(argmax.device() == x.device() && argmax.scalar_type() == at::kLong && argmax.dim() == 1 &&
                  argmax.size(0) == x.size(0) && argmax.stride(0) == 1,
              "linear_argmax_out: argmax must be int64 [", x.size(0), "] contiguous on ", x.device(), ", got ",
              argmax.sizes(), " ", argmax.scalar_type(), " on ", argmax.device());
  const c10::cuda::CUDAGuard guard(x.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  int* counters = fast_path(x, weight) ? arrival_counters(CounterUser::kLmHeadArgmax, kArgmaxCounterInts, stream)
                                       : nullptr;  // null also while capturing before the first call
  if (counters == nullptr) {  // cuBLAS or the plain kernel, then argmax_rows: two kernels
    compilelm::cuda::linear_out(x, weight, out);  // (qualified: ADL would also find at::linear_out)
    argmax_rows_into(out, argmax);
    return;
  }
  linear_out_check(x, weight, out, "linear_argmax_out");
  at::Tensor y = out, ids = argmax;  // (handles: the kernel writes their memory)
  const SkinnyParams p = mm_params(x, weight, y);
  const ArgmaxSink sink{counters, reinterpret_cast<unsigned long long*>(counters + 2), ids.mutable_data_ptr<int64_t>()};
  switch (x.scalar_type()) {
    case at::kBFloat16: return launch_argmax<__nv_bfloat16>(p, sink, x.size(0), stream);
    case at::kHalf: return launch_argmax<__half>(p, sink, x.size(0), stream);
    default: return launch_argmax<float>(p, sink, x.size(0), stream);
  }
}

at::Tensor rms_norm_linear(const at::Tensor& x, const at::Tensor& norm_weight, double eps,
                              const at::Tensor& weight) {
  return std::get<0>(norm_mm(x, nullptr, norm_weight, eps, weight, "rms_norm_linear"));
}

std::tuple<at::Tensor, at::Tensor> fused_add_rms_norm_linear(const at::Tensor& x, const at::Tensor& residual,
                                                                const at::Tensor& norm_weight, double eps,
                                                                const at::Tensor& weight) {
  return norm_mm(x, &residual, norm_weight, eps, weight, "fused_add_rms_norm_linear");
}

at::Tensor silu_mul_linear(const at::Tensor& x, const at::Tensor& weight) {
  TORCH_CHECK(x.is_cuda() && weight.device() == x.device(), "silu_mul_linear: x and weight must be on one CUDA "
              "device, got ", x.device(), " and ", weight.device());
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && x.size(1) == 2 * weight.size(1),
              "silu_mul_linear: x must be [M, 2K] (gate | up) and weight [N, K], got ", x.sizes(), " and ",
              weight.sizes());
  TORCH_CHECK(x.scalar_type() == weight.scalar_type(), "silu_mul_linear: x and weight must have one dtype, got ",
              x.scalar_type(), " and ", weight.scalar_type());
  if (!fast_path(x, weight) || x.size(0) * weight.size(1) * x.element_size() > kMaxSharedBytes) {
    return product(silu_and_mul(x), weight);  // two kernels, as unfused
  }
  const c10::cuda::CUDAGuard guard(x.device());
  at::Tensor y = at::empty({x.size(0), weight.size(0)}, x.options());
  dispatch<Prologue::kSiluMul>(mm_params(x, weight, y), x.scalar_type(), x.size(0));
  return y;
}

at::Tensor gate_up_silu_mul(const at::Tensor& x, const at::Tensor& weight) {
  check_mm(x, weight, "gate_up_silu_mul");
  TORCH_CHECK(weight.size(0) % 2 == 0, "gate_up_silu_mul: weight must be [2I, K] (gate | up), got ", weight.sizes());
  const c10::cuda::CUDAGuard guard(x.device());
  at::Tensor out = at::empty({x.size(0), weight.size(0) / 2}, x.options());
  if (!hopper_mm_takes(x, weight, out)) return silu_and_mul(product(x, weight));  // two kernels, as unfused
  hopper_mm_op().call(x, weight, out, programmatic_launch_enabled(), /*silu_mul=*/true);
  return out;
}

at::Tensor qkv_rope_cache(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& positions,
                          const at::Tensor& cos_sin_cache, at::Tensor& key_cache, at::Tensor& value_cache,
                          const at::Tensor& slot_mapping, int64_t num_heads) {
  return std::get<0>(mm_rope(x, nullptr, nullptr, 0.0, weight, positions, cos_sin_cache, key_cache, value_cache,
                             slot_mapping, num_heads, "qkv_rope_cache"));
}

at::Tensor rms_norm_qkv_rope_cache(const at::Tensor& x, const at::Tensor& norm_weight, double eps,
                                   const at::Tensor& weight, const at::Tensor& positions,
                                   const at::Tensor& cos_sin_cache, at::Tensor& key_cache, at::Tensor& value_cache,
                                   const at::Tensor& slot_mapping, int64_t num_heads) {
  return std::get<0>(mm_rope(x, nullptr, &norm_weight, eps, weight, positions, cos_sin_cache, key_cache, value_cache,
                             slot_mapping, num_heads, "rms_norm_qkv_rope_cache"));
}

std::tuple<at::Tensor, at::Tensor> fused_add_rms_norm_qkv_rope_cache(
    const at::Tensor& x, const at::Tensor& residual, const at::Tensor& norm_weight, double eps,
    const at::Tensor& weight, const at::Tensor& positions, const at::Tensor& cos_sin_cache, at::Tensor& key_cache,
    at::Tensor& value_cache, const at::Tensor& slot_mapping, int64_t num_heads) {
  return mm_rope(x, &residual, &norm_weight, eps, weight, positions, cos_sin_cache, key_cache, value_cache,
                 slot_mapping, num_heads, "fused_add_rms_norm_qkv_rope_cache");
}

}  // namespace compilelm::cuda
