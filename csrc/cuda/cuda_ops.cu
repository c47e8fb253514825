// Registers the CUDA kernels for the schemas of csrc/ops.cpp (entry points: cuda_ops.h). Built only with COMPILELM_CUDA (CMakeLists.txt).
#include <torch/library.h>

#include "cuda/cuda_ops.h"

TORCH_LIBRARY_IMPL(compilelm, CUDA, m) {
  m.impl("reshape_and_cache", &compilelm::cuda::reshape_and_cache);
  m.impl("paged_attention", &compilelm::cuda::paged_attention);
  m.impl("rope_and_cache", &compilelm::cuda::rope_and_cache);
  m.impl("rope_paged_attention", &compilelm::cuda::rope_paged_attention);
  m.impl("quant_fp8_per_token", &compilelm::cuda::quant_fp8_per_token);
  m.impl("quant_fp8_static", &compilelm::cuda::quant_fp8_static);
  m.impl("rms_norm_quant_fp8", &compilelm::cuda::rms_norm_quant_fp8);
  m.impl("fused_add_rms_norm_quant_fp8", &compilelm::cuda::fused_add_rms_norm_quant_fp8);
  m.impl("silu_mul_quant_fp8", &compilelm::cuda::silu_mul_quant_fp8);
  m.impl("fused_add_rms_norm", &compilelm::cuda::fused_add_rms_norm);
  m.impl("linear", &compilelm::cuda::linear);
  m.impl("linear_out", &compilelm::cuda::linear_out);
  m.impl("linear_argmax_out", &compilelm::cuda::linear_argmax_out);
  m.impl("rms_norm_linear", &compilelm::cuda::rms_norm_linear);
  m.impl("fused_add_rms_norm_linear", &compilelm::cuda::fused_add_rms_norm_linear);
  m.impl("silu_mul_linear", &compilelm::cuda::silu_mul_linear);
  m.impl("gate_up_silu_mul", &compilelm::cuda::gate_up_silu_mul);
  m.impl("qkv_rope_cache", &compilelm::cuda::qkv_rope_cache);
  m.impl("rms_norm_qkv_rope_cache", &compilelm::cuda::rms_norm_qkv_rope_cache);
  m.impl("fused_add_rms_norm_qkv_rope_cache", &compilelm::cuda::fused_add_rms_norm_qkv_rope_cache);
  m.impl("fp8_stream_mm", &compilelm::cuda::fp8_stream_mm);
  m.impl("argmax_rows", &compilelm::cuda::argmax_rows);
  m.impl("sample_rows", &compilelm::cuda::sample_rows);
  m.impl("custom_all_reduce", &compilelm::cuda::custom_all_reduce);
  m.impl("custom_all_reduce_add_rms_norm", &compilelm::cuda::custom_all_reduce_add_rms_norm);
}
