"""Rotary position embedding (neox / rotate-half style, as in Hugging Face Llama and Qwen).

cos/sin for every position are computed once in fp32, exactly as Hugging Face computes them, and
indexed by the flat `positions` tensor at run time.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from compilelm.ops.rope import apply_rope


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    factor = scaling["factor"]
    low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
    old_len = scaling["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def compute_inv_freq(head_dim: int, theta: float, scaling: dict | None) -> tuple[torch.Tensor, float]:
    """Returns (inv_freq [head_dim // 2], attention scaling applied to cos/sin)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type"))
    if kind in (None, "default"):
        return inv_freq, 1.0
    if kind == "llama3":
        return _llama3_inv_freq(inv_freq, scaling), 1.0
    if kind == "linear":
        return inv_freq / scaling["factor"], 1.0
    if kind == "freq_factors":  # llama.cpp's rope_freqs (GGUF): one divisor per frequency
        factors = torch.tensor(scaling["factors"], dtype=torch.float32)
        if factors.shape != inv_freq.shape:
            raise ValueError(f"rope_scaling freq_factors has {factors.numel()} factors, head_dim {head_dim} "
                             f"needs {inv_freq.numel()}")
        return inv_freq / factors, 1.0
    raise ValueError(f"unsupported rope_scaling type {kind!r} (supported: default, linear, llama3, freq_factors)")


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, max_position: int, theta: float, scaling: dict | None = None):
        super().__init__()
        self.head_dim = head_dim
        inv_freq, attn_scale = compute_inv_freq(head_dim, theta, scaling)
        t = torch.arange(max_position, dtype=torch.int64).float()
        freqs = torch.outer(t, inv_freq)  # [max_position, head_dim // 2]
        # cos_sin_cache: [max_position, head_dim] = cos of the half-dims | sin of the half-dims
        cache = torch.cat([freqs.cos() * attn_scale, freqs.sin() * attn_scale], dim=-1)
        self.register_buffer("cos_sin_cache", cache, persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        # positions: [num_tokens]; q: [num_tokens, num_heads * head_dim]; k: [num_tokens, num_kv_heads * head_dim]
        cos, sin = self.cos_sin_cache[positions].chunk(2, dim=-1)
        return apply_rope(q, cos, sin, self.head_dim), apply_rope(k, cos, sin, self.head_dim)

