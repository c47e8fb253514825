// Host-side entry points of the CUDA kernels (.cu files), called by the op implementations
// (.cpp files): the .cpp side validates the inputs and formats the error messages, so a .cu
// file holds only kernels and the launch logic (grid, split count, workspace).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>

namespace compilelm::cuda {

// One paged_attention call. Layouts as in csrc/ops.cpp; all index tensors contiguous int32.
struct AttentionParams {
  const void* query;            // [num_tokens, num_heads, head_size], token stride q_stride
  const void* key_cache;        // [num_blocks, block_size, num_kv_heads, head_size], strides below
  const void* value_cache;      // the same shape and strides
  void* out;                    // [num_tokens, num_heads, head_size], contiguous
  const int32_t* cu_seqlens_q;  // [num_seqs + 1]
  const int32_t* seq_lens;      // [num_seqs]
  const int32_t* block_tables;  // [num_seqs, max_blocks]
  int64_t q_stride;
  int64_t block_stride, slot_stride, head_stride;  // of the caches, in elements (head_size: stride 1)
  int num_seqs, num_tokens, num_heads, num_kv_heads, group, head_size, block_size, max_blocks;
  float scale_log2;  // softmax scale * log2(e) (* k_scale, fp8 caches): scores are exponentiated with exp2
  bool fp8_cache;    // the caches are float8_e4m3fn (FP8 KV cache): keys = code * k_scale (folded into
                     // scale_log2), values = code * v_scale
  float v_scale;     // fp8 caches: applied to each normalized output (1 otherwise)
};

// Split-K of the decode kernel: its programs' partial outputs, still to be merged.
struct SplitParams {
  bool all_rows;       // decode program rows are query rows (all rows) or sequences (q_len == 1 rows)
  int num_splits;      // 1: the decode kernel wrote the output itself
  float* partial_out;  // [rows, num_heads, num_splits, head_size]
  float* partial_lse;  // [rows, num_heads, num_splits], log2 of each split's softmax denominator
  // all_rows only, or null: one arrival count per program x (zero between launches); the split
  // that arrives last merges the program's heads, so no merge kernel runs.
  int* arrivals;
};

// Launchers (host side, on the current stream; `query` gives dtype and device).
//
// The decode launcher serves the q_len == 1 rows of every sequence, or, with all_rows, every
// query row (the fallback for shapes the tiled kernel does not cover; then it also zeroes
// padding rows and merges its own splits). max_context bounds seq_lens (block_tables.size(1) *
// block_size) and sizes the split-K; the workspace it allocates is returned in `workspace`.
// The prefill launcher serves the q_len > 1 rows, zeroes the padding rows and merges the decode
// rows' splits (one launch fewer than a merge kernel of its own).
SplitParams launch_paged_attention_decode(const AttentionParams& p, const at::Tensor& query, bool all_rows,
                                          int64_t max_context, at::Tensor& workspace);
bool prefill_supported(at::ScalarType dtype, int head_size, int group);
// The decode launcher's tensor-core kernel (paged_attention_decode_mma.cu), for its launches
// outside clusters where supported and turned on (compilelm::set_decode_mma), model-dtype and
// FP8 caches (p.fp8_cache): one program per (row, kv head) x num_splits, `programs` of them.
bool decode_mma_supported(at::ScalarType dtype, int head_size, int group);
int64_t decode_mma_resident_programs(at::ScalarType dtype, int head_size, bool fp8_cache);
void launch_paged_attention_decode_mma(const AttentionParams& p, const SplitParams& s, at::ScalarType dtype,
                                       int64_t programs);
// prefill_rows=false: the padding and merges only, the q_len > 1 rows left to the caller.
void launch_paged_attention_prefill(const AttentionParams& p, const SplitParams& splits, const at::Tensor& query,
                                    bool prefill_rows = true);

// Copies key/value rows to their cache slots (see reshape_and_cache.cpp), in 16-byte units
// when vectorized, else in elements.
// A float8_e4m3fn cache (FP8 KV cache) stores fp8(x / scale) per element instead (k_scale, v_scale).
void launch_reshape_and_cache(const at::Tensor& key, const at::Tensor& value, at::Tensor& key_cache,
                              at::Tensor& value_cache, const at::Tensor& slot_mapping, bool vectorized,
                              float k_scale = 1.f, float v_scale = 1.f);

// The fused row kernels: one program per row (token). Layouts of the ops in csrc/ops.cpp.
enum class QuantMode { kNone, kStatic, kDynamic };  // output in x's dtype | fp8, given scale | fp8, per-row scale

struct RowParams {
  const void* x;          // [rows, x_cols], row stride x_stride (elements), last dim contiguous
  const void* residual;   // add + norm: [rows, cols], row stride residual_stride
  const void* weight;     // norm: [cols], x's dtype
  void* out;              // [rows, cols] contiguous: fp8, or x's dtype with QuantMode::kNone
  void* residual_out;     // add + norm: [rows, cols] contiguous, x's dtype
  float* scale;           // kStatic: [1], read; kDynamic: [rows], written
  int64_t x_stride, residual_stride;
  int64_t rows;
  int cols;               // of the output (silu_mul: half of x's)
  float eps;
};

// RMSNorm of x (or of x + residual, with `add`), then `quant`. vectorized: 16-byte accesses
// (cols, strides and pointers allow it).
void launch_rms_norm(const RowParams& p, at::ScalarType dtype, bool add, QuantMode quant, bool vectorized);
// Quantization of x, or of silu(gate) * up with `silu_mul` (x = gate | up); kNone (silu_mul
// only) stores silu(gate) * up in x's dtype.
void launch_quant(const RowParams& p, at::ScalarType dtype, bool silu_mul, QuantMode quant, bool vectorized);

// One rope_and_cache call (see rope_and_cache.cpp). Heads are contiguous rows of head_size
// within a token; cache rows of a slot hold num_kv_heads * head_size elements.
struct RopeCacheParams {
  const int64_t* positions;      // [num_tokens]
  const void* query;             // [num_tokens, num_heads, head_size], token stride q_stride
  const void* key;               // [num_tokens, num_kv_heads, head_size], token stride k_stride
  const void* value;             // [num_tokens, num_kv_heads, head_size], token stride v_stride
  const void* cos_sin_cache;     // [max_position, head_size], fp32 (cos_sin_fp32) or the query dtype
  const void* q_norm_weight;     // [head_size] or null (no QK-norm)
  const void* k_norm_weight;     // [head_size] or null
  void* q_out;                   // [num_tokens, num_heads, head_size] contiguous
  void* key_cache;               // [num_slots, num_kv_heads, head_size]
  void* value_cache;
  const int64_t* slot_mapping;   // [num_tokens]; outside [0, num_slots) skips
  int64_t q_stride, k_stride, v_stride, num_slots;
  int num_tokens, num_heads, num_kv_heads, head_size;
  float eps;
  bool cos_sin_fp32;
  bool early_dependents;  // set by the launcher (rope_cache_kernels.cu)
  bool fp8_cache;         // float8_e4m3fn caches: rows stored as fp8(x / k_scale), fp8(v / v_scale)
  float k_scale, v_scale;
};

void launch_rope_and_cache(const RopeCacheParams& p, at::ScalarType dtype);

// A model whose query is at most this wide (num_heads * head_size) decodes as a chain of kernels
// too short to hide decode attention's first loads behind the QKV projection alone: there
// rope_and_cache lets attention start at once (rope_cache_kernels.cu), and rope_paged_attention
// keeps those two kernels rather than its one (paged_attention.cpp).
constexpr int kSmallModelQueryWidth = 1024;

// rope_paged_attention of a pure-decode batch in one kernel (paged_attention_decode.cu): p.query
// is the query before RoPE; r's query and q_out are unused, its key and value are this step's
// rows, rotated / copied into the cache by the kernel. Returns false, launching nothing, where
// the batch would not run as thread block clusters (sm_90+, small batches) or the shapes are not
// covered (bf16/fp16 caches, head_size 64 or 128, groups of up to 8 heads; not fp8 caches): the
// caller then runs rope_and_cache and paged_attention.
bool launch_rope_paged_attention_decode(const AttentionParams& p, const RopeCacheParams& r, at::ScalarType dtype,
                                        int64_t max_context);

constexpr float kLog2e = 1.4426950408889634f;

}  // namespace compilelm::cuda
