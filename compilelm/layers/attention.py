"""Paged attention as ONE opaque op per layer: `compilelm::unified_attention`.

The op writes this step's K/V into the paged cache and attends over it, reading the cache tensors
and the per-step metadata from the forward context. Dynamo sees a single custom op, which is where
the compiler splits the graph into pieces.

The ops are registered with torch.library's low-level API (schema, one kernel for every device,
a fake), not `torch.library.custom_op`: they run eagerly between the piece graphs, once per layer
per step, and custom_op wraps every call in Python checks (device dispatch, output aliasing):
4.7 -> 2.3 us a call on CPU torch 2.13 (30 layers: ~70 us of every piecewise step's host time).
"""

from __future__ import annotations

import torch
from torch import nn

from compilelm import ops
from compilelm.forward_context import get_forward_context


_lib = torch.library.Library("compilelm", "FRAGMENT")  # the namespace is csrc/ops.cpp's


def _define(schema: str, fake=lambda q, *args: torch.empty_like(q)):
    """Registers the decorated function as compilelm::<schema>, functional (no argument mutated:
    the KV cache is written through the forward context), the same kernel on every device, with
    `fake` (by default one that returns empty_like(q))."""
    name = schema.split("(", 1)[0]

    def register(fn):
        _lib.define(schema)
        _lib.impl(name, fn, "CompositeExplicitAutograd")
        torch.library.register_fake(f"compilelm::{name}", fake, lib=_lib)
        return fn

    return register


def _attend(ctx, q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor) -> torch.Tensor:
    """Paged attention of q [num_tokens, num_heads * head_dim] (rotated) over the caches, this
    step's rows already in them -> [num_tokens, num_heads * head_dim]."""
    meta, n, head_dim = ctx.attn_metadata, q.shape[0], key_cache.shape[3]
    out = ops.paged_attention(q.view(n, -1, head_dim), key_cache, value_cache, meta.cu_seqlens_q, meta.seq_lens,
                              meta.block_tables, head_dim ** -0.5, meta.max_query_len)
    return out.view(n, -1)


def _rotate_and_cache(ctx, q, k, v, q_norm_weight, k_norm_weight, eps, positions, cos_sin_cache, head_dim,
                      key_cache, value_cache) -> torch.Tensor:
    """rope_and_cache of q, k, v [num_tokens, heads * head_dim] -> rotated q [num_tokens, num_heads, head_dim]."""
    n = q.shape[0]
    return ops.rope_and_cache(positions, q.view(n, -1, head_dim), k.view(n, -1, head_dim), v.view(n, -1, head_dim),
                              cos_sin_cache, q_norm_weight, k_norm_weight, eps, key_cache, value_cache,
                              ctx.attn_metadata.slot_mapping)


@_define("unified_attention(Tensor q, Tensor k, Tensor v, str layer_name) -> Tensor")
def unified_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_name: str) -> torch.Tensor:
    # q: [num_tokens, num_heads * head_dim]; k, v: [num_tokens, num_kv_heads * head_dim]
    ctx = get_forward_context()
    meta = ctx.attn_metadata
    key_cache, value_cache = ctx.kv_caches[layer_name]
    num_kv_heads, head_dim = key_cache.shape[2], key_cache.shape[3]
    num_tokens = q.shape[0]
    k = k.view(num_tokens, num_kv_heads, head_dim)
    v = v.view(num_tokens, num_kv_heads, head_dim)
    ops.reshape_and_cache(k, v, key_cache, value_cache, meta.slot_mapping)
    ctx.attention_done(layer_name)
    return _attend(ctx, q, key_cache, value_cache)


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
    n = q.shape[0]
    if q_norm_weight is None:  # one op (on CUDA one kernel for a pure-decode batch)
        out = ops.rope_paged_attention(positions, q.view(n, -1, head_dim), k.view(n, -1, head_dim),
                                       v.view(n, -1, head_dim), cos_sin_cache, key_cache, value_cache,
                                       meta.slot_mapping, meta.cu_seqlens_q, meta.seq_lens, meta.block_tables,
                                       head_dim ** -0.5, meta.max_query_len)
        return out.view(n, -1)
    q = _rotate_and_cache(ctx, q, k, v, q_norm_weight, k_norm_weight, eps, positions, cos_sin_cache, head_dim,
                          key_cache, value_cache)  # k, v: in the cache
    return _attend(ctx, q.view(n, -1), key_cache, value_cache)


@_define("unified_attention_rope(Tensor q, Tensor k, Tensor v, Tensor positions, Tensor cos_sin_cache, "
         "SymInt head_dim, str layer_name) -> Tensor")
def unified_attention_rope(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                           cos_sin_cache: torch.Tensor, head_dim: int, layer_name: str) -> torch.Tensor:
    # q: [num_tokens, num_heads * head_dim] (not yet rotated); positions: [num_tokens]
    # cos_sin_cache: [max_position, head_dim] = cos | sin of the half-dims
    return _rope_and_attention(q, k, v, None, None, 0.0, positions, cos_sin_cache, head_dim, layer_name)


@_define("unified_attention_qknorm_rope(Tensor q, Tensor k, Tensor v, Tensor q_norm_weight, Tensor k_norm_weight, "
         "float eps, Tensor positions, Tensor cos_sin_cache, SymInt head_dim, str layer_name) -> Tensor")
def unified_attention_qknorm_rope(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_norm_weight: torch.Tensor,
                                  k_norm_weight: torch.Tensor, eps: float, positions: torch.Tensor,
                                  cos_sin_cache: torch.Tensor, head_dim: int, layer_name: str) -> torch.Tensor:
    # Qwen3: per-head RMSNorm of q and k (weights: [head_dim]), then RoPE, then attention.
    return _rope_and_attention(q, k, v, q_norm_weight, k_norm_weight, eps, positions, cos_sin_cache, head_dim,
                               layer_name)


# With `passes.fuse_qkv_rope`, RoPE stays out of the attention kernel: `RopeAttentionFusionPass`
# rewrites rope(q, k) -> unified_attention to `rope_cache` (RoPE + the KV-cache write, inside the
# piece before the split) and `unified_attention_rotated` (the splitting op), and on CUDA the QKV
# projection before it takes the rope in (`QKVRopeFusionPass`: `qkv_rope`, `rms_norm_qkv_rope`,
# `fused_add_rms_norm_qkv_rope`). The ops inside the pieces write the cache of the next attention
# layer (ForwardContext.next_kv_cache): no layer name in them, so that the layers' pieces stay
# alike (compiled once). Their outputs are contiguous [num_tokens, num_heads * head_dim], as the
# fakes say (new_empty).


def _query_fake(q, *args):
    return q.new_empty(q.shape)


@_define("rope_cache(Tensor q, Tensor k, Tensor v, Tensor positions, Tensor cos_sin_cache, SymInt head_dim) "
         "-> Tensor", _query_fake)
def rope_cache(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
               cos_sin_cache: torch.Tensor, head_dim: int) -> torch.Tensor:
    # -> rotated q [num_tokens, num_heads * head_dim]; the rotated k and v go to the next layer's cache
    ctx = get_forward_context()
    q_rotated = _rotate_and_cache(ctx, q, k, v, None, None, 0.0, positions, cos_sin_cache, head_dim,
                                  *ctx.next_kv_cache())
    return q_rotated.view(q.shape[0], -1)


@_define("unified_attention_rotated(Tensor q, str layer_name) -> Tensor", _query_fake)
def unified_attention_rotated(q: torch.Tensor, layer_name: str) -> torch.Tensor:
    # q: [num_tokens, num_heads * head_dim], rotated; this step's k and v already in the cache
    ctx = get_forward_context()
    ctx.attention_done(layer_name)
    return _attend(ctx, q, *ctx.kv_caches[layer_name])


def _qkv_rope_fake(x, *args):  # args end with (cos_sin_cache, num_heads)
    return x.new_empty((x.shape[0], args[-1] * args[-2].shape[1]))


def _add_qkv_rope_fake(x, residual, *args):
    return _qkv_rope_fake(x, *args), x.new_empty(x.shape)


def _into_next_cache(num_heads: int) -> tuple:
    """The QKV-projection ops' last arguments: the next attention layer's key and value caches, the
    step's slot mapping, and the head count."""
    ctx = get_forward_context()
    return (*ctx.next_kv_cache(), ctx.attn_metadata.slot_mapping, num_heads)


@_define("qkv_rope(Tensor x, Tensor weight, Tensor positions, Tensor cos_sin_cache, int num_heads) -> Tensor",
         _qkv_rope_fake)
def qkv_rope(x: torch.Tensor, weight: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor,
             num_heads: int) -> torch.Tensor:
    # rope_cache of the q | k | v of x @ weight.T -> rotated q [num_tokens, num_heads * head_dim]
    q = ops.skinny_mm_rope(x, weight, positions, cos_sin_cache, *_into_next_cache(num_heads))
    return q.view(x.shape[0], -1)


@_define("rms_norm_qkv_rope(Tensor x, Tensor norm_weight, float eps, Tensor weight, Tensor positions, "
         "Tensor cos_sin_cache, int num_heads) -> Tensor", _qkv_rope_fake)
def rms_norm_qkv_rope(x: torch.Tensor, norm_weight: torch.Tensor, eps: float, weight: torch.Tensor,
                      positions: torch.Tensor, cos_sin_cache: torch.Tensor, num_heads: int) -> torch.Tensor:
    # rope_cache of the q | k | v of rms_norm(x) @ weight.T -> rotated q [num_tokens, num_heads * head_dim]
    q = ops.rms_norm_skinny_mm_rope(x, norm_weight, eps, weight, positions, cos_sin_cache,
                                    *_into_next_cache(num_heads))
    return q.view(x.shape[0], -1)


@_define("fused_add_rms_norm_qkv_rope(Tensor x, Tensor residual, Tensor norm_weight, float eps, Tensor weight, "
         "Tensor positions, Tensor cos_sin_cache, int num_heads) -> (Tensor, Tensor)", _add_qkv_rope_fake)
def fused_add_rms_norm_qkv_rope(x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                                weight: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor,
                                num_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    # the same of rms_norm(x + residual) -> (rotated q, x + residual)
    q, residual = ops.fused_add_rms_norm_skinny_mm_rope(x, residual, norm_weight, eps, weight, positions,
                                                        cos_sin_cache, *_into_next_cache(num_heads))
    return q.view(x.shape[0], -1), residual


def _mm_add_qkv_rope_fake(x, weight, residual, eps, *args):
    return _qkv_rope_fake(x, *args), x.new_empty(residual.shape)


@_define("mm_add_rms_norm_qkv_rope(Tensor x, Tensor weight, Tensor residual, float eps, Tensor weight2, "
         "Tensor positions, Tensor cos_sin_cache, int num_heads) -> (Tensor, Tensor)", _mm_add_qkv_rope_fake)
def mm_add_rms_norm_qkv_rope(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor, eps: float,
                             weight2: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor,
                             num_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    # qkv_rope of rms_norm(h) (no weight: folded into weight2), h = x @ weight.T + residual
    # (compilelm/ops/norm_gemm.py) -> (rotated q [num_tokens, num_heads * head_dim], h)
    q, h = torch.ops.compilelm.mm_add_rms_norm_mm_rope(x, weight, residual, eps, weight2, positions, cos_sin_cache,
                                                       *_into_next_cache(num_heads))
    return q.view(x.shape[0], -1), h


class Attention(nn.Module):
    """Holds the layer's name (its key in the forward context's kv_caches) and shape."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, layer_name: str):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.layer_name = layer_name

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return torch.ops.compilelm.unified_attention(q, k, v, self.layer_name)
