"""CUDA kernels of csrc/cuda against the plain-torch references and the CPU kernels, opcheck,
and CUDA-graph capture/replay (the engine replays these ops with new values in the same buffers)."""

import pytest
import torch

from compilelm.ops import paged_attention, paged_attention_ref, reshape_and_cache, reshape_and_cache_ref
from tests.test_ops import make_attention_inputs, make_cache_inputs, mixed_batch

pytestmark = pytest.mark.gpu

# Elementwise tolerances and the bound on ||out - ref|| / ||ref||. The prefill kernel rounds the
# softmax weights to the operand type before P @ V (as flash attention does): a little more
# than the output rounding alone for bf16/fp16. fp32 runs on CUDA cores in fp32.
TOLERANCES = {
    torch.float32: (dict(atol=1e-5, rtol=1e-5), 1e-5),
    torch.bfloat16: (dict(atol=2e-2, rtol=2e-2), 1e-2),
    torch.float16: (dict(atol=3e-3, rtol=3e-3), 2e-3),
}


def cuda(inputs):
    return tuple(t.cuda() if isinstance(t, torch.Tensor) else t for t in inputs)


def poison_allocator(shape, dtype):
    """Frees a NaN-filled block of this size, which the caching allocator hands to the next
    allocation of that size (the kernel's output): rows the kernel forgets to write stay NaN."""
    torch.full(shape, float("nan"), dtype=dtype, device="cuda")


@pytest.fixture(params=["cluster", "arrivals"])
def decode_merge(request):
    """Pure-decode split-K merged in a thread block cluster, or by the split that arrives last
    (torch.ops.compilelm.set_cluster_merge: the path for GPUs before sm_90)."""
    previous = torch.ops.compilelm.set_cluster_merge(request.param == "cluster")
    yield request.param
    torch.ops.compilelm.set_cluster_merge(previous)


def assert_close(out, expected):
    elementwise, relative = TOLERANCES[out.dtype]
    torch.testing.assert_close(out, expected, **elementwise)
    error = (out.float() - expected.float()).norm() / expected.float().norm().clamp_min(1e-30)
    assert error < relative, f"||out - ref|| / ||ref|| = {error:.2e}"


def head_major(cache):
    """The same values in a [num_blocks, num_kv_heads, block_size, head_size] buffer, seen as
    [num_blocks, block_size, num_kv_heads, head_size] (a strided view)."""
    return cache.transpose(1, 2).contiguous().transpose(1, 2)


def check_attention(inputs_cpu, max_query_len=0, cache_layout=lambda cache: cache):
    """CUDA kernel vs the plain-torch reference and vs the CPU kernel; padding rows are zero.
    `cache_layout` re-lays the CUDA caches (the CPU kernel takes contiguous ones)."""
    inputs = list(cuda(inputs_cpu))
    inputs[1], inputs[2] = cache_layout(inputs[1]), cache_layout(inputs[2])
    poison_allocator(inputs[0].shape, inputs[0].dtype)
    out = paged_attention(*inputs, max_query_len=max_query_len)
    torch.cuda.synchronize()
    assert out.dtype == inputs[0].dtype and out.shape == inputs[0].shape and out.is_contiguous()
    assert_close(out, paged_attention_ref(*inputs))
    assert_close(out.cpu(), paged_attention(*inputs_cpu))
    num_rows = int(inputs_cpu[3][-1])
    assert torch.count_nonzero(out[num_rows:]) == 0  # padding rows
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize("head_size", [64, 128])
@pytest.mark.parametrize("group", [1, 4, 8])  # num_heads // num_kv_heads
def test_mixed_batch(dtype, block_size, head_size, group, decode_kernel):
    # decodes, fresh prefills and chunked prefills continuing a context, in one call
    check_attention(make_attention_inputs(
        mixed_batch(seed=block_size + group), block_size=block_size, num_heads=2 * group, num_kv_heads=2,
        head_size=head_size, dtype=dtype, num_pad_rows=5, seed=head_size + group,
    ))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("group", [4, 8])
def test_long_context_split_k(dtype, group, decode_kernel):
    # Llama-3-8B-like heads, 8k contexts: few programs per SM, so the decode rows run split-K;
    # next to them a chunk of a long prefill and a fresh prefill of several query tiles.
    batch = [(1, 8192), (1, 5000), (1, 1), (64, 8192), (300, 300)]
    check_attention(make_attention_inputs(
        batch, block_size=16, num_heads=8 * group, num_kv_heads=8, head_size=128, dtype=dtype, num_pad_rows=3,
    ))


@pytest.mark.parametrize("splits", [1, 3, 64])
@pytest.mark.parametrize("max_query_len", [0, 1])
def test_forced_decode_splits(splits, max_query_len, decode_kernel):
    # torch.ops.compilelm.set_decode_splits (the benchmarks' sweep): any count, one split or
    # more than a short row's keys allow, gives the reference's output.
    batch = [(1, n) for n in (4000, 300, 1, 17, 2500)]
    inputs = make_attention_inputs(batch, block_size=16, num_heads=16, num_kv_heads=8, head_size=128,
                                   dtype=torch.bfloat16, num_pad_rows=2)
    previous = torch.ops.compilelm.set_decode_splits(splits)
    try:
        check_attention(inputs, max_query_len)
    finally:
        torch.ops.compilelm.set_decode_splits(previous)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_single_long_decode(dtype):
    # batch 1: the most splits (up to 64); each split's chunk spans many pages
    check_attention(make_attention_inputs(
        [(1, 16000)], block_size=32, num_heads=32, num_kv_heads=8, head_size=128, dtype=dtype,
    ))


@pytest.mark.parametrize("max_query_len", [0, 1])
def test_short_sequences_in_wide_block_tables(max_query_len, decode_merge, decode_kernel):
    # Splits are sized from block_tables.size(1) (the host never reads seq_lens): 8k-wide tables
    # and contexts of a few tokens leave most splits empty, which must contribute nothing.
    batch = [(1, 3), (1, 17), (1, 1), (2, 9)] if max_query_len == 0 else [(1, 3), (1, 17), (1, 1), (1, 130)]
    query, key_cache, value_cache, cu, seq_lens, block_tables, scale = make_attention_inputs(
        batch, block_size=16, num_heads=8, num_kv_heads=2, head_size=128, dtype=torch.bfloat16, num_pad_rows=2,
    )
    wide = torch.zeros(block_tables.shape[0], 512, dtype=torch.int32)
    wide[:, : block_tables.shape[1]] = block_tables
    check_attention((query, key_cache, value_cache, cu, seq_lens, wide, scale), max_query_len)


@pytest.mark.parametrize("batch", [[(1, n) for n in (700, 33, 1, 2048, 64)] * 13, [(200, 200), (77, 500)]])
def test_pure_decode_and_pure_prefill_batches(batch):
    check_attention(make_attention_inputs(
        batch, block_size=16, num_heads=16, num_kv_heads=4, head_size=128, dtype=torch.bfloat16, num_pad_rows=7,
    ))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("head_size,group", [(64, 3), (128, 4), (128, 8), (256, 2)])
# (300, 1, 1024, 77): few programs, short splits: the cluster merge's launches (the others split
# over global memory, or not at all)
@pytest.mark.parametrize("contexts", [(700, 33, 1, 2048, 64) * 3, (16000,), (1, 2), (300, 1, 1024, 77)])
def test_declared_pure_decode(dtype, head_size, group, contexts, decode_merge, decode_kernel):
    # max_query_len=1 (a full decode graph): the decode kernel alone over every row, split-K merged
    # in the kernel (in a cluster, or by the split that finishes last), padding rows (past the last
    # sequence) zeroed, as without the hint; run twice: the arrival counters must be back at zero
    # after each launch
    inputs = make_attention_inputs(
        [(1, n) for n in contexts], block_size=16, num_heads=2 * group, num_kv_heads=2, head_size=head_size,
        dtype=dtype, num_pad_rows=5,
    )
    first = check_attention(inputs, max_query_len=1)
    assert torch.equal(check_attention(inputs, max_query_len=1), first)


@pytest.mark.parametrize("max_query_len", [0, 1])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_head_major_cache_view(max_query_len, dtype, decode_kernel):
    # caches laid out [num_blocks, num_kv_heads, block_size, head_size] and passed as the permuted
    # view: both kernels address the cache by its strides
    batch = [(1, 700), (1, 3), (1, 2048)] if max_query_len == 1 else mixed_batch(seed=9) + [(1, 1500)]
    inputs = make_attention_inputs(batch, block_size=16, num_heads=16, num_kv_heads=4, head_size=128,
                                   dtype=dtype, num_pad_rows=3)
    contiguous = check_attention(inputs, max_query_len)
    assert torch.equal(check_attention(inputs, max_query_len, cache_layout=head_major), contiguous)


@pytest.mark.parametrize("rows,context", [(6, 4000), (2, 1000)])  # split over global memory; in clusters
def test_decode_graph_replays_merge_in_kernel(rows, context, decode_merge, decode_kernel):
    # A captured pure-decode call replayed with new contexts: each replay merges its splits in the
    # kernel (the last splits to arrive reset their arrival counters: a counter left non-zero
    # would skip or repeat a merge)
    query, key_cache, value_cache, cu, seq_lens, tables, scale = cuda(make_attention_inputs(
        [(1, context)] * rows, block_size=16, num_heads=32, num_kv_heads=8, head_size=128, dtype=torch.bfloat16,
    ))
    paged_attention(query, key_cache, value_cache, cu, seq_lens, tables, scale, max_query_len=1)  # warm-up
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = paged_attention(query, key_cache, value_cache, cu, seq_lens, tables, scale, max_query_len=1)
    gen = torch.Generator().manual_seed(1)
    for _ in range(4):
        seq_lens.copy_(torch.randint(1, context + 1, (rows,), generator=gen, dtype=torch.int32))
        query.copy_(torch.randn(query.shape, generator=gen).to(query.dtype))
        graph.replay()
        torch.cuda.synchronize()
        assert_close(out, paged_attention_ref(query, key_cache, value_cache, cu, seq_lens, tables, scale))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("group", [12, 16, 20])
@pytest.mark.parametrize("max_query_len", [0, 1])
def test_wide_groups_on_tensor_cores(dtype, group, max_query_len, decode_kernel):
    # Groups of 12 and 16 heads fill the tensor-core kernel's 16 rows (12: four masked); 20 is
    # past it (CUDA cores, in chunks of 8 heads); 64 decode rows of 1-2k keys fill the GPU (no
    # clusters), a short one and a padding row beside them
    contexts = [1000 + 17 * i for i in range(63)] + [5]
    batch = [(1, n) for n in contexts] if max_query_len == 1 else [(1, n) for n in contexts] + mixed_batch(seed=2)
    first = check_attention(make_attention_inputs(
        batch, block_size=16, num_heads=2 * group, num_kv_heads=2, head_size=128, dtype=dtype, num_pad_rows=1,
    ), max_query_len=max_query_len)
    assert torch.isfinite(first).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_head_size_256_and_odd_group(dtype):
    # Shapes outside the tiled kernel (head_size 256) and a group of 3 heads (GP = 4, one masked)
    check_attention(make_attention_inputs(
        mixed_batch(seed=3), block_size=16, num_heads=6, num_kv_heads=2, head_size=256, dtype=dtype, num_pad_rows=2,
    ))
    check_attention(make_attention_inputs(
        mixed_batch(seed=4), block_size=16, num_heads=6, num_kv_heads=2, head_size=128, dtype=dtype, num_pad_rows=2,
    ))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_query_sliced_from_qkv(dtype):
    num_heads, num_kv_heads, head_size = 8, 2, 64
    query, *rest = cuda(make_attention_inputs(
        [(1, 40), (70, 70), (5, 33)], block_size=16, num_heads=num_heads, num_kv_heads=num_kv_heads,
        head_size=head_size, dtype=dtype,
    ))
    qkv = torch.randn(query.shape[0], (num_heads + 2 * num_kv_heads) * head_size, device="cuda").to(dtype)
    qkv[:, : num_heads * head_size] = query.flatten(1)
    strided = qkv[:, : num_heads * head_size].view(-1, num_heads, head_size)
    assert not strided.is_contiguous()
    assert_close(paged_attention(strided, *rest), paged_attention_ref(query, *rest))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("aligned", [True, False])
def test_reshape_and_cache(dtype, aligned):
    key, value, key_cache, value_cache, slot_mapping = cuda(make_cache_inputs(
        dtype, num_tokens=50, num_blocks=10, block_size=16, num_kv_heads=4, head_size=64,
    ))
    if not aligned:  # rows shifted by one element: the element-wise copy path
        shifted = torch.empty(key.shape[0] * 2 * key[0].numel() + 1, dtype=dtype, device="cuda")[1:]
        shifted = shifted.view(key.shape[0], 2, *key.shape[1:])
        shifted[:, 0], shifted[:, 1] = key, value
        key, value = shifted[:, 0], shifted[:, 1]
    slot_mapping[1] = key_cache.shape[0] * key_cache.shape[1]  # outside the cache: skipped
    expected_k, expected_v = key_cache.clone(), value_cache.clone()
    keep = slot_mapping < expected_k.shape[0] * expected_k.shape[1]
    reshape_and_cache_ref(key[keep], value[keep], expected_k, expected_v, slot_mapping[keep])
    reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)
    assert torch.equal(key_cache, expected_k) and torch.equal(value_cache, expected_v)


def test_opcheck():
    torch.library.opcheck(torch.ops.compilelm.reshape_and_cache.default, cuda(make_cache_inputs(torch.bfloat16)))
    for dtype in (torch.float32, torch.bfloat16):
        inputs = make_attention_inputs(
            [(1, 9), (4, 4), (3, 40)], block_size=16, num_heads=4, num_kv_heads=2, head_size=64, dtype=dtype,
            num_pad_rows=2,
        )
        torch.library.opcheck(torch.ops.compilelm.paged_attention.default, cuda(inputs))
    decode = make_attention_inputs([(1, 9), (1, 40)], block_size=16, num_heads=4, num_kv_heads=2, head_size=64,
                                   dtype=torch.bfloat16, num_pad_rows=2)
    torch.library.opcheck(torch.ops.compilelm.paged_attention.default, (*cuda(decode), 1))


def test_bad_inputs_raise():
    query, key_cache, value_cache, cu, seq_lens, block_tables, scale = cuda(make_attention_inputs(
        [(1, 9), (4, 4)], block_size=16, num_heads=4, num_kv_heads=2, head_size=64, dtype=torch.bfloat16,
    ))
    with pytest.raises(RuntimeError, match="seq_lens must be on"):
        paged_attention(query, key_cache, value_cache, cu, seq_lens.cpu(), block_tables, scale)
    with pytest.raises(RuntimeError, match="block_tables must be int32"):
        paged_attention(query, key_cache, value_cache, cu, seq_lens, block_tables.long(), scale)
    small_k, small_v = key_cache[..., :32].contiguous(), value_cache[..., :32].contiguous()
    with pytest.raises(RuntimeError, match=r"contiguous within a token \(strides \[256, 64, 1\]\)"):
        paged_attention(query[..., :32], small_k, small_v, cu, seq_lens, block_tables, scale)
    with pytest.raises(RuntimeError, match="head_size 64, 128 and 256, got 32"):
        paged_attention(query[..., :32].contiguous(), small_k, small_v, cu, seq_lens, block_tables, scale)
    key, value, kc, vc, slots = cuda(make_cache_inputs(torch.float32))
    with pytest.raises(RuntimeError, match="slot_mapping must be int64"):
        reshape_and_cache(key, value, kc, vc, slots.int())
    with pytest.raises(RuntimeError, match=r"slot_mapping must be \[num_tokens\] = \[20\], got \[19\]"):
        reshape_and_cache(key, value, kc, vc, slots[1:])


def test_cuda_graph_capture_and_replay():
    """Capture one step (cache write + attention of a mixed batch), then replay it with new
    tokens, contexts, block tables and batch composition written into the same buffers."""
    num_heads, num_kv_heads, head_size, block_size, num_blocks, width = 8, 2, 128, 16, 160, 64
    dtype, gen = torch.bfloat16, torch.Generator(device="cuda").manual_seed(0)
    cache_shape = (num_blocks, block_size, num_kv_heads, head_size)
    key_cache = torch.randn(cache_shape, generator=gen, device="cuda").to(dtype)
    value_cache = torch.randn(cache_shape, generator=gen, device="cuda").to(dtype)

    def step_inputs(q_and_seq_lens, num_tokens):
        """Random q/k/v for the new tokens of each sequence and the metadata to place them."""
        tables = torch.zeros(len(q_and_seq_lens), width, dtype=torch.int32)
        physical = (torch.randperm(num_blocks - 1) + 1).tolist()
        cu, slots = [0], torch.full((num_tokens,), -1, dtype=torch.int64)
        for i, (q_len, seq_len) in enumerate(q_and_seq_lens):
            n = -(-seq_len // block_size)
            tables[i, :n] = torch.tensor(physical[:n], dtype=torch.int32)
            physical = physical[n:]
            for j, pos in enumerate(range(seq_len - q_len, seq_len)):
                slots[cu[-1] + j] = tables[i, pos // block_size] * block_size + pos % block_size
            cu.append(cu[-1] + q_len)
        shape = (num_tokens, num_heads + 2 * num_kv_heads, head_size)
        qkv = torch.randn(shape, generator=gen, device="cuda").to(dtype)
        return dict(qkv=qkv, slots=slots.cuda(), cu=torch.tensor(cu, dtype=torch.int32).cuda(),
                    seq_lens=torch.tensor([s for _, s in q_and_seq_lens], dtype=torch.int32).cuda(),
                    tables=tables.cuda())

    def step(b, cache_op, attention_op):
        q, k, v = b["qkv"].split([num_heads, num_kv_heads, num_kv_heads], dim=1)
        cache_op(k, v, key_cache, value_cache, b["slots"])
        return attention_op(q, key_cache, value_cache, b["cu"], b["seq_lens"], b["tables"], head_size**-0.5)

    static = step_inputs([(1, 40), (1, 300), (20, 100)], num_tokens=24)  # 2 padding tokens
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step(static, reshape_and_cache, paged_attention)  # warm-up outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step(static, reshape_and_cache, paged_attention)

    for batch in ([(1, 700), (15, 15), (6, 50)], [(1, 1), (1, 1000), (20, 20)]):
        new = step_inputs(batch, num_tokens=24)
        for name, tensor in new.items():
            static[name].copy_(tensor)
        expected_k, expected_v = key_cache.clone(), value_cache.clone()
        q, k, v = new["qkv"].split([num_heads, num_kv_heads, num_kv_heads], dim=1)
        reshape_and_cache_ref(k, v, expected_k, expected_v, new["slots"])
        expected = paged_attention_ref(q, expected_k, expected_v, new["cu"], new["seq_lens"], new["tables"],
                                       head_size**-0.5)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(key_cache, expected_k) and torch.equal(value_cache, expected_v)
        assert_close(out, expected)
        assert torch.count_nonzero(out[22:]) == 0
