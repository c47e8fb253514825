"""FP8 (float8_e4m3fn) quantization ops, alone and fused with the op that produces their input.

Every op is functional (new tensors out, nothing mutated). The schemas are declared once in
csrc/ops.cpp; this module adds the fake impls (for tracing) and the CPU implementations, which
are composed of torch ops and are bit-identical to running the unfused ops one after the other
(the `*_ref` functions): what the fusion passes rely on, a fused graph computes exactly what the
unfused one did. The CUDA kernels (csrc/cuda/quant_kernels.cu, norm_quant_kernels.cu) compute in
fp32 with the same roundings to the activation dtype; only the order of the row reductions
differs, so a fp8 value can land one step away where a product sits on a rounding boundary.

Scales follow vLLM: x ~= q.float() * scale.
    per token:  scale: [num_tokens, 1] fp32 = max(amax(|x|, -1) / 448, 1 / (448 * 512))
    static:     scale: [1] fp32, given (calibrated offline)
    per token group (block-wise FP8 checkpoints): scale: [num_tokens, hidden / group] fp32, one per
                1 x group slice of a row, same formula over the slice

`quant_fp8_per_token_group` is defined here in Python (library.define, no csrc kernel): the same
torch composition runs on every device.
"""

from __future__ import annotations

import torch
from torch import Tensor

from compilelm.ops.activation import silu_and_mul
from compilelm.ops.library import define
from compilelm.ops.norm import rms_norm

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8_DTYPE).max  # 448.0
MIN_SCALE = 1.0 / (FP8_MAX * 512.0)  # keeps all-zero rows finite (vLLM's floor)


# -- plain-torch references (the unfused computation, op by op) ------------------------------

def quant_fp8_per_token_ref(x: Tensor) -> tuple[Tensor, Tensor]:
    # x: [num_tokens, hidden] -> q: fp8 [num_tokens, hidden], scale: fp32 [num_tokens, 1]
    xf = x.float()
    scale = (xf.abs().amax(dim=-1, keepdim=True) / FP8_MAX).clamp(min=MIN_SCALE)
    q = (xf / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scale


def quant_fp8_static_ref(x: Tensor, scale: Tensor) -> Tensor:
    # scale: fp32 [1]
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def quant_fp8_per_token_group_ref(x: Tensor, group_size: int) -> tuple[Tensor, Tensor]:
    # x: [num_tokens, hidden], hidden % group_size == 0
    # -> q: fp8 [num_tokens, hidden], scale: fp32 [num_tokens, hidden // group_size]
    t, k = x.shape
    xg = x.float().reshape(t, k // group_size, group_size)
    scale = (xg.abs().amax(dim=-1, keepdim=True) / FP8_MAX).clamp(min=MIN_SCALE)
    q = (xg / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q.reshape(t, k), scale.squeeze(-1)


def _quant(x: Tensor, scale: Tensor | None) -> tuple[Tensor, Tensor]:
    if scale is None:
        return quant_fp8_per_token_ref(x)
    return quant_fp8_static_ref(x, scale), scale.clone()  # a new tensor: outputs may not alias inputs


# -- the ops: wrappers, CPU implementations, fake impls ----------------------------------------

def quant_fp8_per_token(x: Tensor) -> tuple[Tensor, Tensor]:
    """Dynamic per-token quantization: one scale per row."""
    return torch.ops.compilelm.quant_fp8_per_token.default(x)


def quant_fp8_static(x: Tensor, scale: Tensor) -> Tensor:
    """Static per-tensor quantization with a calibrated scale."""
    return torch.ops.compilelm.quant_fp8_static.default(x, scale)


def _per_token_group_fake(x, group_size):
    return (x.new_empty(x.shape, dtype=FP8_DTYPE),
            x.new_empty((x.shape[0], x.shape[1] // group_size), dtype=torch.float32))


@define("quant_fp8_per_token_group(Tensor x, int group_size) -> (Tensor, Tensor)", _per_token_group_fake)
def quant_fp8_per_token_group(x: Tensor, group_size: int) -> tuple[Tensor, Tensor]:
    """Dynamic quantization per 1 x group_size slice of each row (the activations of block-wise
    FP8 linears): x [num_tokens, hidden] -> (q fp8 [num_tokens, hidden], scale [num_tokens, hidden / group])."""
    if x.shape[-1] % group_size:
        raise ValueError(f"quant_fp8_per_token_group: hidden size {x.shape[-1]} is not a multiple of {group_size}")
    return quant_fp8_per_token_group_ref(x, group_size)


def rms_norm_quant_fp8(x: Tensor, weight: Tensor, eps: float, scale: Tensor | None) -> tuple[Tensor, Tensor]:
    """quant(rms_norm(x)): scale=None -> per token, else static. Returns (q, scale)."""
    return torch.ops.compilelm.rms_norm_quant_fp8.default(x, weight, eps, scale)


def fused_add_rms_norm_quant_fp8(x: Tensor, residual: Tensor, weight: Tensor, eps: float,
                                 scale: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
    """residual = x + residual; (quant(rms_norm(residual)), residual). Returns (q, scale, residual)."""
    return torch.ops.compilelm.fused_add_rms_norm_quant_fp8.default(x, residual, weight, eps, scale)


def silu_mul_quant_fp8(x: Tensor, scale: Tensor | None) -> tuple[Tensor, Tensor]:
    """quant(silu(gate) * up), x: [num_tokens, 2 * d] -> q: fp8 [num_tokens, d]. Returns (q, scale)."""
    return torch.ops.compilelm.silu_mul_quant_fp8.default(x, scale)


@torch.library.register_kernel("compilelm::quant_fp8_per_token", "cpu")
def _(x):
    return quant_fp8_per_token_ref(x)


@torch.library.register_kernel("compilelm::quant_fp8_static", "cpu")
def _(x, scale):
    return quant_fp8_static_ref(x, scale)


@torch.library.register_kernel("compilelm::rms_norm_quant_fp8", "cpu")
def _(x, weight, eps, scale):
    return _quant(rms_norm(x, weight, eps), scale)


@torch.library.register_kernel("compilelm::fused_add_rms_norm_quant_fp8", "cpu")
def _(x, residual, weight, eps, scale):
    residual = x + residual
    q, s = _quant(rms_norm(residual, weight, eps), scale)
    return q, s, residual


@torch.library.register_kernel("compilelm::silu_mul_quant_fp8", "cpu")
def _(x, scale):
    return _quant(silu_and_mul(x), scale)


@torch.library.register_fake("compilelm::quant_fp8_per_token")
def _(x):
    return x.new_empty(x.shape, dtype=FP8_DTYPE), x.new_empty((*x.shape[:-1], 1), dtype=torch.float32)


@torch.library.register_fake("compilelm::quant_fp8_static")
def _(x, scale):
    return x.new_empty(x.shape, dtype=FP8_DTYPE)


@torch.library.register_fake("compilelm::rms_norm_quant_fp8")
def _(x, weight, eps, scale):
    return x.new_empty(x.shape, dtype=FP8_DTYPE), x.new_empty(_scale_shape(x, scale), dtype=torch.float32)


@torch.library.register_fake("compilelm::fused_add_rms_norm_quant_fp8")
def _(x, residual, weight, eps, scale):
    return (x.new_empty(x.shape, dtype=FP8_DTYPE), x.new_empty(_scale_shape(x, scale), dtype=torch.float32),
            x.new_empty(x.shape))


@torch.library.register_fake("compilelm::silu_mul_quant_fp8")
def _(x, scale):
    shape = (*x.shape[:-1], x.shape[-1] // 2)
    return x.new_empty(shape, dtype=FP8_DTYPE), x.new_empty(_scale_shape(x, scale), dtype=torch.float32)


def _scale_shape(x: Tensor, scale: Tensor | None):
    return (*x.shape[:-1], 1) if scale is None else scale.shape
