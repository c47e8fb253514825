"""Paged attention as ONE opaque op per layer: `compilelm::unified_attention` and its forms.

The op writes this step's K/V into the paged cache and attends over it, reading the cache tensors
and the per-step metadata from the forward context. Dynamo sees a single custom op, which is where
the compiler splits the graph into pieces. The ops are functional in their schemas (the KV cache
is written through the forward context, not an argument) and are defined in Python
(compilelm/ops/library.py: one kernel for every device, run eagerly between the pieces). FP8 KV
caches: each op passes its layer's (k_scale, v_scale) from the forward context to the kernels.
"""

from __future__ import annotations

import torch

from compilelm.forward_context import get_forward_context
from compilelm.ops import prefill_attention as prefill
from compilelm.ops.attention import paged_attention, reshape_and_cache, rope_paged_attention
from compilelm.ops.library import define
from compilelm.ops.rope import rope_and_cache


def _attend(ctx, q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
            scales: tuple[float, float]) -> torch.Tensor:
    """Paged attention of q [num_tokens, num_heads * head_dim] (rotated) over the caches, this
    step's rows already in them -> [num_tokens, num_heads * head_dim]. Where prefill_attention
    serves the batch (CUDA, a step with prefill rows), it attends the prefill rows and
    paged_attention the rest."""
    meta, n, head_dim = ctx.attn_metadata, q.shape[0], key_cache.shape[3]
    q = q.view(n, -1, head_dim)
    split = prefill.serves(q, key_cache, meta.max_query_len)
    out = paged_attention(q, key_cache, value_cache, meta.cu_seqlens_q, meta.seq_lens, meta.block_tables,
                          head_dim ** -0.5, meta.max_query_len, not split, *scales)
    if split:
        prefill.prefill_attention(out, q, key_cache, value_cache, meta.cu_seqlens_q, meta.seq_lens,
                                  meta.block_tables, head_dim ** -0.5, k_scale=scales[0], v_scale=scales[1],
                                  max_seq_len=meta.max_seq_len)
    return out.view(n, -1)


def _rotate_and_cache(ctx, q, k, v, q_norm_weight, k_norm_weight, eps, positions, cos_sin_cache, head_dim,
                      key_cache, value_cache, scales) -> torch.Tensor:
    """rope_and_cache of q, k, v [num_tokens, heads * head_dim] -> rotated q [num_tokens, num_heads, head_dim]."""
    n = q.shape[0]
    return rope_and_cache(positions, q.view(n, -1, head_dim), k.view(n, -1, head_dim), v.view(n, -1, head_dim),
                              cos_sin_cache, q_norm_weight, k_norm_weight, eps, key_cache, value_cache,
                              ctx.attn_metadata.slot_mapping, *scales)


@define("unified_attention(Tensor q, Tensor k, Tensor v, str layer_name) -> Tensor")
def unified_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_name: str) -> torch.Tensor:
    # q: [num_tokens, num_heads * head_dim]; k, v: [num_tokens, num_kv_heads * head_dim]
    ctx = get_forward_context()
    meta = ctx.attn_metadata
    key_cache, value_cache = ctx.kv_caches[layer_name]
    num_kv_heads, head_dim = key_cache.shape[2], key_cache.shape[3]
    num_tokens = q.shape[0]
    k = k.view(num_tokens, num_kv_heads, head_dim)
    v = v.view(num_tokens, num_kv_heads, head_dim)
    scales = ctx.kv_scales_of(layer_name)
    reshape_and_cache(k, v, key_cache, value_cache, meta.slot_mapping, *scales)
    ctx.attention_done(layer_name)
    return _attend(ctx, q, key_cache, value_cache, scales)


# RoPE (and Qwen3's QK-norm) inside attention: what `RopeAttentionFusionPass` rewrites
# `rope(q, k) -> unified_attention` to. The rotated k is what goes into the KV cache: one
# `rope_and_cache` op normalizes and rotates q and k and writes k and v into the cache (on CPU
# the same torch ops as the unfused path, so the same numerics; on CUDA one kernel), then paged
# attention runs. Without QK-norm both are one op, `rope_paged_attention`: on CUDA a pure-decode
# batch in small launches is then one kernel, the decode attention kernel rotating q and k itself.

def _rope_and_attention(q, k, v, q_norm_weight, k_norm_weight, eps, positions, cos_sin_cache, head_dim, layer_name):
    ctx = get_forward_context()
    ctx.attention_done(layer_name)
    meta = ctx.attn_metadata
    key_cache, value_cache = ctx.kv_caches[layer_name]
    scales = ctx.kv_scales_of(layer_name)
    n = q.shape[0]
    if q_norm_weight is None and not prefill.serves(q.view(n, -1, head_dim), key_cache, meta.max_query_len):
        # one op (on CUDA one kernel for a pure-decode batch)
        out = rope_paged_attention(positions, q.view(n, -1, head_dim), k.view(n, -1, head_dim),
                                       v.view(n, -1, head_dim), cos_sin_cache, key_cache, value_cache,
                                       meta.slot_mapping, meta.cu_seqlens_q, meta.seq_lens, meta.block_tables,
                                       head_dim ** -0.5, meta.max_query_len, *scales)
        return out.view(n, -1)
    q = _rotate_and_cache(ctx, q, k, v, q_norm_weight, k_norm_weight, eps, positions, cos_sin_cache, head_dim,
                          key_cache, value_cache, scales)  # k, v: in the cache
    return _attend(ctx, q.view(n, -1), key_cache, value_cache, scales)


@define("unified_attention_rope(Tensor q, Tensor k, Tensor v, Tensor positions, Tensor cos_sin_cache, "
         "SymInt head_dim, str layer_name) -> Tensor")
def unified_attention_rope(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                           cos_sin_cache: torch.Tensor, head_dim: int, layer_name: str) -> torch.Tensor:
    # q: [num_tokens, num_heads * head_dim] (not yet rotated); positions: [num_tokens]
    # cos_sin_cache: [max_position, head_dim] = cos | sin of the half-dims
    return _rope_and_attention(q, k, v, None, None, 0.0, positions, cos_sin_cache, head_dim, layer_name)


@define("unified_attention_qknorm_rope(Tensor q, Tensor k, Tensor v, Tensor q_norm_weight, Tensor k_norm_weight, "
         "float eps, Tensor positions, Tensor cos_sin_cache, SymInt head_dim, str layer_name) -> Tensor")
def unified_attention_qknorm_rope(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_norm_weight: torch.Tensor,
                                  k_norm_weight: torch.Tensor, eps: float, positions: torch.Tensor,
                                  cos_sin_cache: torch.Tensor, head_dim: int, layer_name: str) -> torch.Tensor:
    # Qwen3: per-head RMSNorm of q and k (weights: [head_dim]), then RoPE, then attention.
    return _rope_and_attention(q, k, v, q_norm_weight, k_norm_weight, eps, positions, cos_sin_cache, head_dim,
                               layer_name)


# With `passes.fuse_qkv_rope`, RoPE stays out of the attention kernel: `RopeAttentionFusionPass`
# rewrites rope(q, k) -> unified_attention to `rope_cache` (RoPE + the KV-cache write, inside the
# piece before the split) and `unified_attention_rotated` (the splitting op); on CUDA the QKV
# projection before it then takes the rope in (compilelm/ops/qkv_rope.py). rope_cache names no
# layer: it writes the next attention layer's cache (compilelm/forward_context.py). Outputs are
# contiguous [num_tokens, num_heads * head_dim].


def _query_fake(q, *args):
    return q.new_empty(q.shape)


@define("rope_cache(Tensor q, Tensor k, Tensor v, Tensor positions, Tensor cos_sin_cache, SymInt head_dim) "
         "-> Tensor", _query_fake)
def rope_cache(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
               cos_sin_cache: torch.Tensor, head_dim: int) -> torch.Tensor:
    # -> rotated q [num_tokens, num_heads * head_dim]; the rotated k and v go to the next layer's cache
    ctx = get_forward_context()
    q_rotated = _rotate_and_cache(ctx, q, k, v, None, None, 0.0, positions, cos_sin_cache, head_dim,
                                  *ctx.next_kv_cache(), ctx.next_kv_scales())
    return q_rotated.view(q.shape[0], -1)


@define("unified_attention_rotated(Tensor q, str layer_name) -> Tensor", _query_fake)
def unified_attention_rotated(q: torch.Tensor, layer_name: str) -> torch.Tensor:
    # q: [num_tokens, num_heads * head_dim], rotated; this step's k and v already in the cache
    ctx = get_forward_context()
    ctx.attention_done(layer_name)
    return _attend(ctx, q, *ctx.kv_caches[layer_name], ctx.kv_scales_of(layer_name))
