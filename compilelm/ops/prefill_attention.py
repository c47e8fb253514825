"""Prefill attention on the GPU in Triton: the query rows of sequences with q_len > 1 (fresh and
chunked prefills) attend causally over their paged KV cache, the step's own keys already in it.

Same contract as the prefill half of `compilelm::paged_attention` (csrc/cuda/paged_attention.cpp):
rows of decode sequences (q_len == 1) and padding rows are not touched; the caller fills them
(`paged_attention_decode_rows`). Triton lowers the two `tl.dot`s to wgmma on Hopper, which the
hand-written mma.sync kernel of csrc/cuda/paged_attention_prefill.cu cannot use.

A program = (query tile, kv head). Its BLOCK_M query vectors are ROWS rows times the group's
GROUP heads (GQA packing: every key/value tile loaded serves the whole group). Tiles are numbered
without reading the batch on the host, as the CUDA kernel numbers them: sequence i owns tiles
[cu[i] // ROWS + i, cu[i + 1] // ROWS + i + 1), so the grid is num_tokens // ROWS + num_seqs + 1
programs (fixed by the shapes: CUDA-graph safe) and each finds its sequence by binary search.
Programs run last tile first: the tiles with the most keys start earliest.

FP8 KV caches (float8_e4m3fn): K and V tiles are loaded as fp8 and converted to the query's dtype
in registers (exact: e4m3 values are bf16 / fp16 values) for the two `tl.dot`s; k_scale multiplies
the softmax scale, v_scale the normalized output.
"""

from __future__ import annotations

import math

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the CUDA kernels and plain-torch paths serve
    triton = None


# (head_dim) -> BLOCK_M query vectors, BLOCK_N keys per tile, warps, pipeline stages (H100 / H200)
CONFIGS = {64: (64, 64, 4, 3), 128: (64, 64, 4, 3)}  # the best of 16 on an H200 (bench_prefill_attention --sweep)
# steps whose longest row has >= LONG_KEYS keys: larger tiles, faster there and slower on short rows
# (docs/perf.md, "Side by side at c593dc0")
LONG_CONFIGS = {128: (128, 128, 8, 2)}
LONG_KEYS = 4096
_enabled = [True]


def config_for(head_dim: int, max_seq_len: int, fp8: bool = False) -> tuple[int, int, int, int]:
    """The tile configuration for a step whose longest sequence has `max_seq_len` keys (0: unknown);
    fp8 caches keep CONFIGS (the long tiles are not measured on them)."""
    if max_seq_len >= LONG_KEYS and head_dim in LONG_CONFIGS and not fp8:
        return LONG_CONFIGS[head_dim]
    return CONFIGS[head_dim]


def set_enabled(enabled: bool) -> bool:
    """Turns the Triton prefill path on or off (off: paged_attention's CUDA kernel serves every
    row); returns the previous setting. For A/B measurements."""
    previous, _enabled[0] = _enabled[0], bool(enabled)
    return previous


_fp8_loads: dict[int, bool] = {}  # device index -> Triton loads float8_e4m3fn there (sm_89+)


def _loads_fp8(device: torch.device) -> bool:
    if device.index not in _fp8_loads:
        _fp8_loads[device.index] = torch.cuda.get_device_capability(device) >= (8, 9)
    return _fp8_loads[device.index]


def supported(query: torch.Tensor, key_cache: torch.Tensor) -> bool:
    """Whether `prefill_attention` covers this call (bf16/fp16 on CUDA, the cache of the query's
    dtype or float8_e4m3fn (sm_89+: Triton has no e4m3 type below), head size 64 or 128, a GQA
    group that divides BLOCK_M)."""
    head_dim, group = query.shape[2], query.shape[1] // key_cache.shape[2]
    return (triton is not None and query.is_cuda and query.dtype in (torch.bfloat16, torch.float16)
            and (key_cache.dtype == query.dtype
                 or (key_cache.dtype == torch.float8_e4m3fn and _loads_fp8(query.device)))
            and head_dim in CONFIGS and CONFIGS[head_dim][0] % group == 0 and query.stride(2) == 1
            and key_cache.stride(3) == 1)


def serves(query: torch.Tensor, key_cache: torch.Tensor, max_query_len: int) -> bool:
    """Whether a step's prefill rows go to `prefill_attention`: turned on, supported, and the step
    may have prefill rows (max_query_len 0 = unknown, or > 1)."""
    return _enabled[0] and max_query_len != 1 and supported(query, key_cache)


def warm_up(key_cache: torch.Tensor, value_cache: torch.Tensor, num_heads: int,
            dtype: torch.dtype | None = None) -> None:
    """Compiles the kernel for this cache now (Triton compiles at first launch: seconds, which
    would otherwise land in the first prefill a client sends). Reads the cache, writes nothing.
    dtype: the model's (the query's), where the cache is fp8."""
    query = torch.zeros(4, num_heads, key_cache.shape[3], dtype=dtype or key_cache.dtype, device=key_cache.device)
    if not supported(query, key_cache):
        return
    device = key_cache.device
    cu = torch.tensor([0, 3, 4], dtype=torch.int32, device=device)
    seq_lens = torch.tensor([3, 1], dtype=torch.int32, device=device)
    tables = torch.zeros(2, 1, dtype=torch.int32, device=device)
    for max_seq_len in {0, LONG_KEYS}:  # each configuration the steps may pick
        prefill_attention(torch.empty_like(query), query, key_cache, value_cache, cu, seq_lens, tables, 1.0,
                          max_seq_len=max_seq_len)


def prefill_attention(
    out: torch.Tensor,  # [num_tokens, num_heads, head_dim]; prefill rows written here
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    cu_seqlens_q: torch.Tensor,  # int32 [num_seqs + 1]
    seq_lens: torch.Tensor,  # int32 [num_seqs]; context including this step's rows
    block_tables: torch.Tensor,  # int32 [num_seqs, max_blocks_per_seq]
    scale: float,
    kernel=None,  # the Triton kernel to launch (tests pass the interpreter's)
    config: tuple[int, int, int, int] | None = None,
    k_scale: float = 1.0,  # fp8 caches: keys = key_cache * k_scale
    v_scale: float = 1.0,  # fp8 caches: values = value_cache * v_scale
    max_seq_len: int = 0,  # the longest sequence's keys (picks the tiles; 0: unknown)
) -> None:
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads, num_seqs = key_cache.shape[2], seq_lens.shape[0]
    if num_tokens == 0 or num_seqs == 0:
        return
    group = num_heads // num_kv_heads
    fp8 = key_cache.dtype == torch.float8_e4m3fn
    block_m, block_n, warps, stages = config or config_for(head_dim, max_seq_len, fp8)
    rows = block_m // group
    tiles = num_tokens // rows + num_seqs + 1
    (kernel or _prefill_attention_kernel)[(tiles, num_kv_heads)](
        query, key_cache, value_cache, out, cu_seqlens_q, seq_lens, block_tables,
        scale * math.log2(math.e) * (k_scale if fp8 else 1.0), v_scale if fp8 else 1.0, num_seqs, tiles,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2), block_tables.stride(0),
        GROUP=group, ROWS=rows, BLOCK_M=block_m, BLOCK_N=block_n, PAGE=key_cache.shape[1], HEAD_DIM=head_dim,
        num_warps=warps, num_stages=stages,
    )


if triton is not None:

    @triton.jit
    def _attend_tile(acc, l_i, m_i, q, q_pos, start, num_keys, K, V, table, offs_n, offs_d, kv_head,
                     stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, qk_scale,
                     PAGE: tl.constexpr, MASK: tl.constexpr):
        # one tile of BLOCK_N keys from `start`: online softmax in base 2 (qk_scale = scale * log2 e).
        # MASK: the tile crosses the causal diagonal or the end of the keys; keys past num_keys are
        # neither looked up in the table (its row may end there) nor read (zeros, weight 0)
        key = start + offs_n
        in_range = key < num_keys
        if MASK:
            block = tl.load(table + key // PAGE, mask=in_range, other=0)
        else:
            block = tl.load(table + key // PAGE)
        # 64-bit offsets: a layer's cache may pass 2^31 elements (an fp8 cache holds twice the blocks)
        block = block.to(tl.int64)
        slot = key % PAGE
        k_ptrs = K + block[:, None] * stride_kb + slot[:, None] * stride_ks + kv_head * stride_kh + offs_d[None, :]
        v_ptrs = V + block[:, None] * stride_vb + slot[:, None] * stride_vs + kv_head * stride_vh + offs_d[None, :]
        if MASK:
            k = tl.load(k_ptrs, mask=in_range[:, None], other=0.0)
        else:
            k = tl.load(k_ptrs)
        k = k.to(q.dtype)  # fp8 caches: exact (k_scale is in qk_scale); else nothing to do
        s = tl.dot(q, tl.trans(k))  # [BLOCK_M, BLOCK_N] fp32, unscaled
        if MASK:
            s = tl.where(key[None, :] <= q_pos[:, None], s * qk_scale, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            p = tl.math.exp2(s - m_new[:, None])
        else:  # the scale inside exp2's argument: one FMA an element
            m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
            p = tl.math.exp2(s * qk_scale - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        if MASK:
            v = tl.load(v_ptrs, mask=in_range[:, None], other=0.0)
        else:
            v = tl.load(v_ptrs)
        v = v.to(q.dtype)  # fp8 caches: exact (v_scale multiplies the output)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
        return acc, l_i, m_new

    # The batch's metadata are views into one packed buffer (graphs/step_inputs.py) whose offsets
    # and table width change with the batch: specializing on their alignment would compile the
    # kernel again for new batch shapes, seconds each, in the middle of serving.
    @triton.jit(do_not_specialize=["CU", "SEQ_LENS", "TABLES", "num_seqs", "num_tiles", "stride_tb"],
                do_not_specialize_on_alignment=["CU", "SEQ_LENS", "TABLES"])
    def _prefill_attention_kernel(
        Q, K, V, OUT, CU, SEQ_LENS, TABLES, qk_scale, v_scale, num_seqs, num_tiles,
        stride_qt, stride_qh, stride_ot, stride_oh,
        stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_tb,
        GROUP: tl.constexpr, ROWS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        PAGE: tl.constexpr, HEAD_DIM: tl.constexpr,
    ):
        tile = num_tiles - 1 - tl.program_id(0)
        kv_head = tl.program_id(1)
        lo: tl.int32 = 0  # the first sequence whose first tile is past `tile`, minus one
        hi = num_seqs
        while lo < hi:
            mid = (lo + hi) // 2
            if tl.load(CU + mid) // ROWS + mid > tile:
                hi = mid
            else:
                lo = mid + 1
        seq = lo - 1
        q_start = tl.load(CU + seq)
        q_len = tl.load(CU + seq + 1) - q_start
        row0 = (tile - (q_start // ROWS + seq)) * ROWS  # first query row of the tile in its sequence
        if q_len <= 1 or row0 >= q_len:  # decode rows, unused tiles, padding
            return
        context = tl.load(SEQ_LENS + seq) - q_len  # cached positions before row 0

        offs_m = tl.arange(0, BLOCK_M)
        offs_n = tl.arange(0, BLOCK_N)
        offs_d = tl.arange(0, HEAD_DIM)
        row = row0 + offs_m // GROUP
        head = kv_head * GROUP + offs_m % GROUP
        valid = row < q_len
        q = tl.load(Q + (q_start + row)[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
                    mask=valid[:, None], other=0.0)
        q_pos = context + row

        acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        table = TABLES + seq * stride_tb
        # keys every row of the tile sees (row0's causal range), whole tiles of them without a mask
        unmasked = (context + row0 + 1) // BLOCK_N * BLOCK_N
        num_keys = context + tl.minimum(row0 + ROWS, q_len)
        for start in range(0, unmasked, BLOCK_N):
            acc, l_i, m_i = _attend_tile(acc, l_i, m_i, q, q_pos, start, num_keys, K, V, table, offs_n, offs_d, kv_head,
                                         stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, qk_scale,
                                         PAGE, False)
        for start in range(unmasked, num_keys, BLOCK_N):
            acc, l_i, m_i = _attend_tile(acc, l_i, m_i, q, q_pos, start, num_keys, K, V, table, offs_n, offs_d, kv_head,
                                         stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, qk_scale,
                                         PAGE, True)
        out = acc / l_i[:, None] * v_scale
        tl.store(OUT + (q_start + row)[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
                 out.to(OUT.dtype.element_ty), mask=valid[:, None])
