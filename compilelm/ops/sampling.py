"""argmax_rows: each row's first maximum (NaN counts as the maximum), for greedy sampling.

Schema in csrc/ops.cpp; the CUDA kernel (csrc/cuda/argmax_kernels.cu) reduces chunks of every
row in parallel and merges them in the last block of the row: one kernel at any batch size. On
CPU it is torch's argmax.
"""

import torch
from torch import Tensor


def argmax_rows(x: Tensor) -> Tensor:
    # x: [rows, vocab] -> int64 [rows]
    return torch.ops.compilelm.argmax_rows.default(x)


def argmax_rows_ref(x: Tensor) -> Tensor:
    return x.argmax(dim=-1)


@torch.library.register_kernel("compilelm::argmax_rows", "cpu")
def _(x):
    torch._check(x.dim() == 2 and x.shape[1] > 0, lambda: f"argmax_rows: x must be [rows, vocab], got {tuple(x.shape)}")
    return argmax_rows_ref(x)


@torch.library.register_fake("compilelm::argmax_rows")
def _(x):
    torch._check(x.dim() == 2, lambda: f"argmax_rows: x must be [rows, vocab], got {tuple(x.shape)}")
    return x.new_empty((x.shape[0],), dtype=torch.int64)
