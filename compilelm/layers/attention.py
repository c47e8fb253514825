"""The attention layer: the call of the per-layer attention op (compilelm/ops/unified_attention.py)."""

from __future__ import annotations

import torch
from torch import nn

import compilelm.ops  # noqa: F401  (defines compilelm::unified_attention)


class Attention(nn.Module):
    """Holds the layer's name (its key in the forward context's kv_caches) and shape."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, layer_name: str):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.layer_name = layer_name

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return torch.ops.compilelm.unified_attention(q, k, v, self.layer_name)
