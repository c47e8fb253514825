"""rope_and_cache: RoPE of q and k (after Qwen3's per-head QK-norm, optionally) and the KV-cache
write of the rotated k and v, in one op: the prologue of `unified_attention_rope` /
`unified_attention_qknorm_rope` on CUDA (csrc/cuda/rope_cache_kernels.cu), where it saves the
rotated k's round trip through memory and two launches per layer.

The CPU implementation is the torch composition of the unfused path (rms_norm, apply_rope,
reshape_and_cache), which is also the reference of the GPU tests.

rope_paged_attention: rope_and_cache (no QK-norm) and then paged_attention of the rotated query,
as one op: on CUDA a pure-decode batch runs as ONE kernel (csrc/cuda/paged_attention_decode.cu,
kRope), where the decode kernel rotates the query and the new key itself; elsewhere the two ops.

skinny_mm_rope / rms_norm_skinny_mm_rope / fused_add_rms_norm_skinny_mm_rope: a QKV projection
(compilelm.ops.linear's skinny_mm, or its norm + skinny_mm ops) followed by rope_and_cache of its
q | k | v. On CUDA one kernel at M <= 2 (csrc/cuda/skinny_mm.cu, kRope; the norm variants where
the norm fuses), and at 3-64 rows on sm_90 the norm kernel (if any) then hopper_mm_rope_out
(compilelm/ops/hopper_gemm.py: the Hopper GEMM with RoPE in its epilogue) where it takes the
weight; elsewhere the ops one after another.
"""

import torch
from torch import Tensor

from compilelm.layers.layernorm import rms_norm
from compilelm.layers.rotary_embedding import apply_rope
from compilelm.ops.attention import paged_attention_ref
from compilelm.ops.linear import fused_add_rms_norm_skinny_mm_ref, rms_norm_skinny_mm_ref, skinny_mm_ref


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
) -> Tensor:  # rotated query, [num_tokens, num_heads, head_size] contiguous
    return torch.ops.compilelm.rope_and_cache.default(positions, query, key, value, cos_sin_cache, q_norm_weight,
                                                      k_norm_weight, eps, key_cache, value_cache, slot_mapping)


def rope_and_cache_ref(positions, query, key, value, cos_sin_cache, q_norm_weight, k_norm_weight, eps, key_cache,
                       value_cache, slot_mapping) -> Tensor:
    n, head_size = query.shape[0], query.shape[2]
    if q_norm_weight is not None:
        query, key = rms_norm(query, q_norm_weight, eps), rms_norm(key, k_norm_weight, eps)
    cos, sin = cos_sin_cache[positions].chunk(2, dim=-1)
    q = apply_rope(query.reshape(n, -1), cos, sin, head_size).view(n, -1, head_size)
    k = apply_rope(key.reshape(n, -1), cos, sin, head_size).view(n, -1, head_size)
    torch.ops.compilelm.reshape_and_cache.default(k, value, key_cache, value_cache, slot_mapping)
    return q.contiguous()


@torch.library.register_kernel("compilelm::rope_and_cache", "cpu")
def _(positions, query, key, value, cos_sin_cache, q_norm_weight, k_norm_weight, eps, key_cache, value_cache,
      slot_mapping):
    return rope_and_cache_ref(positions, query, key, value, cos_sin_cache, q_norm_weight, k_norm_weight, eps,
                              key_cache, value_cache, slot_mapping)


@torch.library.register_fake("compilelm::rope_and_cache")
def _(positions, query, key, value, cos_sin_cache, q_norm_weight, k_norm_weight, eps, key_cache, value_cache,
      slot_mapping):
    return query.new_empty(query.shape)


def rope_paged_attention(
    positions: Tensor,  # int64 [num_tokens]
    query: Tensor,  # [num_tokens, num_heads, head_size], not yet rotated
    key: Tensor,  # [num_tokens, num_kv_heads, head_size], not yet rotated
    value: Tensor,  # [num_tokens, num_kv_heads, head_size]
    cos_sin_cache: Tensor,  # [max_position, head_size] = cos | sin of the half-dims
    key_cache: Tensor,  # [num_blocks, block_size, num_kv_heads, head_size], written in place
    value_cache: Tensor,  # written in place
    slot_mapping: Tensor,  # int64 [num_tokens]; -1 skips (and must, on rows past the last sequence)
    cu_seqlens_q: Tensor,  # int32 [num_seqs + 1]
    seq_lens: Tensor,  # int32 [num_seqs]
    block_tables: Tensor,  # int32 [num_seqs, max_blocks_per_seq]
    scale: float,
    max_query_len: int = 0,  # as paged_attention's; 1 (pure decode) allows the one-kernel path
) -> Tensor:  # [num_tokens, num_heads, head_size], paged_attention's output
    return torch.ops.compilelm.rope_paged_attention.default(
        positions, query, key, value, cos_sin_cache, key_cache, value_cache, slot_mapping, cu_seqlens_q, seq_lens,
        block_tables, scale, max_query_len)


def rope_paged_attention_ref(positions, query, key, value, cos_sin_cache, key_cache, value_cache, slot_mapping,
                             cu_seqlens_q, seq_lens, block_tables, scale, max_query_len=0) -> Tensor:
    q = rope_and_cache_ref(positions, query, key, value, cos_sin_cache, None, None, 0.0, key_cache, value_cache,
                           slot_mapping)
    return paged_attention_ref(q, key_cache, value_cache, cu_seqlens_q, seq_lens, block_tables, scale)


@torch.library.register_kernel("compilelm::rope_paged_attention", "cpu")
def _(positions, query, key, value, cos_sin_cache, key_cache, value_cache, slot_mapping, cu_seqlens_q, seq_lens,
      block_tables, scale, max_query_len=0):
    q = rope_and_cache_ref(positions, query, key, value, cos_sin_cache, None, None, 0.0, key_cache, value_cache,
                           slot_mapping)
    return torch.ops.compilelm.paged_attention.default(q, key_cache, value_cache, cu_seqlens_q, seq_lens, block_tables,
                                                       scale, max_query_len)


@torch.library.register_fake("compilelm::rope_paged_attention")
def _(positions, query, key, value, cos_sin_cache, key_cache, value_cache, slot_mapping, cu_seqlens_q, seq_lens,
      block_tables, scale, max_query_len=0):
    return query.new_empty(query.shape)


def skinny_mm_rope(
    x: Tensor,  # [M, K]
    weight: Tensor,  # [(num_heads + 2 * num_kv_heads) * head_size, K]: q | k | v rows
    positions: Tensor,  # int64 [M]
    cos_sin_cache: Tensor,  # [max_position, head_size]
    key_cache: Tensor,  # [num_blocks, block_size, num_kv_heads, head_size], written in place
    value_cache: Tensor,  # written in place
    slot_mapping: Tensor,  # int64 [M]; -1 skips
    num_heads: int,
) -> Tensor:  # rotated query, [M, num_heads, head_size] contiguous
    return torch.ops.compilelm.skinny_mm_rope.default(x, weight, positions, cos_sin_cache, key_cache, value_cache,
                                                      slot_mapping, num_heads)


def rms_norm_skinny_mm_rope(x, norm_weight, eps, weight, positions, cos_sin_cache, key_cache, value_cache,
                            slot_mapping, num_heads) -> Tensor:
    # skinny_mm_rope of rms_norm(x) (norm_weight: [K]) -> rotated query [M, num_heads, head_size]
    return torch.ops.compilelm.rms_norm_skinny_mm_rope.default(x, norm_weight, eps, weight, positions, cos_sin_cache,
                                                               key_cache, value_cache, slot_mapping, num_heads)


def fused_add_rms_norm_skinny_mm_rope(x, residual, norm_weight, eps, weight, positions, cos_sin_cache, key_cache,
                                      value_cache, slot_mapping, num_heads) -> tuple[Tensor, Tensor]:
    # -> (rotated query, x + residual); the projection normalizes x + residual
    return torch.ops.compilelm.fused_add_rms_norm_skinny_mm_rope.default(
        x, residual, norm_weight, eps, weight, positions, cos_sin_cache, key_cache, value_cache, slot_mapping,
        num_heads)


def _rope_qkv_ref(qkv, positions, cos_sin_cache, key_cache, value_cache, slot_mapping, num_heads):
    """rope_and_cache of the q | k | v columns of a QKV projection's output."""
    n, kv_heads, head_size = qkv.shape[0], key_cache.shape[2], key_cache.shape[3]
    q, k, v = (t.view(n, -1, head_size) for t in qkv.split(
        [num_heads * head_size, kv_heads * head_size, kv_heads * head_size], dim=-1))
    return rope_and_cache_ref(positions, q, k, v, cos_sin_cache, None, None, 0.0, key_cache, value_cache, slot_mapping)


def skinny_mm_rope_ref(x, weight, positions, cos_sin_cache, key_cache, value_cache, slot_mapping,
                       num_heads) -> Tensor:
    return _rope_qkv_ref(skinny_mm_ref(x, weight), positions, cos_sin_cache, key_cache, value_cache, slot_mapping,
                         num_heads)


def rms_norm_skinny_mm_rope_ref(x, norm_weight, eps, weight, positions, cos_sin_cache, key_cache, value_cache,
                                slot_mapping, num_heads) -> Tensor:
    return _rope_qkv_ref(rms_norm_skinny_mm_ref(x, norm_weight, eps, weight), positions, cos_sin_cache, key_cache,
                         value_cache, slot_mapping, num_heads)


def fused_add_rms_norm_skinny_mm_rope_ref(x, residual, norm_weight, eps, weight, positions, cos_sin_cache, key_cache,
                                          value_cache, slot_mapping, num_heads) -> tuple[Tensor, Tensor]:
    qkv, residual = fused_add_rms_norm_skinny_mm_ref(x, residual, norm_weight, eps, weight)
    return _rope_qkv_ref(qkv, positions, cos_sin_cache, key_cache, value_cache, slot_mapping, num_heads), residual


torch.library.register_kernel("compilelm::skinny_mm_rope", "cpu", skinny_mm_rope_ref)
torch.library.register_kernel("compilelm::rms_norm_skinny_mm_rope", "cpu", rms_norm_skinny_mm_rope_ref)
torch.library.register_kernel("compilelm::fused_add_rms_norm_skinny_mm_rope", "cpu",
                              fused_add_rms_norm_skinny_mm_rope_ref)


def _rope_query_fake(x, weight, key_cache, num_heads):
    head_size = key_cache.shape[3]
    torch._check(weight.shape[0] == (num_heads + 2 * key_cache.shape[2]) * head_size,
                 lambda: f"the QKV weight must be [(num_heads + 2 * num_kv_heads) * head_size, K], got "
                         f"{tuple(weight.shape)} with num_heads {num_heads} and a cache {tuple(key_cache.shape)}")
    return x.new_empty((x.shape[0], num_heads, head_size))


@torch.library.register_fake("compilelm::skinny_mm_rope")
def _(x, weight, positions, cos_sin_cache, key_cache, value_cache, slot_mapping, num_heads):
    return _rope_query_fake(x, weight, key_cache, num_heads)


@torch.library.register_fake("compilelm::rms_norm_skinny_mm_rope")
def _(x, norm_weight, eps, weight, positions, cos_sin_cache, key_cache, value_cache, slot_mapping, num_heads):
    return _rope_query_fake(x, weight, key_cache, num_heads)


@torch.library.register_fake("compilelm::fused_add_rms_norm_skinny_mm_rope")
def _(x, residual, norm_weight, eps, weight, positions, cos_sin_cache, key_cache, value_cache, slot_mapping,
      num_heads):
    return _rope_query_fake(x, weight, key_cache, num_heads), x.new_empty(x.shape)
