"""Linear layers whose parameters know how to load their checkpoint shards.

`MergedLinear` packs several checkpoint matrices (q/k/v, gate/up) into one matmul; its
`weight_loader(param, loaded, shard_id)` copies one shard, so the loader stays name-driven.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def default_weight_loader(param: torch.Tensor, loaded: torch.Tensor, shard_id=None) -> None:
    if param.shape != loaded.shape:
        raise ValueError(f"weight shape mismatch: parameter {tuple(param.shape)} vs checkpoint "
                         f"{tuple(loaded.shape)}")
    param.data.copy_(loaded)


class Linear(nn.Module):
    quant_method = None  # set by compilelm.layers.quantization after loading (e.g. Fp8LinearMethod)

    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.quant_method is not None:
            return self.quant_method.apply(self, x)
        return F.linear(x, self.weight, self.bias)


class MergedLinear(Linear):
    """One matmul for several stacked output matrices, e.g. q|k|v or gate|up.

    shard_sizes: output rows of each shard, in order; shard ids are their names.
    """

    def __init__(self, in_features: int, shards: dict[str, int], bias: bool = False):
        super().__init__(in_features, sum(shards.values()), bias)
        self.shard_offsets: dict[str, tuple[int, int]] = {}
        offset = 0
        for name, size in shards.items():
            self.shard_offsets[name] = (offset, size)
            offset += size

    def weight_loader(self, param: torch.Tensor, loaded: torch.Tensor, shard_id: str) -> None:
        offset, size = self.shard_offsets[shard_id]
        default_weight_loader(param.data.narrow(0, offset, size), loaded)
