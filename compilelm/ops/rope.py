"""Rotary position embedding (rotate-half, as Hugging Face Llama and Qwen) as ops.

- `apply_rope`: the plain-torch reference that RotaryEmbedding and the pass patterns call.
- `compilelm::rope`, `compilelm::qknorm_rope`: RoPE (after Qwen3's per-head QK-norm) of one tensor,
  functional; the intermediate ops of `passes.fuse_rope_attention` (its patterns rewrite the
  model's RoPE code to them, then it fuses pairs of them into the attention op). Their kernels
  are the references.
- `compilelm::rope_and_cache`: RoPE of q and k (after QK-norm, optionally) and the KV-cache write
  of the rotated k and v, in one op (csrc/cuda/rope_cache_kernels.cu on CUDA; on CPU the torch
  composition of the unfused path: rms_norm, apply_rope, reshape_and_cache).
"""

from __future__ import annotations

import torch
from torch import Tensor

from compilelm.ops.norm import rms_norm

FP8_KV_DTYPE = torch.float8_e4m3fn
FP8_KV_MAX = 448.0  # float8_e4m3fn's largest finite value


def quantize_kv(x: Tensor, cache_dtype: torch.dtype, scale: float = 1.0) -> Tensor:
    """What a cache of `cache_dtype` stores for x: x itself, or for an fp8 cache
    fp8(clamp(x.float() / scale, -448, 448)) (round to nearest even, saturating: vLLM's e4m3 write).
    The division is IEEE-rounded on every device, as the kernels' (on CUDA, torch divides by a
    Python number as a multiply by its reciprocal, which moves ~1 code in 10^5 for some scales):
    the scale is a tensor on x's device."""
    if cache_dtype != FP8_KV_DTYPE:
        return x
    divisor = torch.tensor(scale, dtype=torch.float32, device=x.device)
    return (x.float() / divisor).clamp(-FP8_KV_MAX, FP8_KV_MAX).to(FP8_KV_DTYPE)


def dequantize_kv(cache: Tensor, scale: float = 1.0) -> Tensor:
    """The fp32 values a reader sees: an fp8 cache times its scale, else the cache widened."""
    return cache.float() * scale if cache.dtype == FP8_KV_DTYPE else cache.float()


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor, head_dim: int) -> Tensor:
    """Rotate-half RoPE, written as the two halves (x1 cos - x2 sin | x2 cos + x1 sin): the same
    roundings as Hugging Face's `x * cat(cos, cos) + rotate_half(x) * cat(sin, sin)`, in half
    the aten ops (no duplicated cos/sin), so the traced graph is smaller to functionalize."""
    # x: [num_tokens, num_heads * head_dim]; cos, sin: [num_tokens, head_dim // 2]
    num_tokens = x.shape[0]
    x1, x2 = x.view(num_tokens, -1, head_dim).chunk(2, dim=-1)  # [num_tokens, num_heads, head_dim // 2]
    cos, sin = cos.unsqueeze(1).to(x.dtype), sin.unsqueeze(1).to(x.dtype)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).view(num_tokens, -1)


def rope_ref(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    # x: [num_tokens, num_heads * head_dim]; cos, sin: [num_tokens, head_dim // 2]
    return apply_rope(x, cos, sin, 2 * cos.shape[-1])


def qknorm_rope_ref(x: Tensor, weight: Tensor, cos: Tensor, sin: Tensor, eps: float) -> Tensor:
    # weight: [head_dim] (one RMSNorm shared by every head). The view spells the head count out,
    # like Qwen3Attention.qk_norm: the pattern matcher checks a match by retracing with its shapes.
    n, head_dim = x.shape[0], 2 * cos.shape[-1]
    x = rms_norm(x.view(n, x.shape[1] // head_dim, head_dim), weight, eps).view(n, -1)
    return apply_rope(x, cos, sin, head_dim)


@torch.library.custom_op("compilelm::rope", mutates_args=())
def rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    return rope_ref(x, cos, sin)


@rope.register_fake
def _(x, cos, sin):
    return torch.empty_like(x)


@torch.library.custom_op("compilelm::qknorm_rope", mutates_args=())
def qknorm_rope(x: Tensor, weight: Tensor, cos: Tensor, sin: Tensor, eps: float) -> Tensor:
    return qknorm_rope_ref(x, weight, cos, sin, eps)


@qknorm_rope.register_fake
def _(x, weight, cos, sin, eps):
    return torch.empty_like(x)


def rope_and_cache(
    positions: Tensor,  # int64 [num_tokens]
    query: Tensor,  # [num_tokens, num_heads, head_size], not yet rotated
    key: Tensor,  # [num_tokens, num_kv_heads, head_size], not yet rotated
    value: Tensor,  # [num_tokens, num_kv_heads, head_size]
    cos_sin_cache: Tensor,  # [max_position, head_size] = cos | sin of the half-dims
    q_norm_weight: Tensor | None,  # [head_size]: QK-norm (both weights or neither)
    k_norm_weight: Tensor | None,
    eps: float,
    key_cache: Tensor,  # [num_blocks, block_size, num_kv_heads, head_size], written in place
    value_cache: Tensor,  # written in place
    slot_mapping: Tensor,  # int64 [num_tokens]; -1 skips
    k_scale: float = 1.0,  # fp8 caches: the rotated key stored as fp8(k / k_scale)
    v_scale: float = 1.0,
) -> Tensor:  # rotated query, [num_tokens, num_heads, head_size] contiguous
    return torch.ops.compilelm.rope_and_cache.default(positions, query, key, value, cos_sin_cache, q_norm_weight,
                                                      k_norm_weight, eps, key_cache, value_cache, slot_mapping,
                                                      k_scale, v_scale)


def rope_and_cache_ref(positions, query, key, value, cos_sin_cache, q_norm_weight, k_norm_weight, eps, key_cache,
                       value_cache, slot_mapping, k_scale=1.0, v_scale=1.0) -> Tensor:
    n, head_size = query.shape[0], query.shape[2]
    if q_norm_weight is not None:
        query, key = rms_norm(query, q_norm_weight, eps), rms_norm(key, k_norm_weight, eps)
    cos, sin = cos_sin_cache[positions].chunk(2, dim=-1)
    q = apply_rope(query.reshape(n, -1), cos, sin, head_size).view(n, -1, head_size)
    k = apply_rope(key.reshape(n, -1), cos, sin, head_size).view(n, -1, head_size)
    torch.ops.compilelm.reshape_and_cache.default(k, value, key_cache, value_cache, slot_mapping, k_scale, v_scale)
    return q.contiguous()


@torch.library.register_kernel("compilelm::rope_and_cache", "cpu")
def _(positions, query, key, value, cos_sin_cache, q_norm_weight, k_norm_weight, eps, key_cache, value_cache,
      slot_mapping, k_scale=1.0, v_scale=1.0):
    return rope_and_cache_ref(positions, query, key, value, cos_sin_cache, q_norm_weight, k_norm_weight, eps,
                              key_cache, value_cache, slot_mapping, k_scale, v_scale)


@torch.library.register_fake("compilelm::rope_and_cache")
def _(positions, query, key, value, cos_sin_cache, q_norm_weight, k_norm_weight, eps, key_cache, value_cache,
      slot_mapping, k_scale=1.0, v_scale=1.0):
    return query.new_empty(query.shape)
