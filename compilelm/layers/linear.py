"""Linear layers whose parameters know how to load their checkpoint shards, replicated or split
over the tensor-parallel ranks (Megatron-style, as in vLLM):

    Linear                       replicated: every rank holds the whole matrix
    ColumnParallelLinear         output rows split over ranks; no communication
    MergedColumnParallelLinear   several stacked matrices (gate|up), each split over ranks
    QKVParallelLinear            q|k|v split by heads; KV heads replicated when fewer than ranks
    RowParallelLinear            input columns split; partial outputs summed by an all-reduce

A layer's `weight_loader(param, loaded, shard_id)` takes the checkpoint's full (unsharded) tensor
and copies this rank's slice, so the loader stays name-driven and never knows about ranks.
`full_shape(param)` is the parameter's shape at tensor_parallel_size 1 (for dummy weights, which
are drawn at full size so that every TP size gets the same model).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from compilelm.distributed.parallel_state import divide, get_tp_rank, get_tp_size
from compilelm.ops.collectives import tensor_model_parallel_all_reduce


def default_weight_loader(param: torch.Tensor, loaded: torch.Tensor, shard_id=None) -> None:
    if param.shape != loaded.shape:
        raise ValueError(f"weight shape mismatch: parameter {tuple(param.shape)} vs checkpoint "
                         f"{tuple(loaded.shape)}")
    param.data.copy_(loaded)


class Linear(nn.Module):
    """Replicated on every rank."""

    quant_method = None  # set by compilelm.layers.quantization after loading (e.g. Fp8LinearMethod)

    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features  # this rank's shape
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.quant_method is not None:
            return self.quant_method.apply(self, x)
        return F.linear(x, self.weight, self.bias)

    def full_shape(self, param: torch.Tensor) -> tuple[int, ...]:
        return tuple(param.shape)

    def weight_loader(self, param: torch.Tensor, loaded: torch.Tensor, shard_id=None) -> None:
        default_weight_loader(param, loaded)

    def load_full(self, param: torch.Tensor, full: torch.Tensor) -> None:
        """Copies this rank's part of `full`, a tensor of shape `full_shape(param)`."""
        self.weight_loader(param, full)


class ColumnParallelLinear(Linear):
    """y = x W^T with W's output rows split: rank r computes y[:, r*n:(r+1)*n]."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        self.full_out = out_features
        super().__init__(in_features, divide(out_features, get_tp_size(), "linear output size"), bias)

    def full_shape(self, param):
        return (self.full_out, *param.shape[1:])

    def weight_loader(self, param, loaded, shard_id=None):
        n = param.shape[0]
        default_weight_loader(param, loaded.narrow(0, get_tp_rank() * n, n))


class MergedColumnParallelLinear(ColumnParallelLinear):
    """One matmul for several stacked output matrices (gate|up), each split over the ranks.

    shards: each shard's full output rows, in order; shard ids are their names.
    """

    def __init__(self, in_features: int, shards: dict[str, int], bias: bool = False):
        self.full_sizes = dict(shards)
        self.shard_offsets: dict[str, tuple[int, int]] = {}  # name -> (first row in param, rows here)
        self.shard_sources: dict[str, int] = {}  # name -> first row of the checkpoint tensor to load
        offset = 0
        for name, full in shards.items():
            n, source = self.local_shard(name, full)
            self.shard_offsets[name], self.shard_sources[name] = (offset, n), source
            offset += n
        Linear.__init__(self, in_features, offset, bias)
        self.full_out = sum(shards.values())

    def local_shard(self, name: str, full: int) -> tuple[int, int]:
        """(rows of shard `name` on this rank, first checkpoint row it loads): an even split."""
        n = divide(full, get_tp_size(), f"{name} size")
        return n, get_tp_rank() * n

    def weight_loader(self, param, loaded, shard_id):
        offset, n = self.shard_offsets[shard_id]
        default_weight_loader(param.data.narrow(0, offset, n), loaded.narrow(0, self.shard_sources[shard_id], n))

    def load_full(self, param, full):
        start = 0
        for name, size in self.full_sizes.items():
            self.weight_loader(param, full.narrow(0, start, size), name)
            start += size


class QKVParallelLinear(MergedColumnParallelLinear):
    """q|k|v, split by attention heads. With fewer KV heads than ranks, each KV head is
    replicated on tp / num_kv_heads ranks (rank r holds KV head r // (tp / num_kv_heads))."""

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool = False):
        tp = get_tp_size()
        self.head_dim = head_dim
        self.num_heads = divide(num_heads, tp, "attention heads")
        if num_kv_heads >= tp:
            self.num_kv_heads = divide(num_kv_heads, tp, "KV heads")
        elif tp % num_kv_heads:
            raise ValueError(f"tensor_parallel_size {tp} is neither a divisor nor a multiple of the "
                             f"model's KV heads ({num_kv_heads})")
        else:
            self.num_kv_heads = 1
        self.full_kv_heads = num_kv_heads
        super().__init__(hidden_size, {"q": num_heads * head_dim, "k": num_kv_heads * head_dim,
                                       "v": num_kv_heads * head_dim}, bias)

    def local_shard(self, name, full):
        rank, tp = get_tp_rank(), get_tp_size()
        if name == "q":
            n = self.num_heads * self.head_dim
            return n, rank * n
        first_head = rank * self.full_kv_heads // tp  # = rank // (tp / kv heads) when replicated
        return self.num_kv_heads * self.head_dim, first_head * self.head_dim


class RowParallelLinear(Linear):
    """y = x W^T with W's input columns split: rank r multiplies its slice of x (the output of a
    column-parallel layer) and an all-reduce sums the partial products. The bias is loaded on
    rank 0 only (zeros elsewhere), so the sum adds it once."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        self.full_in = in_features
        super().__init__(divide(in_features, get_tp_size(), "linear input size"), out_features, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return tensor_model_parallel_all_reduce(super().forward(x))

    def full_shape(self, param):
        return (param.shape[0], self.full_in) if param.dim() == 2 else tuple(param.shape)

    def weight_loader(self, param, loaded, shard_id=None):
        if param.dim() == 1:  # bias
            default_weight_loader(param, loaded if get_tp_rank() == 0 else torch.zeros_like(loaded))
            return
        n = param.shape[1]
        default_weight_loader(param, loaded.narrow(1, get_tp_rank() * n, n))
