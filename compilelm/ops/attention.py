"""paged_attention: causal attention of a mixed batch (decode rows, chunked and fresh prefills)
over the paged KV cache (csrc/cpu/paged_attention.cpp)."""

import torch
from torch import Tensor


def paged_attention(
    query: Tensor,  # [num_tokens, num_heads, head_size]
    key_cache: Tensor,  # [num_blocks, block_size, num_kv_heads, head_size]
    value_cache: Tensor,  # [num_blocks, block_size, num_kv_heads, head_size]
    cu_seqlens_q: Tensor,  # int32 [num_seqs + 1]; query rows of seq i are cu[i]:cu[i+1]
    seq_lens: Tensor,  # int32 [num_seqs]; context length including the new rows
    block_tables: Tensor,  # int32 [num_seqs, max_blocks_per_seq]
    scale: float,
    max_query_len: int = 0,  # longest query range if known, else 0; 1 = pure decode (skips prefill work)
) -> Tensor:  # [num_tokens, num_heads, head_size]; rows past cu[num_seqs] are zero
    return torch.ops.compilelm.paged_attention.default(
        query, key_cache, value_cache, cu_seqlens_q, seq_lens, block_tables, scale, max_query_len
    )


@torch.library.register_fake("compilelm::paged_attention")
def _paged_attention_fake(query, key_cache, value_cache, cu_seqlens_q, seq_lens, block_tables, scale,
                          max_query_len=0):
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
) -> Tensor:
    """Plain-torch reference: gathers each sequence's context and runs a masked softmax in fp32."""
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
        q = query[start:end].float()  # [q_len, num_heads, head_size]
        scores = torch.einsum("qhd,khd->hqk", q, k.float()) * scale  # [num_heads, q_len, seq_len]
        q_pos = torch.arange(seq_len - q_len, seq_len, device=query.device)
        k_pos = torch.arange(seq_len, device=query.device)
        scores.masked_fill_(k_pos[None, :] > q_pos[:, None], float("-inf"))
        out[start:end] = torch.einsum("hqk,khd->qhd", scores.softmax(dim=-1), v.float()).to(query.dtype)
    return out
