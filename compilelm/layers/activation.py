"""The MLP activation layer (its arithmetic: compilelm.ops.activation)."""

from __future__ import annotations

import torch
from torch import nn

from compilelm.ops.activation import silu_and_mul


class SiluAndMul(nn.Module):
    """x: [num_tokens, 2 * d] (gate | up) -> silu(gate) * up: [num_tokens, d]."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return silu_and_mul(x)
