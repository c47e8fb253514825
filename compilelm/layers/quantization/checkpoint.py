"""Hugging Face checkpoints already in FP8 (`quantization_config.quant_method == "fp8"`, the
format of llm-compressor / vLLM / transformers' FineGrainedFP8 without block sizes):

    <layer>.weight        float8_e4m3fn [out, in]
    <layer>.weight_scale  fp32 [] / [1] (per tensor) or [out] / [out, 1] (per channel)
    <layer>.input_scale   fp32 [] / [1], only with activation_scheme "static"

The weights are dequantized while streaming (w = q * scale, so the ordinary loader and packed
q/k/v and gate/up shards keep working) and `quantize_model` re-quantizes them per channel;
input scales are kept on the layer (`checkpoint_input_scale`, max over packed shards, which share
their input). Re-quantizing is exact for per-channel checkpoints up to fp8 rounding of rows whose
amax is not representable; block-wise (`weight_block_size`) checkpoints are not supported.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Iterator

import torch
from torch import nn


def checkpoint_quantization(path: str) -> dict | None:
    """The quantization_config of an HF model directory if it is fp8, else None."""
    try:
        with open(os.path.join(path, "config.json")) as f:
            qc = json.load(f).get("quantization_config")
    except (OSError, ValueError):
        return None
    if not qc or qc.get("quant_method") != "fp8":
        return None
    if qc.get("weight_block_size"):
        raise ValueError(f"{path}: block-wise fp8 checkpoints (weight_block_size) are not supported")
    return qc


def dequantize_fp8_weights(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]]
                           ) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield the checkpoint's tensors with fp8 weights dequantized; consume the scales."""
    pending: dict[str, torch.Tensor] = {}  # weight name -> fp8 weight waiting for its scale
    scales: dict[str, torch.Tensor] = {}  # weight name -> scale waiting for its weight
    packed = getattr(model, "packed_modules", {})
    for name, tensor in weights:
        if name.endswith(".input_scale"):
            _store_input_scale(model, packed, name, tensor)
            continue
        if name.endswith(".weight_scale"):
            wname = name[: -len("_scale")]
            if wname in pending:
                yield wname, _dequantize(pending.pop(wname), tensor)
            else:
                scales[wname] = tensor
            continue
        if tensor.dtype == torch.float8_e4m3fn:
            if name in scales:
                yield name, _dequantize(tensor, scales.pop(name))
            else:
                pending[name] = tensor
            continue
        yield name, tensor
    if pending:
        raise ValueError(f"fp8 checkpoint: no weight_scale for {sorted(pending)[:3]}")


def _dequantize(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    scale = scale.float()
    if scale.numel() > 1:
        scale = scale.reshape(-1, 1)  # per output channel
    return q.float() * scale


def _store_input_scale(model: nn.Module, packed: dict, name: str, scale: torch.Tensor) -> None:
    module_name = name[: -len(".input_scale")]
    for frag, (ours, _) in packed.items():
        if module_name.endswith(f".{frag}"):
            module_name = module_name[: -len(frag)] + ours
            break
    layer = model.get_submodule(module_name)
    scale = scale.float().reshape(1)
    old = getattr(layer, "checkpoint_input_scale", None)
    layer.checkpoint_input_scale = scale if old is None else torch.maximum(old, scale)
