// Device helpers shared by the paged-attention kernels (paged_attention_decode.cu,
// paged_attention_prefill.cu): vector widening, query-row lookups, zeroing padding rows,
// merging split-K partials.
#pragma once

#include <cstdint>

#include "cuda/convert.cuh"
#include "cuda/launchers.h"

namespace compilelm::cuda {

// The 16 / sizeof(T) elements of a 16-byte vector, widened to fp32 (T = __nv_fp8_e4m3: the 16
// codes of an FP8 KV cache row, two per conversion; their scale is applied by the caller).
template <typename T>
__device__ __forceinline__ void widen(const uint4& v, float (&f)[16 / sizeof(T)]) {
  if constexpr (sizeof(T) == 1) {
    const uint32_t words[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const float2 pair = fp8x2_to_float2(static_cast<uint16_t>(words[i / 2] >> (16 * (i % 2))));
      f[2 * i] = pair.x;
      f[2 * i + 1] = pair.y;
    }
  } else {
    const T* e = reinterpret_cast<const T*>(&v);
#pragma unroll
    for (int i = 0; i < 16 / static_cast<int>(sizeof(T)); ++i) f[i] = to_float(e[i]);
  }
}

// Neox RoPE of element x of a head, given its pair element `other` (j +- head_size / 2) and the
// pair's cos c and sin s: x c - other s in the lower half, x c + other s in the upper. In fp32
// without contraction into FMAs, so rope_and_cache and the decode kernel's RoPE (rope_paged_attention)
// get the same bits.
__device__ __forceinline__ float rope_rotate(float x, float other, float c, float s, bool upper) {
  const float xc = __fmul_rn(x, c), os = __fmul_rn(other, s);
  return upper ? __fadd_rn(xc, os) : __fsub_rn(xc, os);
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

constexpr int kMaxSplits = 64;     // split-K partitions of one row's context, at most (merges: two per lane)
constexpr int kMinSplitKeys = 64;  // keys of a split, at least (launch: max_context / splits; kernel: per row)

// Keys per split of a row with num_keys keys, and the splits that get any: num_splits comes from
// the launch's shapes (block-table width), but a short row is not cut into slivers (a split's
// fixed cost and its partial's merge outweigh a few keys); the splits past `active` exit at once.
// A split's keys are a multiple of kSplitAlign, so every split starts on a 16-key tile of the
// tensor-core kernel and, with the engine's 16-token blocks, on a cache block (its fast path).
constexpr int kSplitAlign = 16;
__device__ __forceinline__ int split_keys(int num_keys, int num_splits) {
  const int keys = max((num_keys + num_splits - 1) / num_splits, kMinSplitKeys);
  return (keys + kSplitAlign - 1) / kSplitAlign * kSplitAlign;
}
__device__ __forceinline__ int active_splits(int num_keys, int num_splits) {
  const int keys = split_keys(num_keys, num_splits);
  return max(1, (num_keys + keys - 1) / keys);
}

// The query row served by decode-kernel row x (a sequence, or with all_rows a query row):
// false if there is none (not a decode row, or a padding row). All rows: where row x is sequence
// x's only token (every row of a pure-decode batch but the padding) this is one round of loads
// before the block table's; the search over cu_seqlens_q takes two more at batch 1 and ~log2(rows)
// more above, all before the PDL wait.
__device__ __forceinline__ bool locate_row(const AttentionParams& p, bool all_rows, int x, int& token, int& seq,
                                           int& num_keys) {
  if (!all_rows) {
    seq = x;
    token = p.cu_seqlens_q[seq];
    if (p.cu_seqlens_q[seq + 1] - token != 1) return false;
    num_keys = p.seq_lens[seq];
    return true;
  }
  token = x;
  if (x < p.num_seqs) {  // a pure-decode batch: row x is sequence x's one token (one round of loads)
    const int start = p.cu_seqlens_q[x], next = p.cu_seqlens_q[x + 1], seq_len = p.seq_lens[x];
    if (start == x && next == x + 1) {
      seq = x;
      num_keys = seq_len;
      return true;
    }
  }
  if (token >= p.cu_seqlens_q[p.num_seqs]) return false;
  seq = find_seq(p.cu_seqlens_q, p.num_seqs, token);
  const int q_len = p.cu_seqlens_q[seq + 1] - p.cu_seqlens_q[seq];
  num_keys = p.seq_lens[seq] - q_len + (token - p.cu_seqlens_q[seq]) + 1;  // position + 1
  return true;
}

// The keys of decode program (row x, split) of a launch with s.num_splits splits: located = false
// where row x serves no query row; keys [begin, end) of the row's num_keys (none where split >=
// active); fresh: the first key written this step (the rows before it were cached by earlier steps).
struct DecodeRange {
  bool located;
  int token, seq, num_keys, active, begin, end, fresh;
};

__device__ __forceinline__ DecodeRange decode_range(const AttentionParams& p, const SplitParams& s, int x, int split) {
  DecodeRange r{};
  r.located = locate_row(p, s.all_rows, x, r.token, r.seq, r.num_keys);
  if (!r.located) return r;
  r.active = active_splits(r.num_keys, s.num_splits);
  const int chunk = split_keys(r.num_keys, s.num_splits);
  r.begin = split * chunk;
  r.end = min(r.num_keys, r.begin + chunk);
  r.fresh = p.seq_lens[r.seq] - (p.cu_seqlens_q[r.seq + 1] - p.cu_seqlens_q[r.seq]);
  return r;
}

// Merges the splits of decode row x (query row `token`, num_keys keys) for query heads
// [head0, head0 + num_heads) into the output; every thread of the block calls it.
// out = sum_s w_s o_s with w_s = 2^(lse_s - max lse) / sum, over the active splits: one warp per
// head takes the weights (lanes over splits, two each) into s_weight (shared, [num_heads][kMaxSplits]
// floats), then the threads merge (head, element) outputs with their partial loads in flight
// together. The partials are read through L2 (__ldcg): in the decode kernel the last split merges
// partials that other blocks of the same launch wrote, which an SM's L1 may hold stale.
template <typename T>
__device__ void merge_splits(const AttentionParams& p, const SplitParams& s, int x, int token, int num_keys,
                             int head0, int num_heads, float* s_weight) {
  static_assert(kMaxSplits == 64, "two splits per lane");
  const int lane = threadIdx.x % 32, active = active_splits(num_keys, s.num_splits);
  const int64_t first = (static_cast<int64_t>(x) * p.num_heads + head0) * s.num_splits;  // (x, head0, split 0)
  for (int g = threadIdx.x / 32; g < num_heads; g += blockDim.x / 32) {
    const float* lse = s.partial_lse + first + static_cast<int64_t>(g) * s.num_splits;
    const float lse0 = lane < active ? __ldcg(lse + lane) : -INFINITY;
    const float lse1 = lane + 32 < active ? __ldcg(lse + lane + 32) : -INFINITY;
    float lse_max = fmaxf(lse0, lse1);
#pragma unroll
    for (int offset = 16; offset > 0; offset /= 2) lse_max = fmaxf(lse_max, __shfl_xor_sync(0xffffffffu, lse_max, offset));
    const float w0 = lse_max == -INFINITY ? 0.f : exp2f(lse0 - lse_max);  // an empty split: 0
    const float w1 = lse_max == -INFINITY ? 0.f : exp2f(lse1 - lse_max);
    float total = w0 + w1;
#pragma unroll
    for (int offset = 16; offset > 0; offset /= 2) total += __shfl_xor_sync(0xffffffffu, total, offset);
    const float inv = total > 0.f ? 1.f / total : 0.f;
    s_weight[g * kMaxSplits + lane] = w0 * inv;
    s_weight[g * kMaxSplits + lane + 32] = w1 * inv;
  }
  __syncthreads();
  const int d_size = p.head_size;
  for (int i = threadIdx.x; i < num_heads * d_size; i += blockDim.x) {
    const int g = i / d_size, d = i % d_size;
    const float* partial = s.partial_out + (first + static_cast<int64_t>(g) * s.num_splits) * d_size + d;
    float o = 0.f;
#pragma unroll 8
    for (int j = 0; j < active; ++j) o += s_weight[g * kMaxSplits + j] * __ldcg(partial + j * d_size);
    static_cast<T*>(p.out)[(static_cast<int64_t>(token) * p.num_heads + head0 + g) * d_size + d] = from_float<T>(o);
  }
  __syncthreads();  // s_weight is reused by the caller's next merge
}

// The end of a decode program: its warps' softmax states for its num_q heads (acc [W][GP][D],
// unnormalized, under max m [W][GP] with sum l [W][GP], log2 units; a warp without keys: m = -inf,
// l = 0), merged per (head g, element d) by the block's threads into emit(g, d, o, lse), o the
// normalized output and, at d == 0 only, lse the head's log2-sum-exp (-inf: no keys, o = 0).
template <int W, int GP, int D, typename Emit>
__device__ __forceinline__ void merge_warp_states(int num_q, const float (*acc)[GP][D], const float (*m)[GP],
                                                  const float (*l)[GP], Emit&& emit) {
  for (int i = threadIdx.x; i < num_q * D; i += blockDim.x) {
    const int g = i / D, d = i % D;
    float m_max = -INFINITY;
#pragma unroll
    for (int r = 0; r < W; ++r) m_max = fmaxf(m_max, m[r][g]);
    float denom = 0.f, numer = 0.f;
    if (m_max != -INFINITY) {
#pragma unroll
      for (int r = 0; r < W; ++r) {
        const float w = exp2f(m[r][g] - m_max);
        denom += w * l[r][g];
        numer += w * acc[r][g][d];
      }
    }
    const float o = denom > 0.f ? numer / denom : 0.f;  // an empty split contributes nothing
    emit(g, d, o, d == 0 && denom > 0.f ? m_max + log2f(denom) : -INFINITY);
  }
}

// Where a decode program outside a cluster puts head `head`'s element d: the output row (one
// split), or its split's partial and, at d == 0, the partial's log2-sum-exp.
template <typename T>
__device__ __forceinline__ void store_decode_output(const AttentionParams& p, const SplitParams& s, int row, int token,
                                                    int head, int split, int d, float o, float lse) {
  if (s.num_splits == 1) {
    static_cast<T*>(p.out)[(static_cast<int64_t>(token) * p.num_heads + head) * p.head_size + d] = from_float<T>(o);
  } else {
    const int64_t partial = (static_cast<int64_t>(row) * p.num_heads + head) * s.num_splits + split;
    s.partial_out[partial * p.head_size + d] = o;
    if (d == 0) s.partial_lse[partial] = lse;
  }
}

// After a split's stores (all-rows launches with arrival counters, s.arrivals): the last split of
// program blockIdx.x to finish merges its heads [head0, head0 + num_q). The block's partials are
// ordered before its count by the barrier and one thread's fence (release; a fence in every thread
// stalls each block's end), the last one
// fences again before reading (acquire); the counter is reset for the next launch. s_last and
// s_weight ([num_q][kMaxSplits] floats) are shared memory.
template <typename T>
__device__ void merge_if_last_split(const AttentionParams& p, const SplitParams& s, int row, int token, int num_keys,
                                    int head0, int num_q, int active, bool& s_last, float* s_weight) {
  if (s.arrivals == nullptr) return;
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    s_last = atomicAdd(&s.arrivals[blockIdx.x], 1) == active - 1;
    if (s_last) {
      s.arrivals[blockIdx.x] = 0;
      __threadfence();
    }
  }
  __syncthreads();
  if (!s_last) return;
  merge_splits<T>(p, s, row, token, num_keys, head0, num_q, s_weight);
}

// merge_splits for decode row x as the merge kernel and the prefill kernel see it: a row that is
// not a decode row is skipped; a padding row of the all-rows fallback is zeroed.
template <typename T>
__device__ void merge_row(const AttentionParams& p, const SplitParams& s, int x, int head0, int num_heads,
                          float* s_weight) {
  int token, seq, num_keys;
  if (!locate_row(p, s.all_rows, x, token, seq, num_keys)) {
    if (s.all_rows && x < p.num_tokens) zero_rows<T>(p, x, 1, head0, num_heads);
    return;
  }
  merge_splits<T>(p, s, x, token, num_keys, head0, num_heads, s_weight);
}

}  // namespace compilelm::cuda
