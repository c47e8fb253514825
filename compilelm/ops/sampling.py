"""argmax_rows: each row's first maximum (NaN counts as the maximum), for greedy sampling.
sample_rows: each row's sample from softmax(x * inv_temperature), for temperature sampling; with
a floor per row, from the columns whose x * inv_temperature reaches it (top-k / top-p / min-p).

Schemas in csrc/ops.cpp; the CUDA kernel (csrc/cuda/argmax_kernels.cu) reduces chunks of every
row in parallel and merges them in the last block of the row: one kernel at any batch size. On
CPU they are torch's argmax and sample_rows_ref with noise from a torch generator.

sample_rows is the Gumbel-max trick: argmax(x * inv_t - log(-log u)), u uniform in (0, 1), is
distributed as softmax(x * inv_t) (the exponential race argmax(p / E), E = -log u, is the same
draw). On CUDA the uniforms come from Philox keyed by each row's 64-bit key (at counter column / 4),
so no noise tensor, fp32 copy or softmax is made: one read of the logits in their own dtype. A row's
draw depends on its logits, temperature and key alone: the sampler keys a seeded request by (seed,
position), the others by fresh random keys.
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


def sample_rows(x: Tensor, inv_temperature: Tensor, keys: Tensor, floor: Tensor | None = None) -> Tensor:
    # x: [rows, vocab]; inv_temperature: fp32 [rows] (0: the row's argmax); keys: int64 [rows];
    # floor: fp32 [rows] or None (-inf: no threshold) -> int64 [rows]
    return torch.ops.compilelm.sample_rows.default(x, inv_temperature, keys, floor)


def sample_rows_ref(x: Tensor, inv_temperature: Tensor, uniform: Tensor, floor: Tensor | None = None) -> Tensor:
    """sample_rows given its uniforms (fp32, x's shape, in [0, 1)): argmax of x * inv_t plus
    Gumbel noise -log(-log u) (u = 0 is noise -inf: never drawn) over the columns with x * inv_t
    >= floor; inv_t 0 rows: argmax(x)."""
    scaled = x.float() * inv_temperature.unsqueeze(1)
    key = scaled - torch.log(-torch.log(uniform))
    if floor is not None:
        key = key.masked_fill(scaled < floor.unsqueeze(1), float("-inf"))
    return torch.where(inv_temperature == 0, x.argmax(dim=-1), key.argmax(dim=-1))


def _check_sample_args(x, inv_temperature, keys, floor):
    torch._check(x.dim() == 2 and x.shape[1] > 0, lambda: f"sample_rows: x must be [rows, vocab], got {tuple(x.shape)}")
    args = [("inv_temperature", inv_temperature, torch.float32), ("keys", keys, torch.int64)]
    if floor is not None:
        args.append(("floor", floor, torch.float32))
    for name, t, dtype in args:
        torch._check(t.dtype == dtype and tuple(t.shape) == (x.shape[0],),
                     lambda name=name, t=t, dtype=dtype: f"sample_rows: {name} must be {dtype} [{x.shape[0]}], got "
                                                         f"{t.dtype} {tuple(t.shape)}")


@torch.library.register_kernel("compilelm::sample_rows", "cpu")
def _(x, inv_temperature, keys, floor=None):
    # sample_rows_ref in place: each row's uniforms from a generator seeded by its key
    _check_sample_args(x, inv_temperature, keys, floor)
    noise = torch.empty(x.shape, dtype=torch.float32)
    generator = torch.Generator()
    for row, key in zip(noise, keys.tolist()):
        row.uniform_(generator=generator.manual_seed(key % 2**64))
    noise.log_().neg_().log_().neg_()  # -log(-log u): Gumbel noise
    scaled = x.float() * inv_temperature.unsqueeze(1)
    key = noise.add_(scaled)
    if floor is not None:
        key.masked_fill_(scaled < floor.unsqueeze(1), float("-inf"))
    ids = key.argmax(dim=-1)
    greedy = inv_temperature == 0
    if greedy.any():
        ids[greedy] = x[greedy].argmax(dim=-1)
    return ids


@torch.library.register_fake("compilelm::sample_rows")
def _(x, inv_temperature, keys, floor=None):
    _check_sample_args(x, inv_temperature, keys, floor)
    return x.new_empty((x.shape[0],), dtype=torch.int64)
