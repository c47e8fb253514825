"""copy_pinned_: dst.copy_(src) between pinned host memory and the GPU, by a kernel.

Schema in csrc/ops.cpp. On CUDA (csrc/cuda/copy_pinned.cu) a kernel reads or writes the mapped
host memory directly, ordered on the current stream as a non-blocking copy is: a step's sampled
ids reach the host without a copy-engine transfer between two CUDA graphs (which started 1-8 us
after the graph). On CPU it is `dst.copy_(src)`.
"""

import torch
from torch import Tensor


def copy_pinned_(dst: Tensor, src: Tensor) -> None:
    torch.ops.compilelm.copy_pinned_.default(dst, src)


@torch.library.register_kernel("compilelm::copy_pinned_", "cpu")
def _(dst, src):
    torch._check(dst.dtype == src.dtype and dst.shape == src.shape,
                 lambda: f"copy_pinned_: dst and src must have the same dtype and shape, got {dst.dtype}{tuple(dst.shape)} "
                         f"and {src.dtype}{tuple(src.shape)}")
    dst.copy_(src)


@torch.library.register_fake("compilelm::copy_pinned_")
def _(dst, src):
    return None
