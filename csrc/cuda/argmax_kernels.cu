// argmax_rows: the index of each row's first maximum (NaN counts as the maximum, as in torch's
// argmax) in one kernel, for greedy sampling. sample_rows: the same kernel over Gumbel-perturbed
// logits, x * log2(e) / temperature - log2(-log2(u)) with u uniform from Philox (keyed by the
// row's 64-bit key, counter = column / 4): the argmax of x / T + Gumbel noise is a sample from
// softmax(x / T) (the Gumbel-max trick, the exponential race of vLLM's sampler in one pass over
// the logits, without the fp32 copy, the softmax or a noise tensor). Rows with inv_temperature 0
// take the plain argmax. With a floor, a sampled row's columns with x * inv_temperature below its
// floor are out of the draw (the sampler's top-k / top-p / min-p filters, without a masked copy).
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
#include "cuda/philox.cuh"

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
  const float* inv_temperature = nullptr;  // sample_rows: fp32 [rows], 0 = the row's argmax
  const int64_t* keys = nullptr;           // sample_rows: [rows], each row's Philox key
  const float* floor = nullptr;            // sample_rows: fp32 [rows] or null, the draw's threshold
};

// The 32 random bits of column c under `key`: word c % 4 of Philox counter (c / 4, 0, 0, 0).
__device__ __forceinline__ Philox4 column_bits(uint64_t key, int c) {
  return philox4x32_10(static_cast<uint32_t>(c) / 4, 0u, 0u, 0u, static_cast<uint32_t>(key),
                       static_cast<uint32_t>(key >> 32));
}

__device__ __forceinline__ uint32_t word(const Philox4& r, int i) {
  return i == 0 ? r.x : i == 1 ? r.y : i == 2 ? r.z : r.w;
}

// x * scale - log2(-log2(u)): a logit (in log2 units, over the temperature) plus Gumbel noise.
// The inner log2 is the accurate one: near u = 1 the fast one can return 0 or more (noise +inf or
// NaN, which would win the argmax); the outer one's argument lies in (8.6e-8, 23].
__device__ __forceinline__ float gumbel_key(float x, float scale, uint32_t bits) {
  return x * scale - __log2f(-log2f(uniform_open(bits)));
}

// A sampled column's key, or -inf where x * inv_t (rounded as torch's fp32 product) is below the
// row's floor (always, the filters keep the row's maximum, so some column stays in the draw).
__device__ __forceinline__ float draw_key(float x, float scale, uint32_t bits, float inv_t, float floor) {
  return x * inv_t < floor ? -INFINITY : gumbel_key(x, scale, bits);
}

template <typename T, int kVec, bool kSample>
__global__ void __launch_bounds__(kThreads) argmax_rows_kernel(const ArgmaxParams p) {
  __shared__ bool s_last;
  const int chunk = blockIdx.x, row = blockIdx.y;
  wait_for_prior_kernels();  // PDL (launch.cuh): before any read of earlier kernels' outputs
  allow_dependent_kernels();
  constexpr float kLog2e = 1.4426950408889634f;
  const float inv_t = kSample ? p.inv_temperature[row] : 0.f;
  const float scale = inv_t * kLog2e;
  const bool noisy = kSample && scale > 0.f;  // the same for the whole row
  const float floor = noisy && p.floor != nullptr ? p.floor[row] : -INFINITY;
  const uint64_t key = noisy ? static_cast<uint64_t>(p.keys[row]) : 0;
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
      uint32_t bits[kVec] = {};
      if (noisy) {  // v is a multiple of kVec (4 or 8): whole Philox counters
#pragma unroll
        for (int g = 0; g < kVec / 4; ++g) {
          const Philox4 r = column_bits(key, v + 4 * g);
          bits[4 * g] = r.x, bits[4 * g + 1] = r.y, bits[4 * g + 2] = r.z, bits[4 * g + 3] = r.w;
        }
      }
#pragma unroll
      for (int i = 0; i < kVec; ++i) {  // (in index order: a tie keeps the first)
        const float value = to_float(values.v[i]);
        const Best here{noisy ? draw_key(value, scale, bits[i], inv_t, floor) : value, v + i};
        if (beats(here, best)) best = here;
      }
    }
    c = vec_end;
  }
  for (c += threadIdx.x; c < end; c += kThreads) {
    const float value = to_float(x[c]);
    const Best here{noisy ? draw_key(value, scale, word(column_bits(key, c), c % 4), inv_t, floor) : value, c};
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

template <bool kSample>
void launch_rows(const ArgmaxParams& p, const dim3& grid, bool vec, at::ScalarType dtype, cudaStream_t stream) {
  const char* name = kSample ? "sample_rows" : "argmax_rows";
  switch (dtype) {
    case at::kFloat:
      launch_kernel(vec ? argmax_rows_kernel<float, 4, kSample> : argmax_rows_kernel<float, 1, kSample>, grid, kThreads,
                    0, stream, p);
      break;
    case at::kBFloat16:
      launch_kernel(vec ? argmax_rows_kernel<__nv_bfloat16, 8, kSample> : argmax_rows_kernel<__nv_bfloat16, 1, kSample>,
                    grid, kThreads, 0, stream, p);
      break;
    case at::kHalf:
      launch_kernel(vec ? argmax_rows_kernel<__half, 8, kSample> : argmax_rows_kernel<__half, 1, kSample>, grid,
                    kThreads, 0, stream, p);
      break;
    default: TORCH_CHECK(false, name, ": x must be float32, bfloat16 or float16, got ", dtype);
  }
}

// argmax_rows_into, or (inv_temperature and keys given) sample_rows into out.
void rows_into(const at::Tensor& x, const at::Tensor& out, const at::Tensor* inv_temperature = nullptr,
               const at::Tensor* keys = nullptr, const at::Tensor* floor = nullptr) {
  const char* name = inv_temperature != nullptr ? "sample_rows" : "argmax_rows";
  TORCH_CHECK(x.is_cuda() && x.dim() == 2 && x.size(1) > 0 && x.stride(1) == 1, name,
              ": x must be a CUDA tensor [rows, vocab] (vocab > 0, columns contiguous), got ", x.sizes(),
              " with strides ", x.strides());
  TORCH_CHECK(x.size(1) < INT_MAX, name, ": vocab must be below 2^31, got ", x.size(1));
  TORCH_CHECK(x.size(0) <= 65535, name, ": at most 65535 rows, got ", x.size(0));
  TORCH_CHECK(out.device() == x.device() && out.scalar_type() == at::kLong && out.dim() == 1 &&
                  out.size(0) == x.size(0) && out.stride(0) == 1,
              name, ": out must be int64 [", x.size(0), "] contiguous on ", x.device(), ", got ", out.sizes(), " ",
              out.scalar_type(), " on ", out.device());
  if (inv_temperature != nullptr) {
    const at::Tensor& t = *inv_temperature;
    TORCH_CHECK(t.device() == x.device() && t.scalar_type() == at::kFloat && t.dim() == 1 && t.size(0) == x.size(0) &&
                    t.stride(0) == 1,
                "sample_rows: inv_temperature must be float32 [", x.size(0), "] contiguous on ", x.device(), ", got ",
                t.sizes(), " ", t.scalar_type(), " on ", t.device());
    const at::Tensor& k = *keys;
    TORCH_CHECK(k.device() == x.device() && k.scalar_type() == at::kLong && k.dim() == 1 && k.size(0) == x.size(0) &&
                    k.stride(0) == 1,
                "sample_rows: keys must be int64 [", x.size(0), "] contiguous on ", x.device(), ", got ", k.sizes(), " ",
                k.scalar_type(), " on ", k.device());
    if (floor != nullptr) {
      const at::Tensor& f = *floor;
      TORCH_CHECK(f.device() == x.device() && f.scalar_type() == at::kFloat && f.dim() == 1 &&
                      f.size(0) == x.size(0) && f.stride(0) == 1,
                  "sample_rows: floor must be float32 [", x.size(0), "] contiguous on ", x.device(), ", got ",
                  f.sizes(), " ", f.scalar_type(), " on ", f.device());
    }
  }
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
  if (inv_temperature != nullptr) {
    p.inv_temperature = inv_temperature->data_ptr<float>();
    p.keys = keys->data_ptr<int64_t>();
    if (floor != nullptr) p.floor = floor->data_ptr<float>();
  }
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
  if (inv_temperature != nullptr) {
    launch_rows<true>(p, grid, vec, x.scalar_type(), stream);
  } else {
    launch_rows<false>(p, grid, vec, x.scalar_type(), stream);
  }
}

}  // namespace

void argmax_rows_into(const at::Tensor& x, const at::Tensor& out) { rows_into(x, out); }

at::Tensor argmax_rows(const at::Tensor& x) {
  at::Tensor out = at::empty({x.dim() == 2 ? x.size(0) : 0}, x.options().dtype(at::kLong));
  argmax_rows_into(x, out);
  return out;
}

at::Tensor sample_rows(const at::Tensor& x, const at::Tensor& inv_temperature, const at::Tensor& keys,
                       const std::optional<at::Tensor>& floor) {
  at::Tensor out = at::empty({x.dim() == 2 ? x.size(0) : 0}, x.options().dtype(at::kLong));
  rows_into(x, out, &inv_temperature, &keys, floor.has_value() ? &*floor : nullptr);
  return out;
}

}  // namespace compilelm::cuda
