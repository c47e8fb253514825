// CUDA entry points of the fused row ops of csrc/ops.cpp: the FP8 quantization ops (alone,
// after RMSNorm, after add + RMSNorm, after SiLU-mul) and fused_add_rms_norm. Checks the call,
// allocates the outputs (torch's caching allocator) and launches the kernels of
// norm_quant_kernels.cu / quant_kernels.cu on the current stream.
//
// x may have any number of leading dims (flattened to rows); its last dim must be contiguous.
// On CUDA the RMSNorm weight must have x's dtype (the CPU implementation also takes fp32 weights).
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAGuard.h>

#include "cuda/cuda_ops.h"
#include "cuda/launchers.h"

namespace compilelm::cuda {
namespace {

// x as [rows, cols] with a contiguous last dim (a copy only when the leading dims cannot be
// flattened into one row stride).
at::Tensor as_rows(const at::Tensor& x, const char* op) {
  TORCH_CHECK(x.is_cuda(), op, ": x must be a CUDA tensor, got ", x.device());
  TORCH_CHECK(x.dim() >= 1, op, ": x must have a last (hidden) dim, got a scalar");
  const auto dtype = x.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf, op,
              ": x must be float32, bfloat16 or float16, got ", dtype);
  TORCH_CHECK(x.size(-1) > 0 && x.size(-1) < (int64_t{1} << 31), op, ": the last dim must be in [1, 2^31), got ",
              x.size(-1));
  at::Tensor rows = x.reshape({-1, x.size(-1)});
  return rows.stride(1) == 1 || rows.size(1) <= 1 ? rows : rows.contiguous();
}

void check_norm_weight(const at::Tensor& weight, const at::Tensor& x, const char* op) {
  TORCH_CHECK(weight.device() == x.device(), op, ": weight must be on ", x.device(), ", got ", weight.device());
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == x.size(-1), op, ": weight must be [", x.size(-1), "], got ",
              weight.sizes());
  TORCH_CHECK(weight.scalar_type() == x.scalar_type(), op, ": on CUDA the weight dtype must match x's (",
              x.scalar_type(), "), got ", weight.scalar_type());
}

void check_static_scale(const at::Tensor& scale, const at::Tensor& x, const char* op) {
  TORCH_CHECK(scale.device() == x.device(), op, ": scale must be on ", x.device(), ", got ", scale.device());
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.numel() == 1, op,
              ": a static scale must be one float32 value, got ", scale.scalar_type(), " ", scale.sizes());
}

bool aligned_16(const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % 16 == 0; }

// 16-byte vectors fit the rows: cols and the row stride whole vectors, the pointer aligned.
bool can_vectorize(const at::Tensor& rows, int64_t cols) {
  const int64_t n = 16 / rows.element_size();
  return cols % n == 0 && rows.stride(0) % n == 0 && aligned_16(rows.const_data_ptr());
}

at::Tensor fp8_like(const at::Tensor& x, int64_t cols) {
  auto sizes = x.sizes().vec();
  sizes.back() = cols;
  return at::empty(sizes, x.options().dtype(at::kFloat8_e4m3fn));
}

at::Tensor per_token_scale(const at::Tensor& x) {
  auto sizes = x.sizes().vec();
  sizes.back() = 1;
  return at::empty(sizes, x.options().dtype(at::kFloat));
}

RowParams row_params(const at::Tensor& x_rows, const at::Tensor& q, int64_t cols) {
  RowParams p{};
  p.x = x_rows.const_data_ptr();
  p.x_stride = x_rows.stride(0);
  p.rows = x_rows.size(0);
  p.cols = static_cast<int>(cols);
  p.out = q.mutable_data_ptr();
  return p;
}

// The norm ops: out = fp8 (quant != kNone) or x's dtype; residual_out when `residual` is given.
std::tuple<at::Tensor, at::Tensor, at::Tensor> rms_norm_op(const at::Tensor& x, const at::Tensor* residual,
                                                           const at::Tensor& weight, double eps,
                                                           const std::optional<at::Tensor>& scale, bool quant,
                                                           const char* op) {
  const at::Tensor x_rows = as_rows(x, op);
  check_norm_weight(weight, x, op);
  const c10::cuda::CUDAGuard device_guard(x.device());
  const int64_t cols = x.size(-1);
  at::Tensor res_rows, residual_out, out_scale;
  if (residual != nullptr) {
    TORCH_CHECK(residual->sizes() == x.sizes() && residual->scalar_type() == x.scalar_type() &&
                    residual->device() == x.device(),
                op, ": residual must match x (", x.sizes(), " ", x.scalar_type(), "), got ", residual->sizes(), " ",
                residual->scalar_type(), " on ", residual->device());
    res_rows = as_rows(*residual, op);
    residual_out = at::empty(x.sizes(), x.options());
  }
  at::Tensor out = quant ? fp8_like(x, cols) : at::empty(x.sizes(), x.options());
  QuantMode mode = QuantMode::kNone;
  if (quant && scale.has_value()) {
    check_static_scale(*scale, x, op);
    out_scale = scale->clone();
    mode = QuantMode::kStatic;
  } else if (quant) {
    out_scale = per_token_scale(x);
    mode = QuantMode::kDynamic;
  }
  if (x_rows.size(0) == 0) return {out, out_scale, residual_out};
  const at::Tensor weight_c = weight.contiguous();
  RowParams p = row_params(x_rows, out, cols);
  p.weight = weight_c.const_data_ptr();
  p.eps = static_cast<float>(eps);
  if (out_scale.defined()) p.scale = out_scale.mutable_data_ptr<float>();
  if (residual != nullptr) {
    p.residual = res_rows.const_data_ptr();
    p.residual_stride = res_rows.stride(0);
    p.residual_out = residual_out.mutable_data_ptr();
  }
  const bool vectorized = can_vectorize(x_rows, cols) && aligned_16(weight_c.const_data_ptr()) &&
                          (residual == nullptr || can_vectorize(res_rows, cols));
  launch_rms_norm(p, x.scalar_type(), residual != nullptr, mode, vectorized);
  return {out, out_scale, residual_out};
}

// The quant ops: quant(x), or quant(silu(gate) * up) with silu_mul. A static scale is returned
// as a copy (outputs may not alias inputs) unless the op does not return it.
std::tuple<at::Tensor, at::Tensor> quant_op(const at::Tensor& x, const std::optional<at::Tensor>& scale, bool silu_mul,
                                            bool return_scale, const char* op) {
  const at::Tensor x_rows = as_rows(x, op);
  const c10::cuda::CUDAGuard device_guard(x.device());
  TORCH_CHECK(!silu_mul || x.size(-1) % 2 == 0, op, ": x's last dim must be even (gate | up), got ", x.size(-1));
  const int64_t cols = silu_mul ? x.size(-1) / 2 : x.size(-1);
  at::Tensor q = fp8_like(x, cols), out_scale;
  QuantMode mode = QuantMode::kDynamic;
  if (scale.has_value()) {
    check_static_scale(*scale, x, op);
    out_scale = return_scale ? scale->clone() : scale->contiguous();
    mode = QuantMode::kStatic;
  } else {
    out_scale = per_token_scale(x);
  }
  if (x_rows.size(0) == 0) return {q, out_scale};
  RowParams p = row_params(x_rows, q, cols);
  p.scale = out_scale.data_ptr<float>();  // only read when static
  launch_quant(p, x.scalar_type(), silu_mul, mode, can_vectorize(x_rows, cols));
  return {q, out_scale};
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> quant_fp8_per_token(const at::Tensor& x) {
  return quant_op(x, std::nullopt, /*silu_mul=*/false, /*return_scale=*/true, "quant_fp8_per_token");
}

at::Tensor quant_fp8_static(const at::Tensor& x, const at::Tensor& scale) {
  return std::get<0>(quant_op(x, scale, /*silu_mul=*/false, /*return_scale=*/false, "quant_fp8_static"));
}

std::tuple<at::Tensor, at::Tensor> silu_mul_quant_fp8(const at::Tensor& x, const std::optional<at::Tensor>& scale) {
  return quant_op(x, scale, /*silu_mul=*/true, /*return_scale=*/true, "silu_mul_quant_fp8");
}

at::Tensor silu_and_mul(const at::Tensor& x) {
  const at::Tensor x_rows = as_rows(x, "silu_and_mul");
  const c10::cuda::CUDAGuard device_guard(x.device());
  const int64_t cols = x.size(-1) / 2;
  at::Tensor out = at::empty({x_rows.size(0), cols}, x.options());
  if (x_rows.size(0) == 0) return out;
  launch_quant(row_params(x_rows, out, cols), x.scalar_type(), /*silu_mul=*/true, QuantMode::kNone,
               can_vectorize(x_rows, cols));
  return out;
}

std::tuple<at::Tensor, at::Tensor> rms_norm_quant_fp8(const at::Tensor& x, const at::Tensor& weight, double eps,
                                                      const std::optional<at::Tensor>& scale) {
  auto [q, s, unused] = rms_norm_op(x, nullptr, weight, eps, scale, /*quant=*/true, "rms_norm_quant_fp8");
  return {q, s};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> fused_add_rms_norm_quant_fp8(const at::Tensor& x,
                                                                            const at::Tensor& residual,
                                                                            const at::Tensor& weight, double eps,
                                                                            const std::optional<at::Tensor>& scale) {
  return rms_norm_op(x, &residual, weight, eps, scale, /*quant=*/true, "fused_add_rms_norm_quant_fp8");
}

std::tuple<at::Tensor, at::Tensor> fused_add_rms_norm(const at::Tensor& x, const at::Tensor& residual,
                                                      const at::Tensor& weight, double eps) {
  auto [out, unused, residual_out] =
      rms_norm_op(x, &residual, weight, eps, std::nullopt, /*quant=*/false, "fused_add_rms_norm");
  return {out, residual_out};
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  return std::get<0>(rms_norm_op(x, nullptr, weight, eps, std::nullopt, /*quant=*/false, "rms_norm"));
}

}  // namespace compilelm::cuda
