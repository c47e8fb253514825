"""RMSNorm, optionally fused with the residual add that precedes it (the shape the fusion passes match)."""

from __future__ import annotations

import torch
from torch import nn

from compilelm.ops.norm import rms_norm


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
