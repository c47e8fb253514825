"""The QKV projection with RoPE and the KV-cache write in it.

Kernel ops (schemas in csrc/ops.cpp; the caches are arguments): qkv_rope_cache /
rms_norm_qkv_rope_cache / fused_add_rms_norm_qkv_rope_cache, a QKV projection (compilelm.ops.gemm's
linear, or its norm + linear ops) followed by rope_and_cache of its q | k | v. On CUDA one
kernel at M <= 2 (csrc/cuda/skinny_mm.cu, kRope; the norm variants where the norm fuses), and at
3-64 rows on sm_90 the norm kernel (if any) then hopper_mm_rope_out (compilelm/ops/hopper_gemm.py:
the Hopper GEMM with RoPE in its epilogue) where it takes the weight; elsewhere the ops one after
another.

Graph ops (what `passes.fuse_qkv_rope` rewrites to; defined here in Python): qkv_rope,
rms_norm_qkv_rope, fused_add_rms_norm_qkv_rope. They take no cache: they write the next attention
layer's (compilelm/forward_context.py, "The next layer's KV cache"), so every layer's piece stays
the same code, compiled once. Outputs are contiguous [num_tokens, num_heads * head_dim].

FP8 KV caches: the kernel ops write caches of the model dtype only (their CUDA kernels and the
Triton epilogue store x's dtype). Where the next layer's cache is fp8 the graph ops run the
projection, then rope_and_cache with the layer's scales (`rope_into_next_cache`): the same
results as the unfused graph, one kernel more (logged once).
"""

from __future__ import annotations

import logging

import torch
from torch import Tensor

from compilelm.forward_context import get_forward_context
from compilelm.ops.gemm import fused_add_rms_norm_linear_ref, linear_ref, rms_norm_linear_ref
from compilelm.ops.library import define
from compilelm.ops.rope import FP8_KV_DTYPE, rope_and_cache, rope_and_cache_ref

logger = logging.getLogger("compilelm")
_logged_fp8 = [False]


def qkv_rope_cache(
    x: Tensor,  # [M, K]
    weight: Tensor,  # [(num_heads + 2 * num_kv_heads) * head_size, K]: q | k | v rows
    positions: Tensor,  # int64 [M]
    cos_sin_cache: Tensor,  # [max_position, head_size]
    key_cache: Tensor,  # [num_blocks, block_size, num_kv_heads, head_size], written in place
    value_cache: Tensor,  # written in place
    slot_mapping: Tensor,  # int64 [M]; -1 skips
    num_heads: int,
) -> Tensor:  # rotated query, [M, num_heads, head_size] contiguous
    return torch.ops.compilelm.qkv_rope_cache.default(x, weight, positions, cos_sin_cache, key_cache, value_cache,
                                                      slot_mapping, num_heads)


def rms_norm_qkv_rope_cache(x, norm_weight, eps, weight, positions, cos_sin_cache, key_cache, value_cache,
                            slot_mapping, num_heads) -> Tensor:
    # qkv_rope_cache of rms_norm(x) (norm_weight: [K]) -> rotated query [M, num_heads, head_size]
    return torch.ops.compilelm.rms_norm_qkv_rope_cache.default(x, norm_weight, eps, weight, positions, cos_sin_cache,
                                                               key_cache, value_cache, slot_mapping, num_heads)


def fused_add_rms_norm_qkv_rope_cache(x, residual, norm_weight, eps, weight, positions, cos_sin_cache, key_cache,
                                      value_cache, slot_mapping, num_heads) -> tuple[Tensor, Tensor]:
    # -> (rotated query, x + residual); the projection normalizes x + residual
    return torch.ops.compilelm.fused_add_rms_norm_qkv_rope_cache.default(
        x, residual, norm_weight, eps, weight, positions, cos_sin_cache, key_cache, value_cache, slot_mapping,
        num_heads)


def _rope_qkv_ref(qkv, positions, cos_sin_cache, key_cache, value_cache, slot_mapping, num_heads):
    """rope_and_cache of the q | k | v columns of a QKV projection's output."""
    n, kv_heads, head_size = qkv.shape[0], key_cache.shape[2], key_cache.shape[3]
    q, k, v = (t.view(n, -1, head_size) for t in qkv.split(
        [num_heads * head_size, kv_heads * head_size, kv_heads * head_size], dim=-1))
    return rope_and_cache_ref(positions, q, k, v, cos_sin_cache, None, None, 0.0, key_cache, value_cache, slot_mapping)


def qkv_rope_cache_ref(x, weight, positions, cos_sin_cache, key_cache, value_cache, slot_mapping,
                       num_heads) -> Tensor:
    return _rope_qkv_ref(linear_ref(x, weight), positions, cos_sin_cache, key_cache, value_cache, slot_mapping,
                         num_heads)


def rms_norm_qkv_rope_cache_ref(x, norm_weight, eps, weight, positions, cos_sin_cache, key_cache, value_cache,
                                slot_mapping, num_heads) -> Tensor:
    return _rope_qkv_ref(rms_norm_linear_ref(x, norm_weight, eps, weight), positions, cos_sin_cache, key_cache,
                         value_cache, slot_mapping, num_heads)


def fused_add_rms_norm_qkv_rope_cache_ref(x, residual, norm_weight, eps, weight, positions, cos_sin_cache, key_cache,
                                          value_cache, slot_mapping, num_heads) -> tuple[Tensor, Tensor]:
    qkv, residual = fused_add_rms_norm_linear_ref(x, residual, norm_weight, eps, weight)
    return _rope_qkv_ref(qkv, positions, cos_sin_cache, key_cache, value_cache, slot_mapping, num_heads), residual


torch.library.register_kernel("compilelm::qkv_rope_cache", "cpu", qkv_rope_cache_ref)
torch.library.register_kernel("compilelm::rms_norm_qkv_rope_cache", "cpu", rms_norm_qkv_rope_cache_ref)
torch.library.register_kernel("compilelm::fused_add_rms_norm_qkv_rope_cache", "cpu",
                              fused_add_rms_norm_qkv_rope_cache_ref)


def _rope_query_fake(x, weight, key_cache, num_heads):
    head_size = key_cache.shape[3]
    torch._check(weight.shape[0] == (num_heads + 2 * key_cache.shape[2]) * head_size,
                 lambda: f"the QKV weight must be [(num_heads + 2 * num_kv_heads) * head_size, K], got "
                         f"{tuple(weight.shape)} with num_heads {num_heads} and a cache {tuple(key_cache.shape)}")
    return x.new_empty((x.shape[0], num_heads, head_size))


@torch.library.register_fake("compilelm::qkv_rope_cache")
def _(x, weight, positions, cos_sin_cache, key_cache, value_cache, slot_mapping, num_heads):
    return _rope_query_fake(x, weight, key_cache, num_heads)


@torch.library.register_fake("compilelm::rms_norm_qkv_rope_cache")
def _(x, norm_weight, eps, weight, positions, cos_sin_cache, key_cache, value_cache, slot_mapping, num_heads):
    return _rope_query_fake(x, weight, key_cache, num_heads)


@torch.library.register_fake("compilelm::fused_add_rms_norm_qkv_rope_cache")
def _(x, residual, norm_weight, eps, weight, positions, cos_sin_cache, key_cache, value_cache, slot_mapping,
      num_heads):
    return _rope_query_fake(x, weight, key_cache, num_heads), x.new_empty(x.shape)


# -- graph ops: the caches from the forward context ---------------------------------------------

def qkv_rope_fake(x, *args):  # args end with (cos_sin_cache, num_heads)
    return x.new_empty((x.shape[0], args[-1] * args[-2].shape[1]))


def _add_qkv_rope_fake(x, residual, *args):
    return qkv_rope_fake(x, *args), x.new_empty(x.shape)


def next_cache_args(num_heads: int) -> tuple:
    """A graph op's trailing kernel arguments: the next attention layer's key and value caches
    (compilelm/forward_context.py), the step's slot mapping, and the head count."""
    ctx = get_forward_context()
    return (*ctx.next_kv_cache(), ctx.attn_metadata.slot_mapping, num_heads)


def next_cache_is_fp8() -> bool:
    """Whether the next attention layer's KV cache is fp8 (the graph ops then run `rope_into_next_cache`)."""
    fp8 = get_forward_context().next_kv_cache()[0].dtype == FP8_KV_DTYPE
    if fp8 and not _logged_fp8[0]:
        _logged_fp8[0] = True
        logger.info("FP8 KV cache: the QKV projection's fused RoPE + cache-write kernels write model-dtype caches "
                    "only; with fp8 the projection and rope_and_cache (which quantizes) run one after the other")
    return fp8


def rope_into_next_cache(qkv: Tensor, positions: Tensor, cos_sin_cache: Tensor, num_heads: int) -> Tensor:
    """rope_and_cache of a QKV projection's output qkv [M, (num_heads + 2 * kv_heads) * head_size]
    into the next layer's cache, with its scales -> rotated q [M, num_heads * head_size]."""
    ctx = get_forward_context()
    key_cache, value_cache = ctx.next_kv_cache()
    n, kv_heads, head_size = qkv.shape[0], key_cache.shape[2], key_cache.shape[3]
    q, k, v = (t.view(n, -1, head_size) for t in qkv.split(
        [num_heads * head_size, kv_heads * head_size, kv_heads * head_size], dim=-1))
    q = rope_and_cache(positions, q, k, v, cos_sin_cache, None, None, 0.0, key_cache, value_cache,
                       ctx.attn_metadata.slot_mapping, *ctx.next_kv_scales())
    return q.view(n, -1)


@define("qkv_rope(Tensor x, Tensor weight, Tensor positions, Tensor cos_sin_cache, int num_heads) -> Tensor",
         qkv_rope_fake)
def qkv_rope(x: torch.Tensor, weight: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor,
             num_heads: int) -> torch.Tensor:
    # rope_cache of the q | k | v of x @ weight.T -> rotated q [num_tokens, num_heads * head_dim]
    if next_cache_is_fp8():
        return rope_into_next_cache(torch.ops.compilelm.linear(x, weight), positions, cos_sin_cache, num_heads)
    q = qkv_rope_cache(x, weight, positions, cos_sin_cache, *next_cache_args(num_heads))
    return q.view(x.shape[0], -1)


@define("rms_norm_qkv_rope(Tensor x, Tensor norm_weight, float eps, Tensor weight, Tensor positions, "
         "Tensor cos_sin_cache, int num_heads) -> Tensor", qkv_rope_fake)
def rms_norm_qkv_rope(x: torch.Tensor, norm_weight: torch.Tensor, eps: float, weight: torch.Tensor,
                      positions: torch.Tensor, cos_sin_cache: torch.Tensor, num_heads: int) -> torch.Tensor:
    # rope_cache of the q | k | v of rms_norm(x) @ weight.T -> rotated q [num_tokens, num_heads * head_dim]
    if next_cache_is_fp8():
        qkv = torch.ops.compilelm.rms_norm_linear(x, norm_weight, eps, weight)
        return rope_into_next_cache(qkv, positions, cos_sin_cache, num_heads)
    q = rms_norm_qkv_rope_cache(x, norm_weight, eps, weight, positions, cos_sin_cache,
                                    *next_cache_args(num_heads))
    return q.view(x.shape[0], -1)


@define("fused_add_rms_norm_qkv_rope(Tensor x, Tensor residual, Tensor norm_weight, float eps, Tensor weight, "
         "Tensor positions, Tensor cos_sin_cache, int num_heads) -> (Tensor, Tensor)", _add_qkv_rope_fake)
def fused_add_rms_norm_qkv_rope(x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                                weight: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor,
                                num_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    # the same of rms_norm(x + residual) -> (rotated q, x + residual)
    if next_cache_is_fp8():
        qkv, residual = torch.ops.compilelm.fused_add_rms_norm_linear(x, residual, norm_weight, eps, weight)
        return rope_into_next_cache(qkv, positions, cos_sin_cache, num_heads), residual
    q, residual = fused_add_rms_norm_qkv_rope_cache(x, residual, norm_weight, eps, weight, positions,
                                                        cos_sin_cache, *next_cache_args(num_heads))
    return q.view(x.shape[0], -1), residual
