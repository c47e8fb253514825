// Paged attention for single query rows (decode): CUDA cores, GQA-aware, split-K.
//
// A program = (query row, kv head, split). It holds the query vectors of up to GP heads of the
// kv head's group in registers and streams the split's key/value rows once: every 16-byte load
// of a key or value row serves all GP heads. Inside a program, key rows are spread over "row
// groups" of kLanes lanes (one row = kLanes x 16-byte loads), each with its own online softmax;
// a row group issues the loads of its next kUnroll rows before the math of the current ones.
// The row groups' states are merged through shared memory at the end.
//
// Split-K (flash-decoding): with few programs per SM (small batch, long context) the context
// of each row is cut into num_splits equal chunks; each split writes its normalized partial
// output and log2-sum-exp to a workspace; the prefill kernel, launched next, merges them. In
// the all-rows path (pure decode: full CUDA graphs) the kernel merges them itself:
//   - on sm_90+, in small launches (at most a block per SM, short splits), a program's splits
//     (at most 16) run as one thread block cluster: each keeps its partial in shared memory, and
//     after a cluster barrier the blocks merge the row's (head, element) outputs reading every
//     split's shared memory (DSMEM): no partials in global memory, no fence, no atomic;
//   - else (or with compilelm::set_cluster_merge(False)) each split counts its arrival in a
//     per-program counter, and the last one to arrive resets it and merges from the workspace
//     (a merge kernel only where the counters are unavailable).
// num_splits comes from shapes only (never from seq_lens values), so the launch is CUDA-graph
// capturable.
//
// Launches outside clusters of bf16/fp16 queries (head_size 64/128, groups up to 16 heads; model-
// dtype or FP8 caches) run the tensor-core kernel of paged_attention_decode_mma.cu instead (same
// programs, splits and merges; compilelm::set_decode_mma(False) keeps them here).
//
// FP8 KV caches (C = __nv_fp8_e4m3, queries of T): a 16-byte load holds 16 codes of a row, widened
// to fp32 in registers (two per conversion: attention_common.cuh); k_scale is folded into the
// softmax scale (p.scale_log2) and v_scale multiplies each normalized output (p.v_scale, 1 for
// model-dtype caches). A program holds at most 4 query heads (GP) with an fp8 cache: its query
// and accumulator rows are twice as long per lane. Never with kRope.
//
// RoPE inside (kRope, rope_paged_attention): in the cluster launches of a pure-decode batch the
// kernel takes the QKV projection's output as it is: each program rotates its heads' query rows
// and the split that holds the row's new key rotates that key, writes it and the value to their
// cache slot and feeds both to its own key loop from registers (it never reads them back): no
// rope_and_cache kernel before it. Used for models wider than kSmallModelQueryWidth
// (paged_attention.cpp says why not below).
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>

#include <cooperative_groups.h>

#include <algorithm>
#include <cmath>

#include "cuda/arrival_counters.h"
#include "cuda/attention_common.cuh"
#include "cuda/launch.cuh"

namespace compilelm::cuda {
namespace {

constexpr int kWarps = 4;
constexpr int kProgramCostKeys = 128;  // a program's start-up and merge, in keys streamed
constexpr int kPortableClusterSplits = 8;  // the portable thread block cluster size
constexpr int kMaxClusterSplits = 16;      // sm_90's non-portable cluster size, where it fits (launch)
constexpr int64_t kMaxClusterSplitKeys = 256;  // keys of a split in a cluster, at most (launch)

__device__ __forceinline__ uint4 load_stream(const void* ptr) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(ptr));
  return v;
}

// Rows in flight per row group (kUnroll): 4, or 2 where a program's registers would cap it at 3
// blocks per SM and the launch has waves to fill: with GP >= 8, and with GP = 4 at head_size >= 128
// outside a cluster (the multi-wave launches). A one-wave launch wants more loads in flight per
// program, so clusters keep 4 (8 lengthens the loads before the PDL wait more than it shortens
// the key loop). Measurements: docs/perf.md, "Paged attention".
template <typename C, int D, int GP, bool kCluster>
struct DecodeTile {  // C: the cache's element type
  static constexpr int kVec = 16 / sizeof(C);                     // cache elements per 16-byte load
  static constexpr int kLanes = D / kVec < 32 ? D / kVec : 32;    // lanes per key row
  static constexpr int kLoads = D / (kVec * kLanes);              // 16-byte loads per lane per row
  static constexpr int kGroups = kWarps * (32 / kLanes);          // row groups per program
  static constexpr int kUnroll = GP >= 8 || (GP >= 4 && D >= 128 && !kCluster) ? 2 : 4;
  static_assert(D % (kVec * kLanes) == 0 && 32 % kLanes == 0, "unsupported head_size");
};

// The cluster merge (kCluster): block `split` of the cluster holds its split's normalized output
// s_out [GP][D] and log2-sum-exp s_lse [GP]; the blocks share the row's num_q x D outputs, each
// reading the other splits' shared memory, out = sum_s w_s o_s, w_s = 2^(lse_s - max) / sum.
// The second barrier keeps every block (and its shared memory) alive until all reads are done.
// (Pushing every partial into the first block's shared memory instead, one barrier and one block
// merging, was slower: the remote stores and the one block's merge; docs/perf.md, "Paged
// attention".)
template <typename T, int D>
__device__ void merge_in_cluster(const AttentionParams& p, int token, int head0, int num_q, const float* s_out,
                                 const float* s_lse) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  namespace cg = cooperative_groups;
  cg::cluster_group cluster = cg::this_cluster();
  cluster.sync();
  const int splits = static_cast<int>(cluster.num_blocks()), rank = static_cast<int>(cluster.block_rank());
  for (int i = rank * blockDim.x + threadIdx.x; i < num_q * D; i += splits * blockDim.x) {
    const int g = i / D, d = i % D;
    float lse[kMaxClusterSplits], lse_max = -INFINITY;
#pragma unroll
    for (int r = 0; r < kMaxClusterSplits; ++r) {
      lse[r] = r < splits ? cluster.map_shared_rank(s_lse, r)[g] : -INFINITY;
      lse_max = fmaxf(lse_max, lse[r]);
    }
    float total = 0.f, o = 0.f;
    if (lse_max != -INFINITY) {  // else no split had keys
#pragma unroll
      for (int r = 0; r < kMaxClusterSplits; ++r) {
        if (r < splits) {
          const float w = exp2f(lse[r] - lse_max);  // an empty split: 0
          total += w;
          o += w * cluster.map_shared_rank(s_out, r)[g * D + d];
        }
      }
    }
    static_cast<T*>(p.out)[(static_cast<int64_t>(token) * p.num_heads + head0 + g) * D + d] =
        from_float<T>(total > 0.f ? o / total : 0.f);
  }
  cluster.sync();
#endif
}

// kRope: x (the kVec elements of a lane, kLoads == 1) rotated in place by RoPE and rounded to T
// (rope_and_cache's numbers: rope_rotate); the pair element of each sits kLanes / 2 lanes away.
template <typename T, int kVec, int kLanes>
__device__ __forceinline__ void rotate_row(float (&x)[kVec], const float (&c)[kVec], const float (&s)[kVec],
                                           bool upper) {
#pragma unroll
  for (int e = 0; e < kVec; ++e) {
    const float other = __shfl_xor_sync(0xffffffffu, x[e], kLanes / 2);
    x[e] = round_to<T>(rope_rotate(x[e], other, c[e], s[e], upper));
  }
}

// kN elements of T at src (16-byte aligned) widened to fp32, zeros where !valid: kN * sizeof(T) / 16
// loads (an fp8 cache's 16 elements of a lane are two loads of a bf16 query).
template <typename T, int kN>
__device__ __forceinline__ void load_widened(const T* src, bool valid, float (&f)[kN]) {
  constexpr int kPer = 16 / sizeof(T);
  static_assert(kN % kPer == 0, "whole 16-byte loads");
#pragma unroll
  for (int i = 0; i < kN / kPer; ++i) {
    const uint4 raw = valid ? reinterpret_cast<const uint4*>(src)[i] : make_uint4(0, 0, 0, 0);
    float part[kPer];
    widen<T>(raw, part);
#pragma unroll
    for (int e = 0; e < kPer; ++e) f[i * kPer + e] = part[e];
  }
}

template <typename T, typename C, int D, int GP, bool kCluster, bool kRope>
__global__ void __launch_bounds__(kWarps * 32)
    paged_attention_decode_kernel(const AttentionParams p, const SplitParams s, const RopeCacheParams r) {
  using Tile = DecodeTile<C, D, GP, kCluster>;
  constexpr int kVec = Tile::kVec, kLanes = Tile::kLanes, kLoads = Tile::kLoads;
  constexpr int kGroups = Tile::kGroups, kUnroll = Tile::kUnroll;
  static_assert(!kRope || (kCluster && kLoads == 1 && sizeof(T) == 2 && sizeof(C) == sizeof(T)),
                "RoPE inside: 16-bit types and caches, cluster launches");
  __shared__ float s_acc[kWarps][GP][D];  // each warp's merged softmax state
  __shared__ float s_m[kWarps][GP], s_l[kWarps][GP];
  __shared__ float s_weight[kCluster ? 1 : GP][kCluster ? 1 : kMaxSplits];  // the last split's merge weights
  __shared__ bool s_last;
  __shared__ float s_out[kCluster ? GP : 1][kCluster ? D : 1], s_lse[GP];  // the cluster merge's partial

  const int lane = threadIdx.x % 32;
  const int lane_in_row = lane % kLanes;
  const int row_group = threadIdx.x / kLanes;
  // program x = (row, kv head, head chunk), kv heads fastest: programs running side by side
  // read neighbouring heads of the same cache slots
  const int chunks = (p.group + GP - 1) / GP;  // chunks of GP heads per kv head
  const int row = blockIdx.x / (p.num_kv_heads * chunks);
  const int kv_head = blockIdx.x % (p.num_kv_heads * chunks) / chunks;
  const int head0 = kv_head * p.group + blockIdx.x % chunks * GP;
  const int num_q = min(GP, kv_head * p.group + p.group - head0);  // heads of this program
  const int split = blockIdx.y;

  // Before the PDL wait (launch.cuh) only the step's metadata and the context of earlier steps
  // are read: the keys before `fresh` (this step's rows are written by the kernel just before).
  // kRope (all rows: row = token): the row's cache slot and position, loaded beside locate_row's
  int64_t slot = -1, position = 0;
  if constexpr (kRope) {
    slot = r.slot_mapping[row];
    position = r.positions[row];
  }
  const DecodeRange range = decode_range(p, s, row, split);
  const bool located = range.located;
  const int token = range.token, seq = range.seq, num_keys = range.num_keys, active = range.active;
  const int begin = range.begin, end = range.end, fresh = range.fresh;

  const int32_t* block_table = p.block_tables + static_cast<int64_t>(located ? seq : 0) * p.max_blocks;
  const int64_t head_offset = kv_head * p.head_stride + lane_in_row * kVec;
  const C* k_base = static_cast<const C*>(p.key_cache) + head_offset;
  const C* v_base = static_cast<const C*>(p.value_cache) + head_offset;

  // kRope: fresh_k / fresh_v: the new key (rotated) and value row's 16 bytes of this lane, in the
  // split that holds key `fresh_key` (else -1)
  const bool upper = lane_in_row >= kLanes / 2;  // kRope: this lane holds elements of the upper half
  uint4 fresh_k = make_uint4(0, 0, 0, 0), fresh_v = make_uint4(0, 0, 0, 0);
  int fresh_key = -1;

  // key rows base + u * kGroups + row_group (u < kUnroll) of one step, those below `limit`; the
  // next step's loads are issued before this step's math, so every warp always has loads in flight
  constexpr int kStep = kGroups * kUnroll;
  uint4 k_next[kUnroll][kLoads], v_next[kUnroll][kLoads];
  const auto load = [&](int base, int limit) {
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int key = base + u * kGroups + row_group;
      const bool valid = key < limit;
      int64_t offset = 0;
      if (valid) {
        offset = block_table[key / p.block_size] * p.block_stride + key % p.block_size * p.slot_stride;
      }
#pragma unroll
      for (int l = 0; l < kLoads; ++l) {
        if (kRope && key == fresh_key) {  // the new row: from registers
          k_next[u][l] = fresh_k;
          v_next[u][l] = fresh_v;
        } else {
          k_next[u][l] = valid ? load_stream(k_base + offset + l * kLanes * kVec) : make_uint4(0, 0, 0, 0);
          v_next[u][l] = valid ? load_stream(v_base + offset + l * kLanes * kVec) : make_uint4(0, 0, 0, 0);
        }
      }
    }
  };
  const bool works = located && split < active && begin < end;
  if (works) load(begin, min(end, fresh));
  // kRope: the raw cos | sin of this lane's elements (fp32: 2 + 2 loads; T: 1 + 1), issued after
  // the context loads and used after the wait: no round trip of theirs before the wait
  uint4 cos_sin_raw[4];
  if constexpr (kRope) {
    const int64_t start = position * D + lane_in_row % (kLanes / 2) * kVec;
    if (r.cos_sin_fp32) {
      const uint4* cs = reinterpret_cast<const uint4*>(static_cast<const float*>(r.cos_sin_cache) + start);
      cos_sin_raw[0] = __ldg(cs);
      cos_sin_raw[1] = __ldg(cs + 1);
      cos_sin_raw[2] = __ldg(cs + D / 8);  // + D / 2 floats
      cos_sin_raw[3] = __ldg(cs + D / 8 + 1);
    } else {
      const uint4* cs = reinterpret_cast<const uint4*>(static_cast<const T*>(r.cos_sin_cache) + start);
      cos_sin_raw[0] = __ldg(cs);
      cos_sin_raw[2] = __ldg(cs + D / 16);  // + D / 2 elements of T
    }
  }
  wait_for_prior_kernels();  // PDL (launch.cuh): before any read of earlier kernels' outputs
  allow_dependent_kernels();
  if (!located) {
    const bool zeroes = s.num_splits == 1 || ((kCluster || s.arrivals != nullptr) && split == 0);  // else the merge kernel
    if (s.all_rows && zeroes && row < p.num_tokens) {
      zero_rows<T>(p, row, 1, head0, num_q);  // padding row
    }
    return;
  }
  // no keys: no partial, not counted (the merge reads `active` splits); in a cluster every block
  // takes part in the merge (its partial: empty)
  if (!kCluster && split >= active) return;
  // kRope: cos and sin of this lane's elements, rounded to T (apply_rope's `.to(x.dtype)`)
  float rope_cos[kRope ? kVec : 1], rope_sin[kRope ? kVec : 1];
  if constexpr (kRope) {
#pragma unroll
    for (int e = 0; e < kVec; ++e) {
      if (r.cos_sin_fp32) {
        rope_cos[e] = round_to<T>(reinterpret_cast<const float*>(&cos_sin_raw[0])[e]);
        rope_sin[e] = round_to<T>(reinterpret_cast<const float*>(&cos_sin_raw[2])[e]);
      } else {
        rope_cos[e] = to_float(reinterpret_cast<const T*>(&cos_sin_raw[0])[e]);
        rope_sin[e] = to_float(reinterpret_cast<const T*>(&cos_sin_raw[2])[e]);
      }
    }
  }
  // kRope: the split that holds the new key (q_len 1: key `fresh`) loads its raw key and value
  // rows now, beside the query's loads below: one round trip for both
  const bool holds_fresh = kRope && works && begin <= fresh && fresh < end;
  uint4 fresh_raw_k = make_uint4(0, 0, 0, 0);
  if constexpr (kRope) {
    if (holds_fresh) {
      const int64_t k_src = static_cast<int64_t>(token) * r.k_stride + kv_head * D + lane_in_row * kVec;
      fresh_raw_k = *reinterpret_cast<const uint4*>(static_cast<const T*>(r.key) + k_src);
      fresh_v = *reinterpret_cast<const uint4*>(static_cast<const T*>(r.value) + static_cast<int64_t>(token) * r.v_stride +
                                                kv_head * D + lane_in_row * kVec);
    }
  } else if (works && begin + kStep > fresh) {
    load(begin, end);  // the first step holds this step's rows: now
  }

  // q[g][l][e]: element (l * kLanes + lane_in_row) * kVec + e of head head0 + g, times scale*log2e
  float q[GP][kLoads][kVec];
  const T* query = static_cast<const T*>(p.query) + token * p.q_stride;
#pragma unroll
  for (int g = 0; g < GP; ++g) {
#pragma unroll
    for (int l = 0; l < kLoads; ++l) {
      load_widened<T, kVec>(query + (head0 + g) * D + (l * kLanes + lane_in_row) * kVec, g < num_q, q[g][l]);
      if constexpr (kRope) rotate_row<T, kVec, kLanes>(q[g][l], rope_cos, rope_sin, upper);
#pragma unroll
      for (int e = 0; e < kVec; ++e) q[g][l][e] *= p.scale_log2;
    }
  }

  if constexpr (kRope) {
    if (holds_fresh) {  // rotate the new key; write it and the value to the cache; feed both to the key loop
      float k[kVec];
      widen<T>(fresh_raw_k, k);
      rotate_row<T, kVec, kLanes>(k, rope_cos, rope_sin, upper);
      T rotated[kVec];
#pragma unroll
      for (int e = 0; e < kVec; ++e) rotated[e] = from_float<T>(k[e]);
      fresh_k = *reinterpret_cast<const uint4*>(rotated);
      if (row_group == 0 && slot >= 0 && slot < r.num_slots) {  // one row group writes the cache rows
        const int64_t dst = slot / p.block_size * p.block_stride + slot % p.block_size * p.slot_stride + head_offset;
        *reinterpret_cast<uint4*>(static_cast<T*>(r.key_cache) + dst) = fresh_k;
        *reinterpret_cast<uint4*>(static_cast<T*>(r.value_cache) + dst) = fresh_v;
      }
      // the first step's other rows were loaded before the wait (keys below `fresh`): the new row
      // takes its place there, or in the load of a later step
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        if (begin + u * kGroups + row_group == fresh) {
          k_next[u][0] = fresh_k;
          v_next[u][0] = fresh_v;
        }
      }
      fresh_key = fresh;
    }
  }

  float m[GP], l_sum[GP], acc[GP][kLoads][kVec];
#pragma unroll
  for (int g = 0; g < GP; ++g) {
    m[g] = -INFINITY;
    l_sum[g] = 0.f;
#pragma unroll
    for (int l = 0; l < kLoads; ++l)
#pragma unroll
      for (int e = 0; e < kVec; ++e) acc[g][l][e] = 0.f;
  }

  for (int base = begin; base < end; base += kStep) {
    uint4 k_raw[kUnroll][kLoads], v_raw[kUnroll][kLoads];
    bool valid[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      valid[u] = base + u * kGroups + row_group < end;
#pragma unroll
      for (int l = 0; l < kLoads; ++l) {
        k_raw[u][l] = k_next[u][l];
        v_raw[u][l] = v_next[u][l];
      }
    }
    if (base + kStep < end) load(base + kStep, end);

    // scores[u][g] = q_g . k_u (log2 units); the row group's lanes all-reduce their partial dots
    float scores[kUnroll][GP];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
#pragma unroll
      for (int g = 0; g < GP; ++g) scores[u][g] = 0.f;
#pragma unroll
      for (int l = 0; l < kLoads; ++l) {
        float k[kVec];
        widen<C>(k_raw[u][l], k);
#pragma unroll
        for (int g = 0; g < GP; ++g)
#pragma unroll
          for (int e = 0; e < kVec; ++e) scores[u][g] += q[g][l][e] * k[e];
      }
#pragma unroll
      for (int g = 0; g < GP; ++g) {
#pragma unroll
        for (int offset = kLanes / 2; offset > 0; offset /= 2) {
          scores[u][g] += __shfl_xor_sync(0xffffffffu, scores[u][g], offset);
        }
        if (!valid[u]) scores[u][g] = -INFINITY;
      }
    }

    // online softmax: rescale what was accumulated under the old max, add p @ v
#pragma unroll
    for (int g = 0; g < GP; ++g) {
      float m_new = m[g];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) m_new = fmaxf(m_new, scores[u][g]);
      const float m_safe = m_new == -INFINITY ? 0.f : m_new;  // no key yet: keep p = 0, no NaN
      const float correction = exp2f(m[g] - m_safe);
      m[g] = m_new;
      l_sum[g] *= correction;
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        scores[u][g] = exp2f(scores[u][g] - m_safe);
        l_sum[g] += scores[u][g];
      }
#pragma unroll
      for (int l = 0; l < kLoads; ++l)
#pragma unroll
        for (int e = 0; e < kVec; ++e) acc[g][l][e] *= correction;
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
#pragma unroll
      for (int l = 0; l < kLoads; ++l) {
        float v[kVec];
        widen<C>(v_raw[u][l], v);
#pragma unroll
        for (int g = 0; g < GP; ++g)
#pragma unroll
          for (int e = 0; e < kVec; ++e) acc[g][l][e] += scores[u][g] * v[e];
      }
    }
  }

  // Merge the row groups' softmax states: the row groups of a warp (lanes lane_in_row + j * kLanes
  // hold the same elements) with shuffles, then the warps' through shared memory (rather than every
  // row group's state, 16 per output, through shared memory: slower).
#pragma unroll
  for (int offset = kLanes; offset < 32; offset *= 2) {
#pragma unroll
    for (int g = 0; g < GP; ++g) {
      const float m_other = __shfl_xor_sync(0xffffffffu, m[g], offset);
      const float l_other = __shfl_xor_sync(0xffffffffu, l_sum[g], offset);
      const float m_new = fmaxf(m[g], m_other);
      const float m_safe = m_new == -INFINITY ? 0.f : m_new;  // both empty: weights 0, no NaN
      const float w_self = exp2f(m[g] - m_safe), w_other = exp2f(m_other - m_safe);
      l_sum[g] = l_sum[g] * w_self + l_other * w_other;
#pragma unroll
      for (int l = 0; l < kLoads; ++l)
#pragma unroll
        for (int e = 0; e < kVec; ++e) {
          acc[g][l][e] = acc[g][l][e] * w_self + __shfl_xor_sync(0xffffffffu, acc[g][l][e], offset) * w_other;
        }
      m[g] = m_new;
    }
  }
  const int warp = threadIdx.x / 32;
  if (lane < kLanes) {
#pragma unroll
    for (int g = 0; g < GP; ++g) {
#pragma unroll
      for (int l = 0; l < kLoads; ++l)
#pragma unroll
        for (int e = 0; e < kVec; ++e) s_acc[warp][g][(l * kLanes + lane_in_row) * kVec + e] = acc[g][l][e];
      if (lane_in_row == 0) {
        s_m[warp][g] = m[g];
        s_l[warp][g] = l_sum[g];
      }
    }
  }
  __syncthreads();
  merge_warp_states<kWarps, GP, D>(num_q, s_acc, s_m, s_l, [&](int g, int d, float o, float lse) {
    o *= p.v_scale;  // fp8 caches: values = code * v_scale (1 otherwise: exact)
    if constexpr (kCluster) {
      s_out[g][d] = o;
      if (d == 0) s_lse[g] = lse;
    } else {
      store_decode_output<T>(p, s, row, token, head0 + g, split, d, o, lse);
    }
  });
  if constexpr (kCluster) {
    merge_in_cluster<T, D>(p, token, head0, num_q, &s_out[0][0], s_lse);
  } else {
    merge_if_last_split<T>(p, s, row, token, num_keys, head0, num_q, active, s_last, &s_weight[0][0]);
  }
}

// Merges the splits of (row, head) = divmod(program, num_heads): the all-rows fallback has no
// prefill kernel to do it.
template <typename T>
__global__ void __launch_bounds__(128)
    paged_attention_merge_kernel(const AttentionParams p, const SplitParams s) {
  wait_for_prior_kernels();  // PDL (launch.cuh): before any read of earlier kernels' outputs
  allow_dependent_kernels();
  __shared__ float s_weight[kMaxSplits];
  merge_row<T>(p, s, blockIdx.x / p.num_heads, blockIdx.x % p.num_heads, 1, s_weight);
}

// Split count minimizing waves(s) x (keys per split + a program's fixed cost), where waves(s)
// = ceil(programs * s / resident programs): every row taken at the full max_context. Splitting
// fills idle SMs (few rows) and evens out a last, partial wave; each split adds a program's
// start-up, merge and the partials' traffic.
int choose_num_splits(int64_t programs, int64_t capacity, int64_t max_context, int max_splits) {
  int best = 1;
  double best_cost = 0.0;
  for (int64_t s = 1; s <= max_splits && (s == 1 || max_context / s >= kMinSplitKeys); ++s) {
    const int64_t waves = (programs * s + capacity - 1) / capacity;
    const double cost = static_cast<double>(waves) * ((max_context + s - 1) / s + kProgramCostKeys);
    if (s == 1 || cost < best_cost) {
      best = static_cast<int>(s);
      best_cost = cost;
    }
  }
  return best;
}

template <typename T, typename C, int D, int GP>
int64_t resident_programs() {  // of the split-K (non-cluster) kernel, on the whole GPU
  static const int64_t capacity =
      resident_blocks(paged_attention_decode_kernel<T, C, D, GP, false, false>, kWarps * 32, 0);
  return capacity;
}

// How many 16-block clusters of the cluster kernel the GPU holds at once (0: none, or the
// non-portable size is refused): a launch uses 16 splits only if all its clusters fit.
template <typename T, typename C, int D, int GP, bool kRope>
int resident_clusters_16() {
  static const int clusters = [] {
    auto kernel = paged_attention_decode_kernel<T, C, D, GP, true, kRope>;
    if (cudaFuncSetAttribute(kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1) != cudaSuccess) {
      (void)cudaGetLastError();
      return 0;
    }
    cudaLaunchConfig_t config = {};
    config.gridDim = dim3(1, kMaxClusterSplits);
    config.blockDim = dim3(kWarps * 32);
    cudaLaunchAttribute attribute;
    attribute.id = cudaLaunchAttributeClusterDimension;
    attribute.val.clusterDim.x = 1;
    attribute.val.clusterDim.y = kMaxClusterSplits;
    attribute.val.clusterDim.z = 1;
    config.attrs = &attribute;
    config.numAttrs = 1;
    int n = 0;
    if (cudaOccupancyMaxActiveClusters(&n, kernel, &config) != cudaSuccess) {
      (void)cudaGetLastError();
      return 0;
    }
    return n;
  }();
  return clusters;
}

// Splits of a pure-decode launch of `programs` programs as thread block clusters (at most 16
// splits each), merged there (no workspace); 0: no cluster launch. Only on sm_90+, where the
// launch's clusters are all resident at once (at most one block per SM) and a split has at most
// kMaxClusterSplitKeys keys: clusters win at small batches over short contexts and lose where a
// launch fills the SMs or where their splits are too few for the keys. 16-block clusters
// (non-portable) halve a split, and so the key loop. Measurements: docs/perf.md, "Paged
// attention".
template <typename T, typename C, int D, int GP, bool kRope>
int cluster_splits(int64_t programs, int64_t max_context) {
  if (!cluster_merge_enabled() || at::cuda::getCurrentDeviceProperties()->major < 9) return 0;
  const int64_t sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  const int max_splits = programs <= resident_clusters_16<T, C, D, GP, kRope>() ? kMaxClusterSplits
                                                                            : kPortableClusterSplits;
  const int splits = choose_num_splits(programs, sms, max_context, max_splits);
  return splits > 1 && programs * splits <= sms && max_context <= splits * kMaxClusterSplitKeys ? splits : 0;
}

template <typename T, typename C, int D, int GP>
SplitParams launch(const AttentionParams& p, const at::Tensor& query, bool all_rows, int64_t max_context,
                   at::Tensor& workspace) {
  const int rows = all_rows ? p.num_tokens : p.num_seqs;
  const int chunks = (p.group + GP - 1) / GP;
  const int64_t programs = static_cast<int64_t>(rows) * p.num_kv_heads * chunks;
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  if (all_rows) {
    if (const int splits = cluster_splits<T, C, D, GP, false>(programs, max_context)) {
      launch_kernel_in_clusters(paged_attention_decode_kernel<T, C, D, GP, true, false>,
                                dim3(static_cast<unsigned>(programs), splits), dim3(1, splits, 1), kWarps * 32, 0,
                                stream, p, SplitParams{all_rows, splits, nullptr, nullptr, nullptr}, RopeCacheParams{});
      return SplitParams{all_rows, 1, nullptr, nullptr, nullptr};  // merged: nothing left to the caller
    }
  }
  // on tensor cores (paged_attention_decode_mma.cu) where supported: one program per kv head
  const at::ScalarType dtype = query.scalar_type();
  const bool mma = decode_mma_supported(dtype, p.head_size, p.group);
  const int64_t mma_programs = static_cast<int64_t>(rows) * p.num_kv_heads;
  const int forced = decode_splits_forced();
  const int splits = forced > 0 ? forced
                     : mma      ? choose_num_splits(mma_programs,
                                                    decode_mma_resident_programs(dtype, p.head_size, p.fp8_cache),
                                                    max_context, kMaxSplits)
                                : choose_num_splits(programs, resident_programs<T, C, D, GP>(), max_context, kMaxSplits);
  SplitParams s{all_rows, splits, nullptr, nullptr, nullptr};
  if (splits > 1) {  // workspace from torch's caching allocator: stream-ordered, capture-safe
    const int64_t partials = static_cast<int64_t>(rows) * p.num_heads * splits;
    workspace = at::empty({partials * (p.head_size + 1)}, query.options().dtype(at::kFloat));
    s.partial_out = workspace.mutable_data_ptr<float>();
    s.partial_lse = s.partial_out + partials * p.head_size;
    if (all_rows) s.arrivals = arrival_counters(CounterUser::kAttention, mma ? mma_programs : programs, stream);
  }
  if (mma) {
    launch_paged_attention_decode_mma(p, s, dtype, mma_programs);
  } else {
    launch_kernel(paged_attention_decode_kernel<T, C, D, GP, false, false>,
                  dim3(static_cast<unsigned>(programs), splits), kWarps * 32, 0, stream, p, s, RopeCacheParams{});
  }
  if (all_rows && splits > 1 && s.arrivals == nullptr) {
    launch_kernel(paged_attention_merge_kernel<T>, rows * p.num_heads, 128, 0, stream, p, s);
  }
  return s;
}

// RoPE inside: the cluster launch of kernel <T, D, GP, true, true>, or false (nothing launched)
// where a pure-decode batch of this size would not run in clusters.
template <typename T, int D, int GP>
bool launch_rope(const AttentionParams& p, const RopeCacheParams& r, int64_t max_context) {
  const int64_t programs = static_cast<int64_t>(p.num_tokens) * p.num_kv_heads;  // GP covers the group
  const int splits = cluster_splits<T, T, D, GP, true>(programs, max_context);
  if (splits == 0) return false;
  launch_kernel_in_clusters(paged_attention_decode_kernel<T, T, D, GP, true, true>,
                            dim3(static_cast<unsigned>(programs), splits), dim3(1, splits, 1), kWarps * 32, 0,
                            c10::cuda::getCurrentCUDAStream(), p, SplitParams{true, splits, nullptr, nullptr, nullptr},
                            r);
  return true;
}

template <typename T, int D>
bool dispatch_rope_group(const AttentionParams& p, const RopeCacheParams& r, int64_t max_context) {
  if (p.group == 1) return launch_rope<T, D, 1>(p, r, max_context);
  if (p.group == 2) return launch_rope<T, D, 2>(p, r, max_context);
  if (p.group <= 4) return launch_rope<T, D, 4>(p, r, max_context);
  if (p.group <= 8) return launch_rope<T, D, 8>(p, r, max_context);
  return false;  // chunks of a group would each need the new key
}

template <typename T>
bool dispatch_rope_head_size(const AttentionParams& p, const RopeCacheParams& r, int64_t max_context) {
  if (p.head_size == 64) return dispatch_rope_group<T, 64>(p, r, max_context);
  if (p.head_size == 128) return dispatch_rope_group<T, 128>(p, r, max_context);
  return false;
}

template <typename T, typename C, int D>
SplitParams dispatch_group(const AttentionParams& p, const at::Tensor& query, bool all_rows, int64_t max_context,
                           at::Tensor& workspace) {
  // GP query heads per program: the whole group when it has <= 8 heads (rounded up to a power
  // of two, the extra heads masked), else chunks of 8 (each chunk re-reads the kv head); fp8
  // caches: at most 4 (registers: a lane holds 16 elements of each head's query and output).
  constexpr int kMaxGP = sizeof(C) == 1 ? 4 : 8;
  if (p.group == 1) return launch<T, C, D, 1>(p, query, all_rows, max_context, workspace);
  if (p.group == 2) return launch<T, C, D, 2>(p, query, all_rows, max_context, workspace);
  if (p.group <= 4 || kMaxGP == 4) return launch<T, C, D, 4>(p, query, all_rows, max_context, workspace);
  return launch<T, C, D, kMaxGP>(p, query, all_rows, max_context, workspace);
}

template <typename T, typename C>
SplitParams dispatch_head_size(const AttentionParams& p, const at::Tensor& query, bool all_rows, int64_t max_context,
                               at::Tensor& workspace) {
  switch (p.head_size) {
    case 64: return dispatch_group<T, C, 64>(p, query, all_rows, max_context, workspace);
    case 128: return dispatch_group<T, C, 128>(p, query, all_rows, max_context, workspace);
    case 256: return dispatch_group<T, C, 256>(p, query, all_rows, max_context, workspace);
    default: TORCH_CHECK(false, "paged_attention: unsupported head_size");  // checked in paged_attention.cpp
  }
}

// The cache's element type: the query's, or float8_e4m3fn (p.fp8_cache).
template <typename T>
SplitParams dispatch_cache(const AttentionParams& p, const at::Tensor& query, bool all_rows, int64_t max_context,
                           at::Tensor& workspace) {
  if (p.fp8_cache) return dispatch_head_size<T, __nv_fp8_e4m3>(p, query, all_rows, max_context, workspace);
  return dispatch_head_size<T, T>(p, query, all_rows, max_context, workspace);
}

}  // namespace

bool launch_rope_paged_attention_decode(const AttentionParams& p, const RopeCacheParams& r, at::ScalarType dtype,
                                        int64_t max_context) {
  switch (dtype) {
    case at::kBFloat16: return dispatch_rope_head_size<__nv_bfloat16>(p, r, max_context);
    case at::kHalf: return dispatch_rope_head_size<__half>(p, r, max_context);
    default: return false;
  }
}

SplitParams launch_paged_attention_decode(const AttentionParams& p, const at::Tensor& query, bool all_rows,
                                          int64_t max_context, at::Tensor& workspace) {
  switch (query.scalar_type()) {
    case at::kBFloat16: return dispatch_cache<__nv_bfloat16>(p, query, all_rows, max_context, workspace);
    case at::kHalf: return dispatch_cache<__half>(p, query, all_rows, max_context, workspace);
    case at::kFloat: return dispatch_cache<float>(p, query, all_rows, max_context, workspace);
    default: TORCH_CHECK(false, "paged_attention: unsupported dtype");  // checked in paged_attention.cpp
  }
}

}  // namespace compilelm::cuda
