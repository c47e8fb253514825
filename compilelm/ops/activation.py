"""The MLP activation's plain-torch reference: SiLU-and-mul, as Hugging Face's Llama MLP computes it."""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor


def silu_and_mul(x: Tensor) -> Tensor:
    # x: [num_tokens, 2 * d] (gate | up) -> silu(gate) * up: [num_tokens, d]
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up
