"""RMSNorm, optionally fused with the residual add that precedes it (the shape the fusion passes match)."""

from __future__ import annotations

import torch
from torch import nn


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    # Same arithmetic as Hugging Face's LlamaRMSNorm: normalize in fp32, scale in the input dtype.
    # weight None: folded into the linear after the norm (compilelm/models/fold_norms.py).
    orig_dtype = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return x.to(orig_dtype) if weight is None else weight * x.to(orig_dtype)


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size))

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """Without `residual`: norm(x). With it: (norm(x + residual), x + residual)."""
        if residual is None:
            return rms_norm(x, self.weight, self.eps)
        x = x + residual
        return rms_norm(x, self.weight, self.eps), x
