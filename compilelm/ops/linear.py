"""skinny_mm: `x @ weight.T` for a linear layer at one or two rows (decode at batch 1-2).

Schema in csrc/ops.cpp; the CUDA kernel (csrc/cuda/skinny_mm.cu) streams the weight once with
one warp per output column and takes M <= 2, handing larger M to cuBLAS. On CPU it is the matmul
itself. `SkinnyMMPass` puts it in place of the compiled graphs' linear matmuls on CUDA, and the
LM head calls it directly.
"""

import torch
from torch import Tensor


def skinny_mm(x: Tensor, weight: Tensor) -> Tensor:
    # x: [M, K]; weight: [N, K] -> [M, N]
    return torch.ops.compilelm.skinny_mm.default(x, weight)


def skinny_mm_ref(x: Tensor, weight: Tensor) -> Tensor:
    return torch.mm(x, weight.t())


@torch.library.register_kernel("compilelm::skinny_mm", "cpu")
def _(x, weight):
    return skinny_mm_ref(x, weight)


@torch.library.register_fake("compilelm::skinny_mm")
def _(x, weight):
    torch._check(x.dim() == 2 and weight.dim() == 2 and x.shape[1] == weight.shape[1],
                 lambda: f"skinny_mm: x must be [M, K] and weight [N, K], got {tuple(x.shape)} and {tuple(weight.shape)}")
    return x.new_empty((x.shape[0], weight.shape[0]))
