"""csrc ops against their plain-torch references, plus torch.library.opcheck registration checks."""

import itertools

import pytest
import torch

from compilelm.layers.rotary_embedding import RotaryEmbedding
from compilelm.ops import paged_attention, paged_attention_ref, reshape_and_cache, reshape_and_cache_ref

TOLERANCES = {
    torch.float32: dict(atol=1e-5, rtol=1e-5),
    torch.bfloat16: dict(atol=1.5e-2, rtol=1.6e-2),
    torch.float16: dict(atol=2e-3, rtol=2e-3),
}


def make_attention_inputs(
    q_and_seq_lens, *, block_size, num_heads, num_kv_heads, head_size, dtype, num_pad_rows=0, seed=0
):
    """A mixed batch over a randomly permuted paged cache. q_and_seq_lens: [(q_len, seq_len)] per seq.

    The cache is random everywhere, so positions past a sequence's end hold garbage that must be
    masked; unused block-table entries point at the null block 0.
    """
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-seq_len // block_size) for _, seq_len in q_and_seq_lens]
    num_blocks = 1 + sum(blocks_per_seq) + 3  # null block + spare blocks nobody owns
    physical = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    block_tables = torch.zeros(len(q_and_seq_lens), max(blocks_per_seq) + 2, dtype=torch.int32)
    for i, n in enumerate(blocks_per_seq):
        block_tables[i, :n] = torch.tensor(physical[:n], dtype=torch.int32)
        physical = physical[n:]
    cache_shape = (num_blocks, block_size, num_kv_heads, head_size)
    key_cache = torch.randn(cache_shape, generator=gen).to(dtype)
    value_cache = torch.randn(cache_shape, generator=gen).to(dtype)
    q_lens = [q_len for q_len, _ in q_and_seq_lens]
    cu_seqlens_q = torch.tensor([0, *itertools.accumulate(q_lens)], dtype=torch.int32)
    seq_lens = torch.tensor([seq_len for _, seq_len in q_and_seq_lens], dtype=torch.int32)
    query = torch.randn(sum(q_lens) + num_pad_rows, num_heads, head_size, generator=gen).to(dtype)
    return query, key_cache, value_cache, cu_seqlens_q, seq_lens, block_tables, head_size**-0.5


def make_decode_step(contexts, *, num_heads, num_kv_heads, head_size, dtype, num_pad_rows=3, cos_dtype=torch.float32,
                block_size=16, seed=0, num_blocks=None, width=None, max_position=None):
    """One pure-decode step: q/k/v as views of a fused qkv tensor, each sequence's new token at
    position context - 1 with its slot in the sequence's last block, padding rows (slot -1) after
    the sequences, random cache contents elsewhere. The arguments of rope_paged_attention (but
    max_query_len), on the CPU."""
    gen = torch.Generator().manual_seed(seed)
    blocks = [-(-n // block_size) for n in contexts]
    num_blocks = num_blocks or 1 + sum(blocks) + 2
    physical = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    tables = torch.zeros(len(contexts), width or max(blocks) + 1, dtype=torch.int32)
    for i, n in enumerate(blocks):
        tables[i, :n] = torch.tensor(physical[:n], dtype=torch.int32)
        physical = physical[n:]
    rows = len(contexts) + num_pad_rows
    positions = torch.zeros(rows, dtype=torch.int64)
    slots = torch.full((rows,), -1, dtype=torch.int64)
    for i, n in enumerate(contexts):
        positions[i] = n - 1
        slots[i] = int(tables[i, (n - 1) // block_size]) * block_size + (n - 1) % block_size
    d = head_size
    qkv = torch.randn(rows, (num_heads + 2 * num_kv_heads) * d, generator=gen).to(dtype)
    q, k, v = qkv.split([num_heads * d, num_kv_heads * d, num_kv_heads * d], dim=-1)
    cache_shape = (num_blocks, block_size, num_kv_heads, d)
    key_cache = torch.randn(cache_shape, generator=gen).to(dtype)
    value_cache = torch.randn(cache_shape, generator=gen).to(dtype)
    cos_sin = RotaryEmbedding(d, max_position=max_position or max(contexts) + 1, theta=10000.0).cos_sin_cache
    cos_sin = cos_sin.to(cos_dtype)
    cu = torch.arange(len(contexts) + 1, dtype=torch.int32)
    seq_lens = torch.tensor(contexts, dtype=torch.int32)
    args = (positions, q.view(rows, num_heads, d), k.view(rows, num_kv_heads, d), v.view(rows, num_kv_heads, d),
            cos_sin, key_cache, value_cache, slots, cu, seq_lens, tables, d**-0.5)
    return list(args)


def mixed_batch(seed):
    """Shuffled (q_len, seq_len) pairs: decodes, fresh prefills and chunked prefills."""
    gen = torch.Generator().manual_seed(seed)

    def randint(lo, hi):  # inclusive
        return int(torch.randint(lo, hi + 1, (1,), generator=gen))

    seqs = [(1, 1), (1, randint(2, 90)), (1, randint(2, 90))]  # decodes
    seqs += [(n, n) for n in (randint(1, 5), randint(30, 100))]  # fresh prefills
    seqs += [(q, q + randint(1, 60)) for q in (randint(1, 4), randint(10, 80))]  # chunked prefills
    return [seqs[i] for i in torch.randperm(len(seqs), generator=gen)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size", [1, 8, 16])
@pytest.mark.parametrize("head_size", [64, 128])
@pytest.mark.parametrize("group", [1, 3, 4])  # num_heads // num_kv_heads
def test_paged_attention_matches_reference(dtype, block_size, head_size, group):
    num_kv_heads = 2
    inputs = make_attention_inputs(
        mixed_batch(seed=block_size * 7 + group),
        block_size=block_size,
        num_heads=num_kv_heads * group,
        num_kv_heads=num_kv_heads,
        head_size=head_size,
        dtype=dtype,
        num_pad_rows=3,
        seed=head_size + group,
    )
    out = paged_attention(*inputs)
    expected = paged_attention_ref(*inputs)
    assert out.dtype == dtype and out.shape == inputs[0].shape
    torch.testing.assert_close(out, expected, **TOLERANCES[dtype])
    num_rows = int(inputs[3][-1])
    assert torch.count_nonzero(out[num_rows:]) == 0  # padding rows


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_paged_attention_query_sliced_from_qkv(dtype):
    # The attention layer passes q as a view of the fused qkv projection: rows are strided.
    num_heads, num_kv_heads, head_size = 6, 2, 64
    query, *rest = make_attention_inputs(
        [(1, 40), (70, 70), (5, 33)],
        block_size=16,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_size=head_size,
        dtype=dtype,
    )
    qkv = torch.randn(query.shape[0], (num_heads + 2 * num_kv_heads) * head_size).to(dtype)
    qkv[:, : num_heads * head_size] = query.flatten(1)
    strided_query = qkv[:, : num_heads * head_size].view(-1, num_heads, head_size)
    assert not strided_query.is_contiguous()
    out = paged_attention(strided_query, *rest)
    assert out.is_contiguous()
    torch.testing.assert_close(out, paged_attention_ref(query, *rest), **TOLERANCES[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_size", [36, 72, 80])  # scalar tail, one odd vector, two-vector steps
def test_paged_attention_other_head_sizes(dtype, head_size):
    inputs = make_attention_inputs(
        [(1, 37), (9, 9), (4, 20)],
        block_size=8,
        num_heads=4,
        num_kv_heads=2,
        head_size=head_size,
        dtype=dtype,
        num_pad_rows=1,
    )
    torch.testing.assert_close(paged_attention(*inputs), paged_attention_ref(*inputs), **TOLERANCES[dtype])


def test_paged_attention_long_prefill_and_decodes():
    # Several query tiles and key chunks in one sequence, next to decodes (work-queue balance).
    inputs = make_attention_inputs(
        [(300, 300), (1, 257), (1, 3), (120, 400)],
        block_size=16,
        num_heads=8,
        num_kv_heads=8,
        head_size=64,
        dtype=torch.float32,
    )
    torch.testing.assert_close(paged_attention(*inputs), paged_attention_ref(*inputs), atol=1e-5, rtol=1e-5)


def make_cache_inputs(dtype, *, num_tokens=20, num_blocks=6, block_size=8, num_kv_heads=2, head_size=64):
    gen = torch.Generator().manual_seed(0)
    cache_shape = (num_blocks, block_size, num_kv_heads, head_size)
    key_cache = torch.randn(cache_shape, generator=gen).to(dtype)
    value_cache = torch.randn(cache_shape, generator=gen).to(dtype)
    # key/value as views of a fused kv tensor, the way the attention layer produces them
    kv = torch.randn(num_tokens, 2, num_kv_heads, head_size, generator=gen).to(dtype)
    slot_mapping = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slot_mapping[::3] = -1  # padding tokens
    return kv[:, 0], kv[:, 1], key_cache, value_cache, slot_mapping


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_reshape_and_cache_matches_reference(dtype):
    key, value, key_cache, value_cache, slot_mapping = make_cache_inputs(dtype)
    assert not key.is_contiguous()
    expected_k, expected_v = key_cache.clone(), value_cache.clone()
    reshape_and_cache_ref(key, value, expected_k, expected_v, slot_mapping)
    old_k = key_cache.clone()
    reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)
    assert torch.equal(key_cache, expected_k) and torch.equal(value_cache, expected_v)
    # Exactly the slots of real tokens changed; -1 tokens left the cache untouched.
    changed = (key_cache != old_k).flatten(2).any(dim=2).flatten()
    assert set(changed.nonzero().flatten().tolist()) == set(slot_mapping[slot_mapping >= 0].tolist())


def test_opcheck_reshape_and_cache():
    torch.library.opcheck(torch.ops.compilelm.reshape_and_cache.default, make_cache_inputs(torch.float32))


@pytest.mark.parametrize("num_pad_rows", [0, 2])
def test_opcheck_paged_attention(num_pad_rows):
    inputs = make_attention_inputs(
        [(1, 9), (4, 4), (3, 12)],
        block_size=4,
        num_heads=4,
        num_kv_heads=2,
        head_size=64,
        dtype=torch.float32,
        num_pad_rows=num_pad_rows,
    )
    torch.library.opcheck(torch.ops.compilelm.paged_attention.default, inputs)


def test_pure_decode_hint():
    """max_query_len=1 (a pure-decode batch, as a full decode CUDA graph declares) changes no value."""
    inputs = make_attention_inputs([(1, 9), (1, 30), (1, 1)], block_size=4, num_heads=4, num_kv_heads=2,
                                   head_size=64, dtype=torch.float32, num_pad_rows=2)
    torch.testing.assert_close(paged_attention(*inputs, max_query_len=1), paged_attention(*inputs), atol=0, rtol=0)
    torch.library.opcheck(torch.ops.compilelm.paged_attention.default, (*inputs, 1))


def test_bad_inputs_raise():
    key, value, key_cache, value_cache, slot_mapping = make_cache_inputs(torch.float32)
    with pytest.raises(RuntimeError, match="slot_mapping must be int64"):
        reshape_and_cache(key, value, key_cache, value_cache, slot_mapping.int())
    with pytest.raises(RuntimeError, match="outside the cache"):
        reshape_and_cache(key, value, key_cache, value_cache, slot_mapping + key_cache.numel())
    with pytest.raises(RuntimeError, match="must match the cache dtype"):
        reshape_and_cache(key.double(), value.double(), key_cache, value_cache, slot_mapping)

    args = dict(block_size=8, num_kv_heads=2, head_size=64, dtype=torch.float32)
    query, key_cache, value_cache, cu_seqlens_q, seq_lens, block_tables, scale = make_attention_inputs(
        [(1, 9), (4, 4)], num_heads=4, **args
    )
    with pytest.raises(RuntimeError, match="must be a multiple of num_kv_heads"):
        paged_attention(query[:, :3], key_cache, value_cache, cu_seqlens_q, seq_lens, block_tables, scale)
    with pytest.raises(RuntimeError, match="cu_seqlens_q must be int32"):
        paged_attention(query, key_cache, value_cache, cu_seqlens_q.long(), seq_lens, block_tables, scale)
    with pytest.raises(RuntimeError, match="block_tables must be int32"):
        paged_attention(query, key_cache, value_cache, cu_seqlens_q, seq_lens, block_tables.long(), scale)
    with pytest.raises(RuntimeError, match="exceeds seq_len"):
        paged_attention(query, key_cache, value_cache, cu_seqlens_q, seq_lens - 1, block_tables, scale)
    with pytest.raises(RuntimeError, match="must match the query dtype"):
        paged_attention(query.bfloat16(), key_cache, value_cache, cu_seqlens_q, seq_lens, block_tables, scale)
    with pytest.raises(RuntimeError, match="max_query_len must be >= 0"):
        paged_attention(query, key_cache, value_cache, cu_seqlens_q, seq_lens, block_tables, scale, -1)


@pytest.mark.parametrize("setting", ["set_programmatic_launch", "set_cluster_merge", "set_decode_mma",
                                     "set_hopper_gemm"])
def test_launch_settings_return_the_previous_setting(setting):
    """The CUDA launch settings (csrc/cuda/launch.cuh, the decode kernel's merge) are process
    state every build has."""
    toggle = getattr(torch.ops.compilelm, setting)
    previous = toggle(False)
    try:
        assert toggle(True) is False
        assert toggle(True) is True
    finally:
        toggle(previous)


def test_decode_splits_setting_returns_the_previous_and_checks_its_range():
    previous = torch.ops.compilelm.set_decode_splits(3)
    try:
        assert torch.ops.compilelm.set_decode_splits(0) == 3
        for bad in (-1, 65):
            with pytest.raises(RuntimeError, match=r"splits must be in \[0, 64\]"):
                torch.ops.compilelm.set_decode_splits(bad)
        assert torch.ops.compilelm.set_decode_splits(0) == 0  # a refused value leaves it as it was
    finally:
        torch.ops.compilelm.set_decode_splits(previous)


def test_hopper_mm_out_cpu_and_tile_configs():
    """hopper_mm_out's CPU kernel is torch.mm (its Triton kernel runs on sm_90: tests/gpu); every
    tile choice at 3-64 rows covers the rows in one tile, with the weight tile a wgmma A operand
    (BN a multiple of 64; each half of it with the SiLU-and-mul epilogue), and its shared-memory ring
    fits a block's 227 KB."""
    from compilelm.ops.hopper_gemm import tile_config

    x, w = torch.randn(5, 48), torch.randn(7, 48)
    out = torch.empty(5, 7)
    torch.ops.compilelm.hopper_mm_out(x, w, out, True)
    torch.testing.assert_close(out, x @ w.t(), rtol=0, atol=0)
    w2 = torch.randn(14, 48)  # with silu_mul: gate | up rows -> silu(gate) * up
    out = torch.empty(5, 7)
    torch.ops.compilelm.hopper_mm_out(x, w2, out, False, True)
    y = x @ w2.t()
    torch.testing.assert_close(out, torch.nn.functional.silu(y[:, :7]) * y[:, 7:])
    for m, n, silu_mul in itertools.product(range(3, 65), (1024, 4096, 6144, 14336, 28672, 128256), (False, True)):
        bm, bn, bk, stages = tile_config(m, n, silu_mul)
        assert m <= bm <= max(16, 2 * m) and bm in (16, 32, 64), (m, bm)
        assert bn % (128 if silu_mul else 64) == 0 and bk == 128  # (silu_mul: two halves of >= 64)
        assert stages * (bn + bm) * bk * 2 <= 227 * 1024, (m, n, stages, bn, bm)
