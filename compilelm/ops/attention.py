"""Paged attention and the KV-cache write (schemas in csrc/ops.cpp; kernels in csrc/cpu and csrc/cuda).

- paged_attention: causal attention of a mixed batch (decode rows, chunked and fresh prefills)
  over the paged KV cache.
- reshape_and_cache: writes this step's keys/values into their cache slots.
- rope_paged_attention: rope_and_cache (no QK-norm) and then paged_attention of the rotated query,
  as one op: on CUDA a pure-decode batch runs as ONE kernel (csrc/cuda/paged_attention_decode.cu,
  kRope), where the decode kernel rotates the query and the new key itself; elsewhere the two ops.

FP8 KV caches (float8_e4m3fn, csrc/ops.cpp): every op takes the layer's k_scale / v_scale; writers
store `quantize_kv(x, scale)`, readers see `dequantize_kv(cache, scale)` (the references below
spell both out).
"""

from __future__ import annotations

import torch
from torch import Tensor

from compilelm.ops.rope import dequantize_kv, quantize_kv, rope_and_cache_ref  # noqa: F401  (re-exported)


def paged_attention(
    query: Tensor,  # [num_tokens, num_heads, head_size]
    key_cache: Tensor,  # [num_blocks, block_size, num_kv_heads, head_size]
    value_cache: Tensor,  # [num_blocks, block_size, num_kv_heads, head_size]
    cu_seqlens_q: Tensor,  # int32 [num_seqs + 1]; query rows of seq i are cu[i]:cu[i+1]
    seq_lens: Tensor,  # int32 [num_seqs]; context length including the new rows
    block_tables: Tensor,  # int32 [num_seqs, max_blocks_per_seq]
    scale: float,
    max_query_len: int = 0,  # longest query range if known, else 0; 1 = pure decode (skips prefill work)
    prefill_rows: bool = True,  # False (CUDA): rows of q_len > 1 sequences left for prefill_attention
    k_scale: float = 1.0,  # fp8 caches: keys are key_cache * k_scale
    v_scale: float = 1.0,  # fp8 caches: values are value_cache * v_scale
) -> Tensor:  # [num_tokens, num_heads, head_size]; rows past cu[num_seqs] are zero
    return torch.ops.compilelm.paged_attention.default(
        query, key_cache, value_cache, cu_seqlens_q, seq_lens, block_tables, scale, max_query_len, prefill_rows,
        k_scale, v_scale
    )


@torch.library.register_fake("compilelm::paged_attention")
def _paged_attention_fake(query, key_cache, value_cache, cu_seqlens_q, seq_lens, block_tables, scale,
                          max_query_len=0, prefill_rows=True, k_scale=1.0, v_scale=1.0):
    # The kernels return a fresh contiguous tensor shaped like the query (new_empty, unlike
    # empty_like, does not copy the strides of a query sliced out of a fused qkv tensor).
    return query.new_empty(query.shape)


def paged_attention_ref(
    query: Tensor,
    key_cache: Tensor,
    value_cache: Tensor,
    cu_seqlens_q: Tensor,
    seq_lens: Tensor,
    block_tables: Tensor,
    scale: float,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> Tensor:
    """Plain-torch reference: gathers each sequence's context and runs a masked softmax in fp32
    (an fp8 cache dequantized: fp8 * scale)."""
    num_heads = query.shape[1]
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    out = torch.zeros(query.shape, dtype=query.dtype, device=query.device)
    cu, lens = cu_seqlens_q.tolist(), seq_lens.tolist()
    for i, seq_len in enumerate(lens):
        start, end = cu[i], cu[i + 1]
        q_len = end - start
        if q_len == 0:
            continue
        blocks = block_tables[i, : (seq_len + block_size - 1) // block_size].long()
        # [seq_len, num_heads, head_size]: the context, each kv head repeated for its query heads
        k = key_cache[blocks].flatten(0, 1)[:seq_len].repeat_interleave(num_heads // num_kv_heads, dim=1)
        v = value_cache[blocks].flatten(0, 1)[:seq_len].repeat_interleave(num_heads // num_kv_heads, dim=1)
        k, v = dequantize_kv(k, k_scale), dequantize_kv(v, v_scale)  # fp32
        q = query[start:end].float()  # [q_len, num_heads, head_size]
        scores = torch.einsum("qhd,khd->hqk", q, k) * scale  # [num_heads, q_len, seq_len]
        q_pos = torch.arange(seq_len - q_len, seq_len, device=query.device)
        k_pos = torch.arange(seq_len, device=query.device)
        scores.masked_fill_(k_pos[None, :] > q_pos[:, None], float("-inf"))
        out[start:end] = torch.einsum("hqk,khd->qhd", scores.softmax(dim=-1), v).to(query.dtype)
    return out


def reshape_and_cache(
    key: Tensor,  # [num_tokens, num_kv_heads, head_size]
    value: Tensor,  # [num_tokens, num_kv_heads, head_size]
    key_cache: Tensor,  # [num_blocks, block_size, num_kv_heads, head_size], written in place
    value_cache: Tensor,  # [num_blocks, block_size, num_kv_heads, head_size], written in place
    slot_mapping: Tensor,  # int64 [num_tokens]; slot s -> block s // block_size, offset s % block_size; -1 skips
    k_scale: float = 1.0,  # fp8 caches: key_cache = fp8(key / k_scale)
    v_scale: float = 1.0,
) -> None:
    torch.ops.compilelm.reshape_and_cache.default(key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale)


@torch.library.register_fake("compilelm::reshape_and_cache")
def _reshape_and_cache_fake(key, value, key_cache, value_cache, slot_mapping, k_scale=1.0, v_scale=1.0) -> None:
    # Only mutates its caches (declared as Tensor(a!) / Tensor(b!) in the schema); no outputs.
    return None


def reshape_and_cache_ref(
    key: Tensor, value: Tensor, key_cache: Tensor, value_cache: Tensor, slot_mapping: Tensor,
    k_scale: float = 1.0, v_scale: float = 1.0,
) -> None:
    """Plain-torch reference: the same in-place scatter through a flat view of each cache (fp8
    caches: the rows quantized, `quantize_kv`)."""
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    # view (not reshape) so that a cache that cannot be flattened in place raises instead of copying
    key_cache.view(-1, *key_cache.shape[2:])[slots] = quantize_kv(key[keep], key_cache.dtype, k_scale)
    value_cache.view(-1, *value_cache.shape[2:])[slots] = quantize_kv(value[keep], value_cache.dtype, v_scale)


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
    k_scale: float = 1.0,  # fp8 caches (csrc/ops.cpp)
    v_scale: float = 1.0,
) -> Tensor:  # [num_tokens, num_heads, head_size], paged_attention's output
    return torch.ops.compilelm.rope_paged_attention.default(
        positions, query, key, value, cos_sin_cache, key_cache, value_cache, slot_mapping, cu_seqlens_q, seq_lens,
        block_tables, scale, max_query_len, k_scale, v_scale)


def rope_paged_attention_ref(positions, query, key, value, cos_sin_cache, key_cache, value_cache, slot_mapping,
                             cu_seqlens_q, seq_lens, block_tables, scale, max_query_len=0, k_scale=1.0,
                             v_scale=1.0) -> Tensor:
    q = rope_and_cache_ref(positions, query, key, value, cos_sin_cache, None, None, 0.0, key_cache, value_cache,
                           slot_mapping, k_scale, v_scale)
    return paged_attention_ref(q, key_cache, value_cache, cu_seqlens_q, seq_lens, block_tables, scale, k_scale,
                               v_scale)


@torch.library.register_kernel("compilelm::rope_paged_attention", "cpu")
def _(positions, query, key, value, cos_sin_cache, key_cache, value_cache, slot_mapping, cu_seqlens_q, seq_lens,
      block_tables, scale, max_query_len=0, k_scale=1.0, v_scale=1.0):
    q = rope_and_cache_ref(positions, query, key, value, cos_sin_cache, None, None, 0.0, key_cache, value_cache,
                           slot_mapping, k_scale, v_scale)
    return torch.ops.compilelm.paged_attention.default(q, key_cache, value_cache, cu_seqlens_q, seq_lens, block_tables,
                                                       scale, max_query_len, True, k_scale, v_scale)


@torch.library.register_fake("compilelm::rope_paged_attention")
def _(positions, query, key, value, cos_sin_cache, key_cache, value_cache, slot_mapping, cu_seqlens_q, seq_lens,
      block_tables, scale, max_query_len=0, k_scale=1.0, v_scale=1.0):
    return query.new_empty(query.shape)
