"""linear: `x @ weight.T` for a linear layer at one or two rows (decode at batch 1-2), alone,
after the RMSNorm (and residual add) that feeds it, after the MLP's SiLU-and-mul, or (gate_up_proj)
before it.

Schemas in csrc/ops.cpp; the CUDA kernel (csrc/cuda/skinny_mm.cu) streams the weight once with
one warp per output column and takes M <= 2, handing larger M to cuBLAS (after the norm kernel
for the norm ops). On CPU they are the torch compositions. `RouteLinearPass` puts linear in place
of the compiled graphs' linear matmuls on CUDA, `RMSNormLinearFusionPass` folds the norm before
them in, `SiluMulLinearFusionPass` the activation into down_proj or gate_up_proj, and the LM head calls
linear directly.
"""

from __future__ import annotations

import torch
from torch import Tensor

from compilelm.ops.activation import silu_and_mul
from compilelm.ops.norm import rms_norm

# silu_mul_linear's widest input (down_proj's K): each block recomputes the activations of the
# whole row (passes.fuse_act_linear fuses the SiLU into down_proj up to here, else into gate_up_proj)
MAX_INTERMEDIATE = 2048


def linear(x: Tensor, weight: Tensor) -> Tensor:
    # x: [M, K]; weight: [N, K] -> [M, N]
    return torch.ops.compilelm.linear.default(x, weight)


def linear_ref(x: Tensor, weight: Tensor) -> Tensor:
    return torch.mm(x, weight.t())


@torch.library.register_kernel("compilelm::linear", "cpu")
def _(x, weight):
    return linear_ref(x, weight)


@torch.library.register_fake("compilelm::linear")
def _(x, weight):
    torch._check(x.dim() == 2 and weight.dim() == 2 and x.shape[1] == weight.shape[1],
                 lambda: f"linear: x must be [M, K] and weight [N, K], got {tuple(x.shape)} and {tuple(weight.shape)}")
    return x.new_empty((x.shape[0], weight.shape[0]))


def linear_out(x: Tensor, weight: Tensor, out: Tensor) -> Tensor:
    # x: [M, K]; weight: [N, K]; out: [M, N] in x's dtype <- x @ weight.T
    torch.ops.compilelm.linear_out.default(x, weight, out)
    return out


@torch.library.register_kernel("compilelm::linear_out", "cpu")
def _(x, weight, out):
    torch._check(out.shape == (x.shape[0], weight.shape[0]) and out.dtype == x.dtype,
                 lambda: f"linear_out: out must be [{x.shape[0]}, {weight.shape[0]}] {x.dtype}, "
                         f"got {tuple(out.shape)} {out.dtype}")
    torch.mm(x, weight.t(), out=out)


@torch.library.register_fake("compilelm::linear_out")
def _(x, weight, out):
    return None


def linear_argmax_out(x: Tensor, weight: Tensor, out: Tensor, argmax: Tensor) -> Tensor:
    # out: [M, N] <- x @ weight.T (x's dtype); argmax: int64 [M] <- each row's first maximum of out
    torch.ops.compilelm.linear_argmax_out.default(x, weight, out, argmax)
    return out


@torch.library.register_kernel("compilelm::linear_argmax_out", "cpu")
def _(x, weight, out, argmax):
    torch._check(argmax.shape == (x.shape[0],) and argmax.dtype == torch.int64,
                 lambda: f"linear_argmax_out: argmax must be int64 [{x.shape[0]}], got {tuple(argmax.shape)} "
                         f"{argmax.dtype}")
    torch.ops.compilelm.linear_out.default(x, weight, out)
    torch.argmax(out, dim=-1, out=argmax)


@torch.library.register_fake("compilelm::linear_argmax_out")
def _(x, weight, out, argmax):
    return None


def rms_norm_linear(x: Tensor, norm_weight: Tensor, eps: float, weight: Tensor) -> Tensor:
    # x: [M, K]; norm_weight: [K]; weight: [N, K] -> rms_norm(x) @ weight.T: [M, N]
    return torch.ops.compilelm.rms_norm_linear.default(x, norm_weight, eps, weight)


def rms_norm_linear_ref(x: Tensor, norm_weight: Tensor, eps: float, weight: Tensor) -> Tensor:
    return linear_ref(rms_norm(x, norm_weight, eps), weight)


def fused_add_rms_norm_linear(x: Tensor, residual: Tensor, norm_weight: Tensor, eps: float,
                                 weight: Tensor) -> tuple[Tensor, Tensor]:
    # -> (rms_norm(x + residual) @ weight.T: [M, N], x + residual: [M, K])
    return torch.ops.compilelm.fused_add_rms_norm_linear.default(x, residual, norm_weight, eps, weight)


def fused_add_rms_norm_linear_ref(x: Tensor, residual: Tensor, norm_weight: Tensor, eps: float,
                                     weight: Tensor) -> tuple[Tensor, Tensor]:
    residual = x + residual
    return rms_norm_linear_ref(residual, norm_weight, eps, weight), residual


@torch.library.register_kernel("compilelm::rms_norm_linear", "cpu")
def _(x, norm_weight, eps, weight):
    return rms_norm_linear_ref(x, norm_weight, eps, weight)


@torch.library.register_kernel("compilelm::fused_add_rms_norm_linear", "cpu")
def _(x, residual, norm_weight, eps, weight):
    return fused_add_rms_norm_linear_ref(x, residual, norm_weight, eps, weight)


def _check_norm_mm(x, norm_weight, weight, op):
    torch._check(x.dim() == 2 and weight.dim() == 2 and x.shape[1] == weight.shape[1]
                 and norm_weight.shape == (x.shape[1],),
                 lambda: f"{op}: x must be [M, K], norm_weight [K] and weight [N, K], got {tuple(x.shape)}, "
                         f"{tuple(norm_weight.shape)} and {tuple(weight.shape)}")


@torch.library.register_fake("compilelm::rms_norm_linear")
def _(x, norm_weight, eps, weight):
    _check_norm_mm(x, norm_weight, weight, "rms_norm_linear")
    return x.new_empty((x.shape[0], weight.shape[0]))


@torch.library.register_fake("compilelm::fused_add_rms_norm_linear")
def _(x, residual, norm_weight, eps, weight):
    _check_norm_mm(x, norm_weight, weight, "fused_add_rms_norm_linear")
    return x.new_empty((x.shape[0], weight.shape[0])), x.new_empty(x.shape)


def silu_mul_linear(x: Tensor, weight: Tensor) -> Tensor:
    # x: [M, 2K] (gate | up); weight: [N, K] -> (silu(gate) * up) @ weight.T: [M, N]
    return torch.ops.compilelm.silu_mul_linear.default(x, weight)


def silu_mul_linear_ref(x: Tensor, weight: Tensor) -> Tensor:
    return linear_ref(silu_and_mul(x), weight)


@torch.library.register_kernel("compilelm::silu_mul_linear", "cpu")
def _(x, weight):
    return silu_mul_linear_ref(x, weight)


@torch.library.register_fake("compilelm::silu_mul_linear")
def _(x, weight):
    torch._check(x.dim() == 2 and weight.dim() == 2 and x.shape[1] == 2 * weight.shape[1],
                 lambda: f"silu_mul_linear: x must be [M, 2K] (gate | up) and weight [N, K], got "
                         f"{tuple(x.shape)} and {tuple(weight.shape)}")
    return x.new_empty((x.shape[0], weight.shape[0]))


def gate_up_silu_mul(x: Tensor, weight: Tensor) -> Tensor:
    # x: [M, K]; weight: [2I, K] (gate | up) -> silu_and_mul(x @ weight.T): [M, I]
    return torch.ops.compilelm.gate_up_silu_mul.default(x, weight)


def gate_up_silu_mul_ref(x: Tensor, weight: Tensor) -> Tensor:
    return silu_and_mul(linear_ref(x, weight))


@torch.library.register_kernel("compilelm::gate_up_silu_mul", "cpu")
def _(x, weight):
    return gate_up_silu_mul_ref(x, weight)


@torch.library.register_fake("compilelm::gate_up_silu_mul")
def _(x, weight):
    torch._check(x.dim() == 2 and weight.dim() == 2 and x.shape[1] == weight.shape[1] and weight.shape[0] % 2 == 0,
                 lambda: f"gate_up_silu_mul: x must be [M, K] and weight [2I, K] (gate | up), got "
                         f"{tuple(x.shape)} and {tuple(weight.shape)}")
    return x.new_empty((x.shape[0], weight.shape[0] // 2))
