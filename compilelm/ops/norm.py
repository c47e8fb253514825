"""RMSNorm: the plain-torch reference (`rms_norm`, what layers and pass patterns call), and
fused_add_rms_norm: the residual add and the RMSNorm after it, as one functional op.

It is the epilogue of the tensor-parallel all-reduce fusion (all-reduce + add + RMSNorm in one
kernel); alone it saves the round trip of the sum through memory. Schema in csrc/ops.cpp, CUDA
kernel in csrc/cuda/norm_quant_kernels.cu; the CPU implementation is the torch composition that
`RMSNorm(x, residual)` runs, so both give the same numbers.
"""

from __future__ import annotations

import torch
from torch import Tensor


def rms_norm(x: Tensor, weight: Tensor | None, eps: float) -> Tensor:
    # x: [..., hidden]; weight: [hidden], or None where a pass folded it into the next projection.
    # Hugging Face's LlamaRMSNorm arithmetic: normalize in fp32, scale in the input dtype.
    orig_dtype = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return x.to(orig_dtype) if weight is None else weight * x.to(orig_dtype)


def fused_add_rms_norm(x: Tensor, residual: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    # x, residual: [num_tokens, hidden]; weight: [hidden] -> (rms_norm(x + residual), x + residual)
    return torch.ops.compilelm.fused_add_rms_norm.default(x, residual, weight, eps)


def fused_add_rms_norm_ref(x: Tensor, residual: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    residual = x + residual
    return rms_norm(residual, weight, eps), residual


@torch.library.register_kernel("compilelm::fused_add_rms_norm", "cpu")
def _(x, residual, weight, eps):
    return fused_add_rms_norm_ref(x, residual, weight, eps)


@torch.library.register_fake("compilelm::fused_add_rms_norm")
def _(x, residual, weight, eps):
    out_dtype = torch.promote_types(x.dtype, weight.dtype)  # weight * x.to(x.dtype), as rms_norm
    return x.new_empty(x.shape, dtype=out_dtype), x.new_empty(x.shape)
