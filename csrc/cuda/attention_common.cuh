// Shared by the paged-attention kernels (paged_attention_decode.cu, paged_attention_prefill.cu):
// the launch parameters, element conversions and the query-row -> sequence lookup.
#pragma once

#include <ATen/core/Tensor.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

namespace compilelm::cuda {

// One paged_attention call. Layouts as in csrc/ops.cpp; all index tensors contiguous int32.
struct AttentionParams {
  const void* query;            // [num_tokens, num_heads, head_size], token stride q_stride
  const void* key_cache;        // [num_blocks, block_size, num_kv_heads, head_size]
  const void* value_cache;      // [num_blocks, block_size, num_kv_heads, head_size]
  void* out;                    // [num_tokens, num_heads, head_size], contiguous
  const int32_t* cu_seqlens_q;  // [num_seqs + 1]
  const int32_t* seq_lens;      // [num_seqs]
  const int32_t* block_tables;  // [num_seqs, max_blocks]
  int64_t q_stride;
  int num_seqs, num_tokens, num_heads, num_kv_heads, group, head_size, block_size, max_blocks;
  float scale_log2;  // softmax scale * log2(e): scores are exponentiated with exp2
};

// Launchers (host side, on the current stream; `query` gives dtype and device). The decode
// launcher serves the q_len == 1 rows of every sequence, or, with all_rows, every query row
// (the fallback for shapes the tiled kernel does not cover; then it also zeroes padding rows).
// max_context bounds seq_lens (block_tables.size(1) * block_size): it sizes the split-K.
// The prefill launcher serves the q_len > 1 rows and zeroes the padding rows.
void launch_paged_attention_decode(const AttentionParams& p, const at::Tensor& query, bool all_rows,
                                   int64_t max_context);
bool prefill_supported(at::ScalarType dtype, int head_size, int group);
void launch_paged_attention_prefill(const AttentionParams& p, const at::Tensor& query);

constexpr float kLog2e = 1.4426950408889634f;

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

// The 16 / sizeof(T) elements of a 16-byte vector, widened to fp32.
template <typename T>
__device__ __forceinline__ void widen(const uint4& v, float (&f)[16 / sizeof(T)]) {
  const T* e = reinterpret_cast<const T*>(&v);
#pragma unroll
  for (int i = 0; i < 16 / static_cast<int>(sizeof(T)); ++i) f[i] = to_float(e[i]);
}

// Sequence of a query row: the last i in [0, num_seqs) with cu_seqlens_q[i] <= token
// (the last, so that empty sequences sharing that start are skipped).
__device__ __forceinline__ int find_seq(const int32_t* cu_seqlens_q, int num_seqs, int token) {
  int lo = 0, hi = num_seqs - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (cu_seqlens_q[mid] <= token) lo = mid; else hi = mid - 1;
  }
  return lo;
}

// Writes zeros over num_rows query rows (heads [head_begin, head_begin + num_heads)) starting
// at row_begin, clipped to num_tokens. head_size * sizeof(T) is a multiple of 16 bytes.
template <typename T>
__device__ void zero_rows(const AttentionParams& p, int row_begin, int num_rows, int head_begin,
                          int num_heads) {
  const int row_end = min(row_begin + num_rows, p.num_tokens);
  const int row_vecs = num_heads * p.head_size * static_cast<int>(sizeof(T)) / 16;
  for (int i = threadIdx.x; i < (row_end - row_begin) * row_vecs; i += blockDim.x) {
    const int64_t row = row_begin + i / row_vecs;
    T* dst = static_cast<T*>(p.out) + (row * p.num_heads + head_begin) * p.head_size;
    reinterpret_cast<uint4*>(dst)[i % row_vecs] = make_uint4(0, 0, 0, 0);
  }
}

}  // namespace compilelm::cuda
