"""FP8 W8A8 linear layers: float8_e4m3fn weights with per-output-channel scales, activations
quantized per token (dynamic, the default) or with one static per-tensor scale, matmul through
`compilelm::fp8_linear` (fp8 x fp8 -> the activation dtype, scales applied in its epilogue; on CUDA
a kernel per row count: compilelm/ops/fp8_gemm.py).
Block-wise FP8 checkpoints (`Fp8BlockLinearMethod`) quantize activations per 1 x bk group and
multiply through `compilelm::fp8_block_linear` (compilelm/ops/fp8_block_gemm.py).

Quantization is applied after the weights are loaded (`quantize_model`), so every loader (GGUF,
Hugging Face, dummy) stays unchanged; only the decoder's Linear / MergedColumnParallelLinear layers are
quantized, the embedding and lm_head stay in the model dtype.

FP8 checkpoints are loaded as such (checkpoint.py) and get the same methods; for unquantized
checkpoints static activation scales come from `calibrate(model)`: run a few eager forward passes inside it, and each
layer's input scale becomes amax(|input|) / 448 over those passes.

The activation quant is a separate op (`compilelm::quant_fp8_per_token` / `quant_fp8_static`)
called on the layer's input, so the fusion passes find it right after the RMSNorm or SiLU-mul
that produced that input.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from compilelm.layers.linear import Linear
from compilelm.ops import fp8_block_gemm, fp8_gemm  # noqa: F401  (fp8_gemm: registers compilelm::fp8_linear)
from compilelm.ops import quant as _quant_ops  # noqa: F401  (registers torch.ops.compilelm.quant_*)
from compilelm.ops.quant import FP8_DTYPE, FP8_MAX, MIN_SCALE

QUANTIZATION_METHODS = ("fp8",)


def quantize_weight_per_channel(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    # w: [out, in] -> q: fp8 [out, in], scale: fp32 [1, out] (the row layout _scaled_mm wants for b)
    wf = w.float()
    scale = (wf.abs().amax(dim=1, keepdim=True) / FP8_MAX).clamp(min=MIN_SCALE)  # [out, 1]
    q = (wf / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scale.t().contiguous()


class Fp8LinearMethod:
    """The `Linear.quant_method` for fp8: `process_weights` once after loading, `apply` per call."""

    def process_weights(self, layer: Linear, input_scale: torch.Tensor | None = None) -> None:
        q, scale = quantize_weight_per_channel(layer.weight.data)
        layer.weight = nn.Parameter(q, requires_grad=False)
        layer.weight_scale = nn.Parameter(scale, requires_grad=False)
        layer.input_scale = None if input_scale is None else nn.Parameter(
            input_scale.reshape(1).float().to(q.device), requires_grad=False)
        layer.quant_method = self

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        # x: [num_tokens, in] -> [num_tokens, out] in x's dtype
        shape = x.shape
        x2 = x if x.dim() == 2 else x.reshape(-1, shape[-1])
        if layer.input_scale is None:
            q, x_scale = torch.ops.compilelm.quant_fp8_per_token(x2)  # x_scale: [num_tokens, 1]
        else:
            q = torch.ops.compilelm.quant_fp8_static(x2, layer.input_scale)
            x_scale = layer.input_scale  # [1]: one scale for every row
        out = torch.ops.compilelm.fp8_linear(q, x_scale, layer.weight, layer.weight_scale, layer.bias, x.dtype)
        return out if x.dim() == 2 else out.reshape(*shape[:-1], out.shape[-1])


class Fp8BlockLinearMethod:
    """The `Linear.quant_method` of block-wise FP8 checkpoints: layer.weight fp8 [out, in],
    layer.weight_scale fp32 [ceil(out / bn), ceil(in / bk)]; activations quantized per 1 x bk group."""

    def __init__(self, block_size: tuple[int, int]):
        self.block_size = [int(b) for b in block_size]  # [bn, bk]

    def warm_up(self, layer: Linear) -> None:
        """Settles the CUDA GEMM route for the layer's device (before any graph capture)."""
        fp8_block_gemm.warm_up(layer.weight.device, self.block_size)

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        # x: [num_tokens, in] -> [num_tokens, out] in x's dtype
        shape = x.shape
        x2 = x if x.dim() == 2 else x.reshape(-1, shape[-1])
        q, x_scale = torch.ops.compilelm.quant_fp8_per_token_group(x2, self.block_size[1])  # [T, in / bk]
        out = torch.ops.compilelm.fp8_block_linear(q, x_scale, layer.weight, layer.weight_scale, self.block_size,
                                                   layer.bias, x.dtype)
        return out if x.dim() == 2 else out.reshape(*shape[:-1], out.shape[-1])


def fp8_linears(model: nn.Module):
    """The decoder's Linear layers (not lm_head): what fp8 quantizes."""
    for name, mod in model.named_modules():
        if isinstance(mod, Linear) and not name.endswith("lm_head"):
            yield name, mod


def quantize_model(model: nn.Module, method: str) -> nn.Module:
    """Quantize the loaded (unquantized) model's linears in place, per channel, dynamic activations."""
    if method not in QUANTIZATION_METHODS:
        raise ValueError(f"quantization must be one of {', '.join(QUANTIZATION_METHODS)} or None, got {method!r}")
    fp8 = Fp8LinearMethod()
    with torch.no_grad():
        for _, layer in fp8_linears(model):
            fp8.process_weights(layer)
    return model


@contextlib.contextmanager
def calibrate(model: nn.Module):
    """Static activation scales from data: run eager forward passes inside this context; on exit
    each fp8 linear gets input_scale = amax(|input|) / 448 over everything it saw. Compile the
    model after calibrating (the static and dynamic graphs differ)."""
    layers = [layer for _, layer in fp8_linears(model) if isinstance(layer.quant_method, Fp8LinearMethod)]
    if not layers:
        raise ValueError("calibrate: the model has no fp8 layers (load it with quantization='fp8')")
    amax = {id(layer): torch.zeros((), dtype=torch.float32) for layer in layers}

    def record(layer, args):
        a = args[0].detach().abs().amax().float().cpu()
        amax[id(layer)] = torch.maximum(amax[id(layer)], a)

    hooks = [layer.register_forward_pre_hook(record) for layer in layers]
    try:
        yield
    finally:
        for h in hooks:
            h.remove()
    for layer in layers:
        scale = (amax[id(layer)] / FP8_MAX).clamp(min=MIN_SCALE).reshape(1)
        layer.input_scale = nn.Parameter(scale.to(layer.weight.device), requires_grad=False)
