"""argmax_rows: each row's first maximum (NaN counts as the maximum), for greedy sampling.
sample_rows: each row's sample from softmax(x * inv_temperature), for plain temperature sampling.

Schemas in csrc/ops.cpp; the CUDA kernel (csrc/cuda/argmax_kernels.cu) reduces chunks of every
row in parallel and merges them in the last block of the row: one kernel at any batch size. On
CPU they are torch's argmax and sample_rows_ref with noise from a torch generator.

sample_rows is the Gumbel-max trick: argmax(x * inv_t - log(-log u)), u uniform in (0, 1), is
distributed as softmax(x * inv_t) (the exponential race argmax(p / E), E = -log u, is the same
draw). On CUDA the uniforms come from Philox keyed by (seed, offset, row, column), so no noise
tensor, fp32 copy or softmax is made: one read of the logits in their own dtype.
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


def sample_rows(x: Tensor, inv_temperature: Tensor, seed: int, offset: int = 0) -> Tensor:
    # x: [rows, vocab]; inv_temperature: fp32 [rows] (0: the row's argmax) -> int64 [rows]
    return torch.ops.compilelm.sample_rows.default(x, inv_temperature, seed, offset)


def sample_rows_ref(x: Tensor, inv_temperature: Tensor, uniform: Tensor) -> Tensor:
    """sample_rows given its uniforms (fp32, x's shape, in [0, 1)): argmax of x * inv_t plus
    Gumbel noise -log(-log u) (u = 0 is noise -inf: never drawn); inv_t 0 rows: argmax(x)."""
    key = x.float() * inv_temperature.unsqueeze(1) - torch.log(-torch.log(uniform))
    return torch.where(inv_temperature == 0, x.argmax(dim=-1), key.argmax(dim=-1))


def _check_sample_args(x, inv_temperature):
    torch._check(x.dim() == 2 and x.shape[1] > 0, lambda: f"sample_rows: x must be [rows, vocab], got {tuple(x.shape)}")
    torch._check(inv_temperature.dtype == torch.float32 and tuple(inv_temperature.shape) == (x.shape[0],),
                 lambda: f"sample_rows: inv_temperature must be float32 [{x.shape[0]}], got "
                         f"{inv_temperature.dtype} {tuple(inv_temperature.shape)}")


@torch.library.register_kernel("compilelm::sample_rows", "cpu")
def _(x, inv_temperature, seed, offset):
    _check_sample_args(x, inv_temperature)
    generator = torch.Generator().manual_seed((seed ^ (offset * 0x9E3779B97F4A7C15)) % 2**64)
    return sample_rows_ref(x, inv_temperature, torch.rand(x.shape, generator=generator))


@torch.library.register_fake("compilelm::sample_rows")
def _(x, inv_temperature, seed, offset):
    _check_sample_args(x, inv_temperature)
    return x.new_empty((x.shape[0],), dtype=torch.int64)
