// Paged attention for prefill and chunked-prefill rows (q_len > 1): a tiled flash attention on
// tensor cores (mma.sync m16n8k16, bf16/fp16 operands, fp32 accumulation) reading keys and
// values from the pages.
//
// A program = (query tile, kv head). Its kBlockM query vectors are (row, head) pairs: R rows
// times the group's G heads (GQA packing, R = kBlockM / G), so each key/value tile loaded into
// shared memory serves the whole group. Key tiles of kBlockN positions are double-buffered with
// cp.async (rows past the context are zero-filled, never read); each of the 4 warps owns 16
// query vectors: S = Q K^T and O += P V on tensor cores, online softmax in registers.
//
// Tiles are numbered without reading the batch on the host: sequence i owns tiles
// [cu[i] / R + i, cu[i + 1] / R + i + 1) (enough for ceil(q_len / R) tiles), so the grid is
// num_tokens / R + num_seqs + 1 programs; the ones past the last sequence zero padding rows.
// When the decode kernel ran split-K, num_seqs more programs merge its partials (one per
// sequence and kv head, all heads of the group): this kernel runs after it on the stream.
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>

#include "cuda/attention_common.cuh"
#include "cuda/launch.cuh"
#include "cuda/mma.cuh"

namespace compilelm::cuda {
namespace {

constexpr int kBlockM = 64;  // query vectors per program
constexpr int kBlockN = 64;  // keys per tile
constexpr int kWarps = 4;    // 16 query vectors each
constexpr int kPad = 8;      // elements per shared row: 8 consecutive rows hit distinct banks

template <int D>
constexpr int smem_bytes() {
  return (kBlockM + 4 * kBlockN) * (D + kPad) * 2;  // Q, 2 stages of K and of V (16-bit types)
}

template <typename T, int D>
__global__ void __launch_bounds__(kWarps * 32)
    paged_attention_prefill_kernel(const AttentionParams p, const SplitParams splits, const int rows_per_tile,
                                   const bool prefill_rows) {
  wait_for_prior_kernels();  // PDL (launch.cuh): before any read of earlier kernels' outputs
  allow_dependent_kernels();
  constexpr int kStride = D + kPad;
  constexpr int kChunks = D / 8;  // 16-byte chunks per row
  extern __shared__ __align__(16) unsigned char smem[];
  T* s_q = reinterpret_cast<T*>(smem);   // [kBlockM][kStride]
  T* s_k = s_q + kBlockM * kStride;      // [2][kBlockN][kStride]
  T* s_v = s_k + 2 * kBlockN * kStride;  // [2][kBlockN][kStride]

  const int R = rows_per_tile, G = p.group;
  const int kv_head = blockIdx.y;
  const int tile = blockIdx.x;
  const int32_t* cu = p.cu_seqlens_q;
  const int merge_program = tile - (p.num_tokens / R + p.num_seqs + 1);
  if (merge_program >= 0) {
    merge_row<T>(p, splits, merge_program, kv_head * G, G, reinterpret_cast<float*>(smem));  // G x kMaxSplits floats
    return;
  }
  const int padding_tile = cu[p.num_seqs] / R + p.num_seqs;
  if (tile >= padding_tile) {
    zero_rows<T>(p, cu[p.num_seqs] + (tile - padding_tile) * R, R, kv_head * G, G);
    return;
  }
  int seq = 0;  // the last sequence whose first tile is <= tile
  for (int lo = 0, hi = p.num_seqs - 1; lo <= hi;) {
    const int mid = (lo + hi) / 2;
    if (cu[mid] / R + mid <= tile) { seq = mid; lo = mid + 1; } else { hi = mid - 1; }
  }
  const int q_len = cu[seq + 1] - cu[seq];
  const int row0 = (tile - (cu[seq] / R + seq)) * R;  // first query row of the tile in its sequence
  if (q_len <= 1 || row0 >= q_len || !prefill_rows) return;  // decode rows: the decode kernel's
  const int row_end = min(row0 + R, q_len);
  const int context = p.seq_lens[seq] - q_len;         // cached positions before row 0
  const int num_keys = context + row_end;
  const int num_vectors = (row_end - row0) * G;

  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const T* query = static_cast<const T*>(p.query);
  const T* key_cache = static_cast<const T*>(p.key_cache);
  const T* value_cache = static_cast<const T*>(p.value_cache);
  const int32_t* block_table = p.block_tables + static_cast<int64_t>(seq) * p.max_blocks;

  // Q tile: vector i = (row row0 + i / G, head kv_head * G + i % G); missing vectors are zeros.
  for (int c = tid; c < kBlockM * kChunks; c += blockDim.x) {
    const int i = c / kChunks, chunk = c % kChunks;
    const bool valid = i < num_vectors;
    const T* src = valid ? query + (cu[seq] + row0 + i / G) * p.q_stride + (kv_head * G + i % G) * D + chunk * 8
                         : query;
    cp_async_16(s_q + i * kStride + chunk * 8, src, valid);
  }
  const auto load_kv = [&](int key_tile, int stage) {
    for (int c = tid; c < kBlockN * kChunks; c += blockDim.x) {
      const int j = c / kChunks, chunk = c % kChunks;
      const int key = key_tile * kBlockN + j;
      const bool valid = key < num_keys;
      int64_t offset = 0;
      if (valid) {
        offset = block_table[key / p.block_size] * p.block_stride + key % p.block_size * p.slot_stride +
                 kv_head * p.head_stride + chunk * 8;
      }
      const int dst = (stage * kBlockN + j) * kStride + chunk * 8;
      cp_async_16(s_k + dst, key_cache + offset, valid);
      cp_async_16(s_v + dst, value_cache + offset, valid);
    }
  };
  load_kv(0, 0);
  cp_async_commit();
  cp_async_wait<0>();
  __syncthreads();

  uint32_t q_frag[D / 16][4];  // A fragments of this warp's 16 query vectors
#pragma unroll
  for (int ks = 0; ks < D / 16; ++ks) {
    ldmatrix_x4(q_frag[ks], s_q + (warp * 16 + lane % 16) * kStride + ks * 16 + (lane / 16) * 8);
  }

  // This thread's two accumulator rows: vectors warp*16 + lane/4 (+ 8). Missing vectors take
  // the last row's position so that their softmax stays finite (they are not written).
  int position[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int i = min(warp * 16 + lane / 4 + 8 * h, num_vectors - 1);
    position[h] = context + row0 + i / G;
  }
  const int first_position = context + row0;

  float o[D / 8][4] = {};
  float m[2] = {-INFINITY, -INFINITY}, l_sum[2] = {0.f, 0.f};
  const int num_tiles = (num_keys + kBlockN - 1) / kBlockN;
  for (int t = 0; t < num_tiles; ++t) {
    const int stage = t & 1;
    if (t + 1 < num_tiles) {
      load_kv(t + 1, stage ^ 1);
      cp_async_commit();
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();
    const T* k_tile = s_k + stage * kBlockN * kStride;
    const T* v_tile = s_v + stage * kBlockN * kStride;

    // S = Q K^T: [16 vectors x kBlockN keys] per warp, as kBlockN / 8 accumulator tiles
    float s[kBlockN / 8][4] = {};
#pragma unroll
    for (int ks = 0; ks < D / 16; ++ks) {
#pragma unroll
      for (int np = 0; np < kBlockN / 16; ++np) {
        uint32_t b[4];
        ldmatrix_x4(b, k_tile + (np * 16 + (lane / 16) * 8 + lane % 8) * kStride + ks * 16 + ((lane / 8) % 2) * 8);
        mma<T>(s[2 * np], q_frag[ks], b[0], b[1]);
        mma<T>(s[2 * np + 1], q_frag[ks], b[2], b[3]);
      }
    }

    // scale, causal mask (only tiles reaching past the first row's position need it)
    const int key0 = t * kBlockN;
    const bool masked = key0 + kBlockN - 1 > first_position;
#pragma unroll
    for (int nt = 0; nt < kBlockN / 8; ++nt) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int key = key0 + nt * 8 + (lane % 4) * 2 + (e & 1);
        s[nt][e] *= p.scale_log2;
        if (masked && key > position[e / 2]) s[nt][e] = -INFINITY;
      }
    }

    // online softmax over each row (key 0 is in every row's first tile: a finite max)
    online_softmax_step(s, o, m, l_sum);

    // O += P V: the accumulator tiles of P are, pairwise, the A fragments of the next product
#pragma unroll
    for (int kk = 0; kk < kBlockN / 16; ++kk) {
      const uint32_t a[4] = {pack<T>(s[2 * kk][0], s[2 * kk][1]), pack<T>(s[2 * kk][2], s[2 * kk][3]),
                             pack<T>(s[2 * kk + 1][0], s[2 * kk + 1][1]),
                             pack<T>(s[2 * kk + 1][2], s[2 * kk + 1][3])};
#pragma unroll
      for (int dp = 0; dp < D / 16; ++dp) {
        uint32_t b[4];
        ldmatrix_x4_trans(b, v_tile + (kk * 16 + ((lane / 8) % 2) * 8 + lane % 8) * kStride + dp * 16 + (lane / 16) * 8);
        mma<T>(o[2 * dp], a, b[0], b[1]);
        mma<T>(o[2 * dp + 1], a, b[2], b[3]);
      }
    }
    __syncthreads();  // the next iteration's load overwrites this stage
  }

#pragma unroll
  for (int h = 0; h < 2; ++h) {
    l_sum[h] += __shfl_xor_sync(0xffffffffu, l_sum[h], 1);
    l_sum[h] += __shfl_xor_sync(0xffffffffu, l_sum[h], 2);
    const int i = warp * 16 + lane / 4 + 8 * h;
    if (i >= num_vectors) continue;
    const int64_t token = cu[seq] + row0 + i / G;
    T* dst = static_cast<T*>(p.out) + (token * p.num_heads + kv_head * G + i % G) * D + (lane % 4) * 2;
    const float inv = 1.f / l_sum[h];
#pragma unroll
    for (int dt = 0; dt < D / 8; ++dt) {
      *reinterpret_cast<uint32_t*>(dst + dt * 8) = pack<T>(o[dt][2 * h] * inv, o[dt][2 * h + 1] * inv);
    }
  }
}

template <typename T, int D>
void launch(const AttentionParams& p, const SplitParams& splits, bool prefill_rows) {
  const auto kernel = paged_attention_prefill_kernel<T, D>;
  static const bool configured = [&] {  // more than 48 KB of dynamic shared memory is opt-in
    C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_bytes<D>()));
    return true;
  }();
  (void)configured;
  const int rows_per_tile = kBlockM / p.group;
  const int tiles = p.num_tokens / rows_per_tile + p.num_seqs + 1;
  const int merges = splits.num_splits > 1 ? p.num_seqs : 0;
  launch_kernel(kernel, dim3(tiles + merges, p.num_kv_heads), kWarps * 32, smem_bytes<D>(),
                c10::cuda::getCurrentCUDAStream(), p, splits, rows_per_tile, prefill_rows);
}

template <typename T>
void dispatch_head_size(const AttentionParams& p, const SplitParams& splits, bool prefill_rows) {
  if (p.head_size == 64) return launch<T, 64>(p, splits, prefill_rows);
  return launch<T, 128>(p, splits, prefill_rows);
}

}  // namespace

bool prefill_supported(at::ScalarType dtype, int head_size, int group) {
  return (dtype == at::kBFloat16 || dtype == at::kHalf) && (head_size == 64 || head_size == 128) &&
         group <= kBlockM;
}

void launch_paged_attention_prefill(const AttentionParams& p, const SplitParams& splits, const at::Tensor& query,
                                    bool prefill_rows) {
  if (query.scalar_type() == at::kBFloat16) return dispatch_head_size<__nv_bfloat16>(p, splits, prefill_rows);
  return dispatch_head_size<__half>(p, splits, prefill_rows);
}

}  // namespace compilelm::cuda
