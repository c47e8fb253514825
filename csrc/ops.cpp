// The compilelm op contract: every custom op is declared here, once (docs/interfaces.md).
// Device kernels register against these schemas in their own TORCH_LIBRARY_IMPL blocks:
// csrc/cpu/cpu_ops.cpp (CPU) and csrc/cuda/cuda_ops.cu (CUDA). Fake (meta) impls, plain-torch
// references, and the CPU impls of the fused ops (torch compositions, bit-identical to the unfused
// ops) live in compilelm/ops/.
//
// Layout shared by the cache ops:
//   key_cache, value_cache: [num_blocks, block_size, num_kv_heads, head_size], block 0 = null block
//   slot s of the cache = (block s / block_size, offset s % block_size)
// FP8 KV cache (--kv-cache-dtype fp8): caches of float8_e4m3fn beside keys / queries of the model
// dtype. Writers store fp8(clamp(x / k_scale, -448, 448)) (keys; values with v_scale: RNE,
// saturating), readers use fp8 * scale in fp32. k_scale / v_scale: per-tensor fp32 values (1.0 =
// vLLM's default); ignored where the cache has the model dtype.
//
// FP8 ops: float8_e4m3fn outputs with vLLM's scales, x ~= q.float() * scale; `Tensor? scale`
// None = dynamic per token (scale: fp32 [num_tokens, 1] = max(amax / 448, 1 / (448 * 512))),
// else static (scale: fp32 [1], returned as a copy). All of them are functional.
#include <torch/library.h>

#include <atomic>

namespace compilelm {
namespace {
std::atomic<bool> programmatic_launch{true};
std::atomic<bool> cluster_merge{true};
std::atomic<bool> decode_mma{true};
std::atomic<bool> hopper_gemm{true};
std::atomic<int> decode_splits{0};
}  // namespace

// CUDA kernels launch with programmatic dependent launch (csrc/cuda/launch.cuh) unless turned off.
bool programmatic_launch_enabled() { return programmatic_launch.load(std::memory_order_relaxed); }

bool set_programmatic_launch(bool enabled) { return programmatic_launch.exchange(enabled); }

// Pure-decode split-K merges inside a thread block cluster (csrc/cuda/paged_attention_decode.cu,
// sm_90+) unless turned off: then the last split to arrive merges through global memory.
bool cluster_merge_enabled() { return cluster_merge.load(std::memory_order_relaxed); }

bool set_cluster_merge(bool enabled) { return cluster_merge.exchange(enabled); }

// Decode attention outside thread block clusters runs on tensor cores where the shapes allow
// (csrc/cuda/paged_attention_decode_mma.cu) unless turned off: then on CUDA cores.
bool decode_mma_enabled() { return decode_mma.load(std::memory_order_relaxed); }

bool set_decode_mma(bool enabled) { return decode_mma.exchange(enabled); }

// Split-K partitions of decode launches outside clusters: 0 = chosen from the launch's shapes
// (paged_attention_decode.cu, choose_num_splits), else this many (benchmarks sweep it).
int decode_splits_forced() { return decode_splits.load(std::memory_order_relaxed); }

int64_t set_decode_splits(int64_t splits) {
  TORCH_CHECK(splits >= 0 && splits <= 64, "set_decode_splits: splits must be in [0, 64] (0: by shape), got ",
              splits);
  return decode_splits.exchange(static_cast<int>(splits));
}

// Linear layers at 3-64 rows on sm_90 go to hopper_mm_out (csrc/cuda/skinny_mm.cu, decode_mm) unless
// turned off: then to cuBLAS.
bool hopper_gemm_enabled() { return hopper_gemm.load(std::memory_order_relaxed); }

bool set_hopper_gemm(bool enabled) { return hopper_gemm.exchange(enabled); }
}  // namespace compilelm

TORCH_LIBRARY(compilelm, m) {
  // CUDA launches with or without programmatic dependent launch (csrc/cuda/launch.cuh); returns
  // the previous setting. Takes effect for launches (and graph captures) after the call.
  m.def("set_programmatic_launch(bool enabled) -> bool", &compilelm::set_programmatic_launch);
  // Pure-decode paged attention merges its split-K partials in a thread block cluster (sm_90+),
  // or, turned off, through global memory (the split that arrives last); returns the previous
  // setting. Takes effect for launches (and graph captures) after the call.
  m.def("set_cluster_merge(bool enabled) -> bool", &compilelm::set_cluster_merge);
  // Decode attention outside clusters on tensor cores (bf16/fp16, head_size 64/128, GQA groups
  // up to 16) or, turned off, on CUDA cores; returns the previous setting. Takes effect for
  // launches (and graph captures) after the call.
  m.def("set_decode_mma(bool enabled) -> bool", &compilelm::set_decode_mma);
  // Split-K partitions of decode attention outside clusters: 0 (the default) picks them from the
  // launch's shapes, 1-64 forces that many; returns the previous setting. Takes effect for
  // launches (and graph captures) after the call.
  m.def("set_decode_splits(int splits) -> int", &compilelm::set_decode_splits);
  // linear and its fused variants send 3-64 rows of a large weight (sm_90) to hopper_mm_out or,
  // turned off, to cuBLAS; returns the previous setting. Takes effect for launches (and graph
  // captures) after the call.
  m.def("set_hopper_gemm(bool enabled) -> bool", &compilelm::set_hopper_gemm);
  // The two settings above as they are (for launchers written in Python: compilelm/ops/norm_gemm.py).
  m.def("programmatic_launch() -> bool", &compilelm::programmatic_launch_enabled);
  m.def("hopper_gemm() -> bool", &compilelm::hopper_gemm_enabled);
  // key, value: [num_tokens, num_kv_heads, head_size]; slot_mapping: int64 [num_tokens], -1 skips.
  m.def(
      "reshape_and_cache(Tensor key, Tensor value, Tensor(a!) key_cache, Tensor(b!) value_cache, "
      "Tensor slot_mapping, float k_scale=1.0, float v_scale=1.0) -> ()");
  // query: [num_tokens, num_heads, head_size]; cu_seqlens_q: int32 [num_seqs + 1];
  // seq_lens: int32 [num_seqs]; block_tables: int32 [num_seqs, max_blocks_per_seq].
  // Returns [num_tokens, num_heads, head_size]; causal over each sequence's cached context.
  // max_query_len: the longest query range of the batch where the caller knows it, else 0; 1
  // promises a pure-decode batch (the CUDA kernels then skip their prefill pass). prefill_rows=False
  // leaves the rows of sequences with q_len > 1 unwritten on CUDA, for the caller's prefill kernel
  // (compilelm/ops/prefill_attention.py); the CPU kernel writes every row either way.
  m.def(
      "paged_attention(Tensor query, Tensor key_cache, Tensor value_cache, Tensor cu_seqlens_q, "
      "Tensor seq_lens, Tensor block_tables, float scale, int max_query_len=0, bool prefill_rows=True, "
      "float k_scale=1.0, float v_scale=1.0) -> Tensor");
  // RoPE (neox style) of query and key at `positions`, after an optional per-head RMSNorm
  // (Qwen3's QK-norm: both weights [head_size] or neither), rotated key and value written to
  // their cache slots (as reshape_and_cache). query: [num_tokens, num_heads, head_size];
  // cos_sin_cache: [max_position, head_size] = cos | sin of the half-dims. Returns the rotated query,
  // [num_tokens, num_heads, head_size] contiguous.
  m.def(
      "rope_and_cache(Tensor positions, Tensor query, Tensor key, Tensor value, Tensor cos_sin_cache, "
      "Tensor? q_norm_weight, Tensor? k_norm_weight, float eps, Tensor(a!) key_cache, "
      "Tensor(b!) value_cache, Tensor slot_mapping, float k_scale=1.0, float v_scale=1.0) -> Tensor");
  // rope_and_cache (without QK-norm) then paged_attention of the rotated query, returning its
  // output: on CUDA one kernel for a pure-decode batch (max_query_len == 1) of a model wider than
  // SmolLM2-135M, which writes the cache rows of the batch's sequences only (rows past the last
  // sequence must have slot -1); with an fp8 cache the two kernels.
  m.def(
      "rope_paged_attention(Tensor positions, Tensor query, Tensor key, Tensor value, Tensor cos_sin_cache, "
      "Tensor(a!) key_cache, Tensor(b!) value_cache, Tensor slot_mapping, Tensor cu_seqlens_q, Tensor seq_lens, "
      "Tensor block_tables, float scale, int max_query_len=0, float k_scale=1.0, float v_scale=1.0) -> Tensor");

  // FP8 W8A8 linear: x fp8 [M, K] with x_scale fp32 (M values: per token, or one: per tensor),
  // weight fp8 [N, K] with weight_scale fp32 (N values: per channel, or one), bias [N] or None ->
  // (x.float() @ weight.float().T) * x_scale * weight_scale (+ bias): [M, N] in out_dtype. The
  // layer's op: on CUDA it picks the kernel by M (compilelm/ops/fp8_gemm.py: fp8_stream_mm, the
  // Triton FP8 GEMM, torch._scaled_mm).
  m.def(
      "fp8_linear(Tensor x, Tensor x_scale, Tensor weight, Tensor weight_scale, Tensor? bias, "
      "ScalarType out_dtype) -> Tensor");
  // quant_fp8_per_token(x) then fp8_linear: x bf16 / fp16 / fp32 [M, K]. On CUDA one kernel where
  // fp8_stream_mm's quant prologue takes x, else the two ops (compilelm/ops/fp8_gemm.py).
  m.def(
      "fp8_quant_linear(Tensor x, Tensor weight, Tensor weight_scale, Tensor? bias, ScalarType out_dtype) "
      "-> Tensor");
  // fp8_linear's product for M <= 16 on CUDA (sm_89+) by streaming the weight once
  // (csrc/cuda/fp8_stream_mm.cu: K a multiple of 16, rows 16-byte aligned, contiguous scales,
  // bias in out_dtype). x_scale None: x is bf16 / fp16 / fp32 (M <= 8, M x K <= 48K), quantized
  // per token in the kernel (fp8_quant_linear).
  m.def(
      "fp8_stream_mm(Tensor x, Tensor? x_scale, Tensor weight, Tensor weight_scale, Tensor? bias, "
      "ScalarType out_dtype) -> Tensor");
  // x: [num_tokens, hidden] -> (q: fp8 [num_tokens, hidden], scale: fp32 [num_tokens, 1])
  m.def("quant_fp8_per_token(Tensor x) -> (Tensor, Tensor)");
  m.def("quant_fp8_static(Tensor x, Tensor scale) -> Tensor");
  // quant(rms_norm(x)) -> (q, scale)
  m.def("rms_norm_quant_fp8(Tensor x, Tensor weight, float eps, Tensor? scale) -> (Tensor, Tensor)");
  // residual_out = x + residual; (quant(rms_norm(residual_out)), scale, residual_out)
  m.def(
      "fused_add_rms_norm_quant_fp8(Tensor x, Tensor residual, Tensor weight, float eps, Tensor? scale) "
      "-> (Tensor, Tensor, Tensor)");
  // x: [num_tokens, 2 * d] (gate | up) -> quant(silu(gate) * up): fp8 [num_tokens, d], scale
  m.def("silu_mul_quant_fp8(Tensor x, Tensor? scale) -> (Tensor, Tensor)");
  // residual_out = x + residual; (rms_norm(residual_out), residual_out)
  m.def("fused_add_rms_norm(Tensor x, Tensor residual, Tensor weight, float eps) -> (Tensor, Tensor)");

  // x: [M, K], weight: [N, K] (a linear layer's weight) -> x @ weight.T: [M, N]. The CUDA kernel
  // serves M <= 2 (decode at batch 1-2) by streaming the weight once; other inputs use at::mm.
  m.def("linear(Tensor x, Tensor weight) -> Tensor");
  // The same product written into out ([M, N], x's dtype, rows contiguous): the LM head of a full
  // decode graph writes its static logits buffer directly.
  m.def("linear_out(Tensor x, Tensor weight, Tensor(a!) out) -> ()");
  // linear_out, then argmax = argmax_rows(out) (int64 [M]): a full decode graph's LM head and
  // greedy sampling, one kernel on CUDA at M <= 2.
  m.def("linear_argmax_out(Tensor x, Tensor weight, Tensor(a!) out, Tensor(b!) argmax) -> ()");
  // out = x @ weight.T (x: [M <= 64, K], weight: [N, K], out: [M, N], bf16/fp16) for linear's
  // CUDA ops to call on sm_90 (3-64 rows); pdl: launch with programmatic dependent launch. Its CUDA
  // kernel is Triton's, registered by compilelm/ops/hopper_gemm.py where Triton is importable.
  // silu_mul: weight = gate | up ([2I, K]), out = silu(x @ gate.T) * (x @ up.T): [M, I], with
  // SiluAndMul's roundings of the rounded products (gate_up_silu_mul).
  m.def("hopper_mm_out(Tensor x, Tensor weight, Tensor(a!) out, bool pdl, bool silu_mul=False) -> ()");
  // The same for a QKV projection (weight rows: q | k | v heads) with RoPE in the epilogue: the
  // rotated query to q_out ([M, num_heads, head_size] contiguous), the rotated key and the value to
  // their slots of the (contiguous) caches, as rope_and_cache would write them; head_size a
  // multiple of 64. Called by the *_qkv_rope_cache ops below.
  m.def(
      "hopper_mm_rope_out(Tensor x, Tensor weight, Tensor positions, Tensor cos_sin_cache, Tensor(a!) key_cache, "
      "Tensor(b!) value_cache, Tensor slot_mapping, Tensor(c!) q_out, bool pdl) -> ()");
  // rms_norm(x) @ weight.T, and with residual: residual_out = x + residual;
  // (rms_norm(residual_out) @ weight.T, residual_out). norm_weight: [K]. The norm's roundings are
  // those of compilelm.ops.norm.rms_norm; the CUDA kernel does norm and GEMV in one pass at M <= 2.
  m.def("rms_norm_linear(Tensor x, Tensor norm_weight, float eps, Tensor weight) -> Tensor");
  m.def(
      "fused_add_rms_norm_linear(Tensor x, Tensor residual, Tensor norm_weight, float eps, Tensor weight) "
      "-> (Tensor, Tensor)");
  // x: [M, 2K] (gate | up) -> (silu(gate) * up) @ weight.T with SiluAndMul's roundings; weight: [N, K].
  m.def("silu_mul_linear(Tensor x, Tensor weight) -> Tensor");
  // The other side of the MLP's activation: weight = gate_up_proj's [2I, K] (gate | up) ->
  // silu_and_mul(x @ weight.T): [M, I], SiluAndMul's roundings of the rounded product. On CUDA one
  // kernel at 3-64 rows where hopper_mm_out takes them (its SiLU-and-mul epilogue), else the
  // product (linear) and the SiLU-and-mul kernel.
  m.def("gate_up_silu_mul(Tensor x, Tensor weight) -> Tensor");
  // The QKV projection (linear / rms_norm_linear / fused_add_rms_norm_linear; weight
  // rows: q | k | v heads, num_heads query heads, the cache's kv heads and head_size) followed by
  // rope_and_cache of its q | k | v: returns the rotated query [M, num_heads, head_size] (and
  // residual_out), writes the rotated key and the value to their cache slots. On CUDA one kernel
  // at M <= 2, and at 3-64 rows (after the norm kernel) hopper_mm_rope_out where it takes them.
  m.def(
      "qkv_rope_cache(Tensor x, Tensor weight, Tensor positions, Tensor cos_sin_cache, Tensor(a!) key_cache, "
      "Tensor(b!) value_cache, Tensor slot_mapping, int num_heads) -> Tensor");
  m.def(
      "rms_norm_qkv_rope_cache(Tensor x, Tensor norm_weight, float eps, Tensor weight, Tensor positions, "
      "Tensor cos_sin_cache, Tensor(a!) key_cache, Tensor(b!) value_cache, Tensor slot_mapping, int num_heads) "
      "-> Tensor");
  m.def(
      "fused_add_rms_norm_qkv_rope_cache(Tensor x, Tensor residual, Tensor norm_weight, float eps, Tensor weight, "
      "Tensor positions, Tensor cos_sin_cache, Tensor(a!) key_cache, Tensor(b!) value_cache, Tensor slot_mapping, "
      "int num_heads) -> (Tensor, Tensor)");

  // x: [rows, vocab] (float32, bfloat16 or float16) -> int64 [rows]: the index of each row's first
  // maximum, NaN counting as the maximum (torch.argmax(x, -1)). One kernel on CUDA (greedy sampling).
  m.def("argmax_rows(Tensor x) -> Tensor");
  // x: [rows, vocab]; inv_temperature: fp32 [rows]; keys: int64 [rows] -> int64 [rows]: row r's
  // sample from softmax(x[r] * inv_temperature[r]), as the argmax of x * inv_temperature plus
  // Gumbel noise drawn from counter-based bits keyed by keys[r] (at counter column / 4): a row's
  // draw depends on its logits, temperature and key only (not on the batch). Rows with
  // inv_temperature 0 take argmax_rows's index. One kernel on CUDA (plain temperature sampling);
  // the CPU draws each row's noise from a torch generator seeded by its key.
  // floor (fp32 [rows], optional): a row draws only among columns with x * inv_temperature >=
  // floor (the sampler's top-k / top-p / min-p threshold; -inf: all), in the same pass.
  m.def("sample_rows(Tensor x, Tensor inv_temperature, Tensor keys, Tensor? floor=None) -> Tensor");

  // One-shot all-reduce over peer memory, CUDA only (csrc/cuda/allreduce_kernels.cu); called by
  // compilelm/distributed/custom_all_reduce.py, which owns the buffers: buffer_ptrs = every rank's
  // peer-visible buffer (flags, then buffer_bytes for the rows), rank = this rank's index in it.
  // x: [num_tokens, hidden] contiguous. Not functional: it writes the buffers (no tensor args).
  m.def("custom_all_reduce(Tensor x, int[] buffer_ptrs, int rank, int buffer_bytes) -> Tensor");
  // residual_out = all_reduce(x) + residual; (rms_norm(residual_out), residual_out)
  m.def(
      "custom_all_reduce_add_rms_norm(Tensor x, Tensor residual, Tensor weight, float eps, int[] buffer_ptrs, "
      "int rank, int buffer_bytes) -> (Tensor, Tensor)");
}
