"""The attention layer: the call of the per-layer attention op (compilelm/ops/unified_attention.py)."""

from __future__ import annotations

import logging

import torch
from torch import nn

import compilelm.ops  # noqa: F401  (defines compilelm::unified_attention)

logger = logging.getLogger("compilelm")


class Attention(nn.Module):
    """Holds the layer's name (its key in the forward context's kv_caches) and shape, and the
    per-tensor scales of an FP8 KV cache: k_scale, v_scale (fp32 values, 1.0 unless the checkpoint
    has them: compilelm/layers/quantization/checkpoint.py), used only where the cache is fp8."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, layer_name: str):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.layer_name = layer_name
        self.k_scale, self.v_scale = 1.0, 1.0
        self.kv_scales_loaded = False  # set where the checkpoint gave them

    def extra_repr(self) -> str:
        return f"{self.layer_name}, k_scale={self.k_scale}, v_scale={self.v_scale}"

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return torch.ops.compilelm.unified_attention(q, k, v, self.layer_name)


def kv_cache_scales(model: nn.Module) -> dict[str, tuple[float, float]]:
    """Layer name -> (k_scale, v_scale) of every Attention layer of `model`: what an FP8 KV cache is
    written and read with (the forward context's kv_scales). Logs where they come from."""
    from compilelm.distributed.parallel_state import get_tp_rank
    layers = [m for m in model.modules() if isinstance(m, Attention)]
    loaded = sum(m.kv_scales_loaded for m in layers)
    if get_tp_rank() > 0:  # every rank has the same scales: rank 0 says so
        pass
    elif loaded:
        logger.info("FP8 KV cache: k/v scales of %d of %d attention layers from the checkpoint (others 1.0)",
                    loaded, len(layers))
    else:  # as vLLM: no scales in the checkpoint and no --calculate-kv-scales
        logger.warning("FP8 KV cache: the checkpoint has no k/v scales; using 1.0 (values beyond +-448 saturate)")
    return {m.layer_name: (float(m.k_scale), float(m.v_scale)) for m in layers}
