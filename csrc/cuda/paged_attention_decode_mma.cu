// Paged attention for single query rows (decode) on tensor cores: the launches of
// paged_attention_decode.cu that fill the GPU (outside thread block clusters), bf16/fp16 queries,
// bf16/fp16 or FP8 (e4m3) caches, head_size 64/128, GQA groups of up to 16 heads.
//
// A program = (query row, kv head, split), as in the CUDA-core kernel. The group's query heads
// are the 16 rows of an mma.sync m16n8k16 A operand (rows past the group: zeros), so S = Q K^T
// and O += P V over 16 keys are 32 tensor-core instructions (head_size 128) where the CUDA-core
// kernel issues ~1100 (FMAs, the dot products' shuffles, widening): that kernel is bound by its
// instruction issue, not by memory. Each warp streams its own tiles of 16 keys (tile t of the
// split goes to warp t % 4) through a kStages-deep cp.async ring in shared memory, so two tiles
// per warp are in flight while it computes a third, with no block barrier in the key loop. The
// warps' softmax states merge at the end, and the split's output, partial and last-split merge
// are the CUDA-core kernel's (attention_common.cuh). As in the prefill kernel the softmax weights
// are rounded to the operand type before P @ V. RoPE stays out of this kernel (rope_and_cache runs
// before it): inside, it cost more than the kernel it saves. Measurements: docs/perf.md, "Paged
// attention".
//
// FP8 caches (C = __nv_fp8_e4m3): the ring holds the codes (16 a 16-byte copy: half a 16-bit
// tile's bytes), and the products read them from the ring with the same ldmatrix, widening in
// registers (a cvt per two codes; e4m3 is a subset of fp16, so exact) with no staging tile. An
// ldmatrix of codes gives a lane 4 consecutive codes where an fp16 B fragment holds pairs 8 apart,
// so the fragments are used in a permuted order the other operand follows: in S = Q K^T the head
// dimension (a sum: the query fragments are loaded in the same order), in O += P V the output
// columns (even and odd elements in separate accumulator tiles, put back in order at the end).
// Both products run in fp16: the queries rounded to fp16 (clamped to its range), the softmax
// weights P in fp16 (finer than bf16). k_scale is folded into the softmax scale (p.scale_log2),
// v_scale multiplies the output, as in the CUDA-core kernel.
//
// The key loop is partly bound by instruction issue, so a tile that starts on a cache block's
// boundary (block_size a multiple of 16, as the engine's 16) loads its block-table entry once and
// steps its rows by a fixed stride instead of dividing every row's key by block_size.
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>

#include <algorithm>

#include "cuda/attention_common.cuh"
#include "cuda/launch.cuh"
#include "cuda/mma.cuh"

namespace compilelm::cuda {
namespace {

constexpr int kWarps = 4;
constexpr int kTileKeys = 16;  // keys per tile: the n of S = Q K^T, the k of O += P V
constexpr int kRows = 16;      // query heads of a program, at most (the m of both products)
constexpr int kStages = 3;     // tiles of a warp's ring: two in flight while one is computed

template <typename C>
constexpr int ring_stride(int d) {  // elements of a ring row: 16 bytes of padding, so 8 consecutive rows hit distinct banks
  return d + 16 / static_cast<int>(sizeof(C));
}
template <typename C, int D>
constexpr int ring_bytes() {  // kStages tiles of K and of V per warp, in the cache's type
  return kWarps * kStages * 2 * kTileKeys * ring_stride<C>(D) * static_cast<int>(sizeof(C));
}
template <typename C, int D>
constexpr int smem_bytes() {
  return ring_bytes<C, D>();
}
static_assert(smem_bytes<__half, 64>() >= kWarps * kRows * 64 * 4, "the warps' states reuse the ring");
static_assert(smem_bytes<__nv_fp8_e4m3, 64>() >= kWarps * kRows * 64 * 4, "the warps' states reuse the ring");

__device__ __forceinline__ uint32_t load_pair(const void* ptr) { return *static_cast<const uint32_t*>(ptr); }

// The low / high two e4m3 codes of a register as one f16x2 register (exact).
__device__ __forceinline__ uint32_t widen_low(uint32_t codes) {
  return fp8x2_to_half2_bits(static_cast<uint16_t>(codes & 0xffffu));
}
__device__ __forceinline__ uint32_t widen_high(uint32_t codes) {
  return fp8x2_to_half2_bits(static_cast<uint16_t>(codes >> 16));
}

// Two query elements as one register of the products' type Op (the low element first): as they
// are, or (FP8 caches, bf16 queries) rounded to fp16, clamped to its finite range.
template <typename Op, typename T>
__device__ __forceinline__ uint32_t load_query_pair(const T* ptr) {
  if constexpr (std::is_same_v<Op, T>) {
    return load_pair(ptr);
  } else {
    constexpr float kMax = 65504.f;
    return pack<Op>(fminf(fmaxf(to_float(ptr[0]), -kMax), kMax), fminf(fmaxf(to_float(ptr[1]), -kMax), kMax));
  }
}

// T: the queries' and output's type; C: the cache's (T, or __nv_fp8_e4m3).
template <typename T, typename C, int D>
__global__ void __launch_bounds__(kWarps * 32)
    paged_attention_decode_mma_kernel(const AttentionParams p, const SplitParams s) {
  constexpr bool kFp8 = sizeof(C) == 1;
  using Op = std::conditional_t<kFp8, __half, T>;  // the products' operand type
  constexpr int kCStride = ring_stride<C>(D);      // of a ring tile (C)
  constexpr int kChunkElems = 16 / static_cast<int>(sizeof(C));
  constexpr int kChunks = D / kChunkElems;  // 16-byte chunks of a cache row
  extern __shared__ __align__(16) unsigned char smem[];
  __shared__ float s_m[kWarps][kRows], s_l[kWarps][kRows];
  __shared__ float s_weight[kRows][kMaxSplits];  // the last split's merge weights
  __shared__ bool s_last;

  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int row = blockIdx.x / p.num_kv_heads, kv_head = blockIdx.x % p.num_kv_heads;
  const int head0 = kv_head * p.group, num_q = p.group;
  const int split = blockIdx.y;

  // Before the PDL wait (launch.cuh): the step's metadata and the context rows of earlier steps
  const DecodeRange range = decode_range(p, s, row, split);
  const bool located = range.located;
  const int token = range.token, seq = range.seq, num_keys = range.num_keys, active = range.active;
  const int begin = range.begin, end = range.end, fresh = range.fresh;
  const int tiles = located && split < active && begin < end ? (end - begin + kTileKeys - 1) / kTileKeys : 0;
  const int my_tiles = tiles > warp ? (tiles - warp + kWarps - 1) / kWarps : 0;

  const int32_t* block_table = p.block_tables + static_cast<int64_t>(located ? seq : 0) * p.max_blocks;
  const C* key_cache = static_cast<const C*>(p.key_cache) + kv_head * p.head_stride;
  const C* value_cache = static_cast<const C*>(p.value_cache) + kv_head * p.head_stride;
  C* s_k = reinterpret_cast<C*>(smem) + warp * kStages * 2 * kTileKeys * kCStride;  // [kStages][kTileKeys][kCStride]
  C* s_v = s_k + kStages * kTileKeys * kCStride;

  const auto first_key = [&](int i) { return begin + (warp + i * kWarps) * kTileKeys; };  // of the warp's tile i
  // Tiles that start on a cache block's boundary lie in one block (block_size a multiple of the
  // tile): one block-table load per tile, and a lane's rows are its first row + a fixed stride,
  // where the general path divides every row's key by block_size (the key loop's issue slots).
  const bool block_tiles = p.block_size % kTileKeys == 0 && begin % kTileKeys == 0;
  constexpr int kRowsPerPass = 32 / kChunks;  // rows of a tile one pass of the warp's lanes covers
  const int64_t lane_offset = (lane / kChunks) * p.slot_stride + (lane % kChunks) * kChunkElems;
  const auto load_tile = [&](int i) {  // rows past `end` are zero-filled, their scores masked
    const int key0 = first_key(i), stage = i % kStages;
    if (block_tiles) {
      const int64_t base = static_cast<int64_t>(block_table[key0 / p.block_size]) * p.block_stride +
                           key0 % p.block_size * p.slot_stride + lane_offset;
#pragma unroll
      for (int pass = 0; pass < kTileKeys / kRowsPerPass; ++pass) {
        const int j = pass * kRowsPerPass + lane / kChunks;
        const int64_t offset = base + static_cast<int64_t>(pass * kRowsPerPass) * p.slot_stride;
        const int dst = (stage * kTileKeys + j) * kCStride + (lane % kChunks) * kChunkElems;
        const bool valid = key0 + j < end;
        cp_async_16(s_k + dst, key_cache + offset, valid);
        cp_async_16(s_v + dst, value_cache + offset, valid);
      }
      return;
    }
#pragma unroll
    for (int c = lane; c < kTileKeys * kChunks; c += 32) {
      const int j = c / kChunks, piece = c % kChunks, key = key0 + j;
      const bool valid = key < end;
      int64_t offset = 0;
      if (valid) offset = block_table[key / p.block_size] * p.block_stride + key % p.block_size * p.slot_stride;
      const int dst = (stage * kTileKeys + j) * kCStride + piece * kChunkElems;
      cp_async_16(s_k + dst, key_cache + offset + piece * kChunkElems, valid);
      cp_async_16(s_v + dst, value_cache + offset + piece * kChunkElems, valid);
    }
  };
  // the ring's first kStages - 1 tiles, one commit group each (empty past my_tiles): before the
  // wait where they hold only keys of earlier steps (below `fresh`)
  const int prologue = min(my_tiles, kStages - 1);
  const bool early = prologue > 0 && first_key(prologue - 1) + kTileKeys <= fresh;
  const auto load_prologue = [&] {
#pragma unroll
    for (int i = 0; i < kStages - 1; ++i) {
      if (i < prologue) load_tile(i);
      cp_async_commit();
    }
  };
  if (early) load_prologue();
  wait_for_prior_kernels();  // PDL (launch.cuh): before any read of earlier kernels' outputs
  allow_dependent_kernels();
  if (!located) {
    const bool zeroes = s.num_splits == 1 || (s.arrivals != nullptr && split == 0);  // else the merge kernel
    if (s.all_rows && zeroes && row < p.num_tokens) zero_rows<T>(p, row, 1, head0, num_q);  // padding row
    return;
  }
  if (split >= active) return;  // no keys: no partial, not counted
  if (!early) load_prologue();

  // A fragments of the group's query rows (lane = 4 * group + quad: rows group, group + 8), at
  // columns 2 quad (+ 8) of each 16; FP8 caches: at columns 4 quad (+ 2), the K fragments' order
  const int group_row = lane / 4, quad = lane % 4;
  constexpr int kQuadStep = kFp8 ? 4 : 2, kHalfStep = kFp8 ? 2 : 8;
  const T* query =
      static_cast<const T*>(p.query) + static_cast<int64_t>(token) * p.q_stride + head0 * D + kQuadStep * quad;
  uint32_t q_frag[D / 16][4];
#pragma unroll
  for (int ks = 0; ks < D / 16; ++ks) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int r = group_row + 8 * h;
      q_frag[ks][h] = r < num_q ? load_query_pair<Op>(query + r * D + ks * 16) : 0u;
      q_frag[ks][h + 2] = r < num_q ? load_query_pair<Op>(query + r * D + ks * 16 + kHalfStep) : 0u;
    }
  }
  // FP8: the ring row of ldmatrix matrix lane / 8 for keys (lane / 8) % 2 * 8 + lane % 8 and
  // 16-code chunk 2 t + lane / 16 of a head: x4 = {keys 0-7, keys 8-15} x chunks {2 t, 2 t + 1}
  const int fp8_row = ((lane / 8) % 2 * 8 + lane % 8) * kCStride + (lane / 16) * 16;

  float o[D / 8][4] = {};  // O of rows (group, group + 8) x elements 8 dt + 2 quad (+1)
  float m[2] = {-INFINITY, -INFINITY}, l_sum[2] = {0.f, 0.f};
  for (int i = 0; i < my_tiles; ++i) {
    if (i + kStages - 1 < my_tiles) load_tile(i + kStages - 1);
    cp_async_commit();
    cp_async_wait<kStages - 1>();  // tile i has landed (this lane's copies) ...
    __syncwarp();                  // ... and every lane's
    const C* k_ring = s_k + (i % kStages) * kTileKeys * kCStride;
    const C* v_ring = s_v + (i % kStages) * kTileKeys * kCStride;

    // S = Q K^T: [16 rows x 16 keys] as two accumulator tiles of 8 keys
    float sc[2][4] = {};
    if constexpr (kFp8) {
      // a lane's register of a matrix: codes 4 quad .. 4 quad + 3 of a chunk, for key `group`:
      // the first two are B's rows 2 quad (+1), the last two its rows 2 quad + 8 (+1)
#pragma unroll
      for (int t = 0; t < D / 32; ++t) {
        uint32_t r[4];
        ldmatrix_x4(r, k_ring + fp8_row + 32 * t);
#pragma unroll
        for (int c = 0; c < 2; ++c) {
#pragma unroll
          for (int nt = 0; nt < 2; ++nt) {
            mma<Op>(sc[nt], q_frag[2 * t + c], widen_low(r[2 * c + nt]), widen_high(r[2 * c + nt]));
          }
        }
      }
    } else {
#pragma unroll
      for (int ks = 0; ks < D / 16; ++ks) {
        uint32_t b[4];
        ldmatrix_x4(b, k_ring + ((lane / 16) * 8 + lane % 8) * kCStride + ks * 16 + ((lane / 8) % 2) * 8);
        mma<Op>(sc[0], q_frag[ks], b[0], b[1]);
        mma<Op>(sc[1], q_frag[ks], b[2], b[3]);
      }
    }
    const int key0 = first_key(i);
#pragma unroll
    for (int nt = 0; nt < 2; ++nt) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        sc[nt][e] *= p.scale_log2;
        if (key0 + nt * 8 + 2 * quad + (e & 1) >= end) sc[nt][e] = -INFINITY;
      }
    }

    // online softmax of each row: key0 < end, so every tile has a finite maximum
    online_softmax_step(sc, o, m, l_sum);

    // O += P V: the two accumulator tiles of P are the A fragment of the product
    const uint32_t a[4] = {pack<Op>(sc[0][0], sc[0][1]), pack<Op>(sc[0][2], sc[0][3]), pack<Op>(sc[1][0], sc[1][1]),
                           pack<Op>(sc[1][2], sc[1][3])};
    if constexpr (kFp8) {
      // a lane's register of a transposed matrix: bytes (key 2 quad: elements 2 group, 2 group + 1),
      // then key 2 quad + 1's: regrouped by element, the B fragments of two output tiles, the
      // chunk's even elements (o[2 chunk]) and its odd ones (o[2 chunk + 1])
#pragma unroll
      for (int t = 0; t < D / 32; ++t) {
        uint32_t r[4];
        ldmatrix_x4_trans(r, v_ring + fp8_row + 32 * t);
#pragma unroll
        for (int c = 0; c < 2; ++c) {
          const uint32_t lo = __byte_perm(r[2 * c], 0, 0x3120), hi = __byte_perm(r[2 * c + 1], 0, 0x3120);
          const int chunk = 2 * t + c;
          mma<Op>(o[2 * chunk], a, widen_low(lo), widen_low(hi));
          mma<Op>(o[2 * chunk + 1], a, widen_high(lo), widen_high(hi));
        }
      }
    } else {
#pragma unroll
      for (int dp = 0; dp < D / 16; ++dp) {
        uint32_t b[4];
        ldmatrix_x4_trans(b, v_ring + (((lane / 8) % 2) * 8 + lane % 8) * kCStride + dp * 16 + (lane / 16) * 8);
        mma<Op>(o[2 * dp], a, b[0], b[1]);
        mma<Op>(o[2 * dp + 1], a, b[2], b[3]);
      }
    }
    __syncwarp();  // every lane is done with this stage before it is refilled
  }
  cp_async_wait<0>();  // the ring's trailing empty groups

  // the warps' states into shared memory (over the rings, once every warp is done with its own)
  float(*s_acc)[kRows][D] = reinterpret_cast<float(*)[kRows][D]>(smem);
  __syncthreads();
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    l_sum[h] += __shfl_xor_sync(0xffffffffu, l_sum[h], 1);
    l_sum[h] += __shfl_xor_sync(0xffffffffu, l_sum[h], 2);
    const int r = group_row + 8 * h;
    if (r >= num_q) continue;
#pragma unroll
    for (int dt = 0; dt < D / 8; ++dt) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        // element of o[dt][2 h + e]: 8 dt + 2 quad + e; FP8: the chunk's even or odd elements
        const int d = kFp8 ? (dt / 2) * 16 + 4 * quad + 2 * e + dt % 2 : dt * 8 + 2 * quad + e;
        s_acc[warp][r][d] = o[dt][2 * h + e];
      }
    }
    if (quad == 0) {
      s_m[warp][r] = m[h];
      s_l[warp][r] = l_sum[h];
    }
  }
  __syncthreads();
  merge_warp_states<kWarps, kRows, D>(num_q, s_acc, s_m, s_l, [&](int g, int d, float out, float lse) {
    // FP8 caches: values = code * v_scale (1 otherwise: exact)
    store_decode_output<T>(p, s, row, token, head0 + g, split, d, out * p.v_scale, lse);
  });
  merge_if_last_split<T>(p, s, row, token, num_keys, head0, num_q, active, s_last, &s_weight[0][0]);
}

template <typename T, typename C, int D>
void configure() {  // more than 48 KB of dynamic shared memory is opt-in
  static const bool configured = [] {
    C10_CUDA_CHECK(cudaFuncSetAttribute(paged_attention_decode_mma_kernel<T, C, D>,
                                        cudaFuncAttributeMaxDynamicSharedMemorySize, smem_bytes<C, D>()));
    return true;
  }();
  (void)configured;
}

template <typename T, typename C, int D>
int64_t resident_programs() {
  static const int64_t capacity = [] {
    configure<T, C, D>();  // (the shared-memory limit the occupancy depends on)
    return resident_blocks(paged_attention_decode_mma_kernel<T, C, D>, kWarps * 32, smem_bytes<C, D>());
  }();
  return capacity;
}

template <typename T, typename C, int D>
void launch(const AttentionParams& p, const SplitParams& s, int64_t programs) {
  configure<T, C, D>();
  launch_kernel(paged_attention_decode_mma_kernel<T, C, D>, dim3(static_cast<unsigned>(programs), s.num_splits),
                kWarps * 32, smem_bytes<C, D>(), c10::cuda::getCurrentCUDAStream(), p, s);
}

// (query type T) x (cache: T, or fp8) x head_size
template <typename T>
int64_t resident_programs_of(int head_size, bool fp8_cache) {
  if (fp8_cache) return head_size == 64 ? resident_programs<T, __nv_fp8_e4m3, 64>()
                                        : resident_programs<T, __nv_fp8_e4m3, 128>();
  return head_size == 64 ? resident_programs<T, T, 64>() : resident_programs<T, T, 128>();
}

template <typename T>
void launch_of(const AttentionParams& p, const SplitParams& s, int64_t programs) {
  if (p.fp8_cache) {
    return p.head_size == 64 ? launch<T, __nv_fp8_e4m3, 64>(p, s, programs)
                             : launch<T, __nv_fp8_e4m3, 128>(p, s, programs);
  }
  return p.head_size == 64 ? launch<T, T, 64>(p, s, programs) : launch<T, T, 128>(p, s, programs);
}

}  // namespace

bool decode_mma_supported(at::ScalarType dtype, int head_size, int group) {
  return decode_mma_enabled() && (dtype == at::kBFloat16 || dtype == at::kHalf) &&
         (head_size == 64 || head_size == 128) && group <= kRows;
}

int64_t decode_mma_resident_programs(at::ScalarType dtype, int head_size, bool fp8_cache) {
  return dtype == at::kBFloat16 ? resident_programs_of<__nv_bfloat16>(head_size, fp8_cache)
                                : resident_programs_of<__half>(head_size, fp8_cache);
}

void launch_paged_attention_decode_mma(const AttentionParams& p, const SplitParams& s, at::ScalarType dtype,
                                       int64_t programs) {
  if (dtype == at::kBFloat16) return launch_of<__nv_bfloat16>(p, s, programs);
  launch_of<__half>(p, s, programs);
}

}  // namespace compilelm::cuda
