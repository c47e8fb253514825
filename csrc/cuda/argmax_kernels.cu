// argmax_rows: the index of each row's first maximum (NaN counts as the maximum, as in torch's
// argmax) in one kernel, for greedy sampling.
//
// Block (chunk, row) reduces a chunk of its row's columns to (value, index); with more than one
// chunk it writes that partial, counts its arrival in the row's counter, and the last block of
// the row to arrive resets the counter and merges the row's partials. torch's argmax spreads one
// row over few blocks, and a two-stage max then argmax takes five kernels, between the LM head
// and the copy of the tokens to the host.
// Rows that start 16-byte aligned are read 16 bytes a load, in 8192-column chunks where the rows
// still give two blocks an SM (docs/perf.md, "The LM head and greedy argmax").
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <climits>

#include "cuda/arrival_counters.h"
#include "cuda/convert.cuh"
#include "cuda/cuda_ops.h"
#include "cuda/fused_common.cuh"
#include "cuda/launch.cuh"

namespace compilelm::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kChunk = 2048;      // columns per block: 24 blocks for one row of SmolLM2's 49,152 logits
constexpr int kWideChunk = 8192;  // with 16-byte loads and enough rows: four loads in flight a thread

struct Best {
  float value;
  int index;
};

// a beats b: a NaN beats a number, then the larger value, then (ties, two NaNs) the lower index
__device__ __forceinline__ bool beats(const Best& a, const Best& b) {
  const bool a_nan = isnan(a.value), b_nan = isnan(b.value);
  if (a_nan != b_nan) return a_nan;
  if (!a_nan && a.value != b.value) return a.value > b.value;
  return a.index < b.index;
}

// The block's best; every thread gets it.
__device__ Best block_best(Best best) {
  __shared__ Best s_best[kThreads / 32];
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) {
    const Best other{__shfl_xor_sync(0xffffffffu, best.value, offset), __shfl_xor_sync(0xffffffffu, best.index, offset)};
    if (beats(other, best)) best = other;
  }
  if (threadIdx.x % 32 == 0) s_best[threadIdx.x / 32] = best;
  __syncthreads();
  best = s_best[0];
#pragma unroll
  for (int w = 1; w < kThreads / 32; ++w) {
    if (beats(s_best[w], best)) best = s_best[w];
  }
  __syncthreads();  // s_best may be reused
  return best;
}

struct ArgmaxParams {
  const void* x;  // [rows, vocab], row stride in elements
  int64_t row_stride;
  int vocab, chunks, chunk_cols;  // chunks of chunk_cols columns per row
  float* partial_value;  // [rows, chunks] (chunks > 1)
  int* partial_index;
  int* arrivals;         // [rows] counters, zero between launches (chunks > 1)
  int64_t* out;          // [rows]
};

template <typename T, int kVec>
__global__ void __launch_bounds__(kThreads) argmax_rows_kernel(const ArgmaxParams p) {
  __shared__ bool s_last;
  const int chunk = blockIdx.x, row = blockIdx.y;
  wait_for_prior_kernels();  // PDL (launch.cuh): before any read of earlier kernels' outputs
  allow_dependent_kernels();
  const T* x = static_cast<const T*>(p.x) + row * p.row_stride;
  const int span = p.chunks == 1 ? p.vocab : p.chunk_cols;  // one chunk: the whole row
  const int begin = chunk * span, end = min(p.vocab, begin + span);
  Best best{-INFINITY, INT_MAX};
  int c = begin;
  if constexpr (kVec > 1) {  // 16-byte loads (the row starts 16-byte aligned, begin is a multiple of kVec)
    const int vec_end = begin + (end - begin) / (kThreads * kVec) * (kThreads * kVec);
#pragma unroll 4
    for (int v = begin + threadIdx.x * kVec; v < vec_end; v += kThreads * kVec) {
      const Vec<T, kVec> values = *reinterpret_cast<const Vec<T, kVec>*>(x + v);
#pragma unroll
      for (int i = 0; i < kVec; ++i) {  // (in index order: a tie keeps the first)
        const Best here{to_float(values.v[i]), v + i};
        if (beats(here, best)) best = here;
      }
    }
    c = vec_end;
  }
  for (c += threadIdx.x; c < end; c += kThreads) {
    const Best here{to_float(x[c]), c};
    if (beats(here, best)) best = here;
  }
  best = block_best(best);
  if (p.chunks == 1) {
    if (threadIdx.x == 0) p.out[row] = best.index;
    return;
  }
  const int64_t partial = static_cast<int64_t>(row) * p.chunks;
  if (threadIdx.x == 0) {
    p.partial_value[partial + chunk] = best.value;
    p.partial_index[partial + chunk] = best.index;
    __threadfence();  // the partial before the count (release)
    s_last = atomicAdd(&p.arrivals[row], 1) == p.chunks - 1;
    if (s_last) {
      p.arrivals[row] = 0;  // for the next launch
      __threadfence();    // the count before the other blocks' partials (acquire)
    }
  }
  __syncthreads();
  if (!s_last) return;
  best = Best{-INFINITY, INT_MAX};
  for (int c = threadIdx.x; c < p.chunks; c += kThreads) {
    const Best other{__ldcg(p.partial_value + partial + c), __ldcg(p.partial_index + partial + c)};
    if (beats(other, best)) best = other;
  }
  best = block_best(best);
  if (threadIdx.x == 0) p.out[row] = best.index;
}

}  // namespace

void argmax_rows_into(const at::Tensor& x, const at::Tensor& out) {
  TORCH_CHECK(x.is_cuda() && x.dim() == 2 && x.size(1) > 0 && x.stride(1) == 1,
              "argmax_rows: x must be a CUDA tensor [rows, vocab] (vocab > 0, columns contiguous), got ", x.sizes(),
              " with strides ", x.strides());
  TORCH_CHECK(x.size(1) < INT_MAX, "argmax_rows: vocab must be below 2^31, got ", x.size(1));
  TORCH_CHECK(x.size(0) <= 65535, "argmax_rows: at most 65535 rows, got ", x.size(0));
  TORCH_CHECK(out.device() == x.device() && out.scalar_type() == at::kLong && out.dim() == 1 &&
                  out.size(0) == x.size(0) && out.stride(0) == 1,
              "argmax_rows: out must be int64 [", x.size(0), "] contiguous on ", x.device(), ", got ", out.sizes(), " ",
              out.scalar_type(), " on ", out.device());
  const c10::cuda::CUDAGuard guard(x.device());
  const int64_t rows = x.size(0);
  if (rows == 0) return;
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  at::Tensor ids = out;  // (a handle: the kernel writes out's memory)
  // 16-byte loads where every row starts 16-byte aligned (chunk_cols is a multiple of 8); wide
  // chunks where the rows still give two blocks an SM
  const bool vec = reinterpret_cast<uintptr_t>(x.data_ptr()) % 16 == 0 && (x.stride(0) * x.element_size()) % 16 == 0;
  const int64_t wide_blocks = rows * ((x.size(1) + kWideChunk - 1) / kWideChunk);
  const int chunk_cols = vec && wide_blocks >= 2 * at::cuda::getCurrentDeviceProperties()->multiProcessorCount
                             ? kWideChunk : kChunk;
  ArgmaxParams p{x.data_ptr(), x.stride(0), static_cast<int>(x.size(1)), 1, chunk_cols, nullptr, nullptr, nullptr,
                 ids.mutable_data_ptr<int64_t>()};
  const int chunks = static_cast<int>((x.size(1) + chunk_cols - 1) / chunk_cols);
  at::Tensor workspace;
  if (chunks > 1) {
    p.arrivals = arrival_counters(CounterUser::kArgmax, rows, stream);  // null: one block per row
    if (p.arrivals != nullptr) {
      p.chunks = chunks;
      workspace = at::empty({2 * rows * chunks}, x.options().dtype(at::kFloat));  // caching allocator: capture-safe
      p.partial_value = workspace.mutable_data_ptr<float>();
      p.partial_index = reinterpret_cast<int*>(p.partial_value + rows * chunks);
    }
  }
  const dim3 grid(static_cast<unsigned>(p.chunks), static_cast<unsigned>(rows));
  switch (x.scalar_type()) {
    case at::kFloat:
      launch_kernel(vec ? argmax_rows_kernel<float, 4> : argmax_rows_kernel<float, 1>, grid, kThreads, 0, stream, p);
      break;
    case at::kBFloat16:
      launch_kernel(vec ? argmax_rows_kernel<__nv_bfloat16, 8> : argmax_rows_kernel<__nv_bfloat16, 1>, grid, kThreads,
                    0, stream, p);
      break;
    case at::kHalf:
      launch_kernel(vec ? argmax_rows_kernel<__half, 8> : argmax_rows_kernel<__half, 1>, grid, kThreads, 0, stream, p);
      break;
    default: TORCH_CHECK(false, "argmax_rows: x must be float32, bfloat16 or float16, got ", x.scalar_type());
  }
}

at::Tensor argmax_rows(const at::Tensor& x) {
  at::Tensor out = at::empty({x.dim() == 2 ? x.size(0) : 0}, x.options().dtype(at::kLong));
  argmax_rows_into(x, out);
  return out;
}

}  // namespace compilelm::cuda
