"""The Triton prefill kernel (compilelm/ops/prefill_attention.py) compiled on the GPU, beside
paged_attention's CUDA kernels on the other rows (prefill_rows=False): the whole output against
the plain-torch reference, rows it must not forget poisoned with NaN, CUDA-graph replay with new
batch compositions, and the step routing (unified_attention's _attend)."""

import pytest
import torch

from compilelm.ops import paged_attention, paged_attention_ref
from compilelm.ops import prefill_attention as prefill
from tests.gpu.test_cuda_ops import assert_close, cuda, poison_allocator
from tests.test_ops import make_attention_inputs, mixed_batch

pytestmark = pytest.mark.gpu


def split_attention(query, key_cache, value_cache, cu, seq_lens, tables, scale, max_query_len=0, config=None,
                    max_seq_len=0):
    out = paged_attention(query, key_cache, value_cache, cu, seq_lens, tables, scale, max_query_len=max_query_len,
                          prefill_rows=False)
    prefill.prefill_attention(out, query, key_cache, value_cache, cu, seq_lens, tables, scale, config=config,
                              max_seq_len=max_seq_len)
    return out


def check(inputs_cpu, config=None, max_seq_len=0):
    inputs = cuda(inputs_cpu)
    assert prefill.supported(inputs[0], inputs[1])
    poison_allocator(inputs[0].shape, inputs[0].dtype)
    out = split_attention(*inputs, config=config, max_seq_len=max_seq_len)
    torch.cuda.synchronize()
    assert_close(out, paged_attention_ref(*inputs))
    assert torch.count_nonzero(out[int(inputs_cpu[3][-1]):]) == 0  # padding rows: the CUDA kernel zeroes them


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize("head_size", [64, 128])
@pytest.mark.parametrize("group", [1, 2, 4, 8])
def test_mixed_batch(dtype, block_size, head_size, group, decode_kernel):
    check(make_attention_inputs(mixed_batch(seed=block_size + group), block_size=block_size, num_heads=2 * group,
                                num_kv_heads=2, head_size=head_size, dtype=dtype, num_pad_rows=5,
                                seed=head_size + group))


@pytest.mark.parametrize("config", [(64, 32, 4, 2), (128, 128, 8, 3), (64, 64, 4, 4), (128, 128, 8, 2)])
def test_tile_configs(config):
    check(make_attention_inputs(mixed_batch(seed=3), block_size=16, num_heads=8, num_kv_heads=2, head_size=128,
                                dtype=torch.bfloat16, num_pad_rows=2), config=config)


@pytest.mark.parametrize("long_tiles", [False, True])
@pytest.mark.parametrize("group", [2, 4])
def test_long_prompts_and_split_k_decodes(group, long_tiles, decode_kernel):
    # long fresh and chunked prefills (many tiles, the unmasked loop) beside split-K decode rows
    # whose partials the CUDA prefill kernel still merges; with the step's longest row given, the
    # kernel takes the long-row tiles
    batch = [(1, 8192), (2048, 2048), (1, 1), (700, 6000), (64, 8192), (300, 300)]
    check(make_attention_inputs(batch, block_size=16, num_heads=8 * group, num_kv_heads=8, head_size=128,
                                dtype=torch.bfloat16, num_pad_rows=3), max_seq_len=8192 if long_tiles else 0)


def test_prefill_rows_false_needs_the_tiled_shapes():
    inputs = cuda(make_attention_inputs([(4, 4)], block_size=16, num_heads=4, num_kv_heads=2, head_size=64,
                                        dtype=torch.float32))
    with pytest.raises(RuntimeError, match=r"prefill_rows=False\) needs"):
        paged_attention(*inputs, prefill_rows=False)
    assert not prefill.supported(inputs[0], inputs[1])


def test_graph_replay_with_new_batches():
    """One capture (grid fixed by the shapes), replayed over batches of other compositions written
    into the same buffers: the kernel reads the batch from the device."""
    num_heads, num_kv_heads, head_size, block_size, width, tokens = 8, 2, 128, 16, 40, 300
    batches = [[(1, 40), (200, 260), (90, 90), (1, 7)], [(150, 150), (149, 500)], [(1, 30)] * 4,
               [(3, 3), (1, 600), (280, 280), (1, 2)]]
    inputs = [cuda(make_attention_inputs(b, block_size=block_size, num_heads=num_heads, num_kv_heads=num_kv_heads,
                                         head_size=head_size, dtype=torch.bfloat16, seed=i))
              for i, b in enumerate(batches)]
    num_blocks = max(x[1].shape[0] for x in inputs)
    kc = torch.zeros(num_blocks, block_size, num_kv_heads, head_size, dtype=torch.bfloat16, device="cuda")
    vc, q = torch.zeros_like(kc), torch.zeros(tokens, num_heads, head_size, dtype=torch.bfloat16, device="cuda")
    cu = torch.zeros(5, dtype=torch.int32, device="cuda")
    seq_lens = torch.zeros(4, dtype=torch.int32, device="cuda")
    tables = torch.zeros(4, width, dtype=torch.int32, device="cuda")

    def load(x):
        n, s = x[0].shape[0], x[4].shape[0]
        q.zero_()
        q[:n] = x[0]
        kc.zero_()
        vc.zero_()
        kc[:x[1].shape[0]], vc[:x[2].shape[0]] = x[1], x[2]
        cu.fill_(int(x[3][-1]))
        cu[:s + 1] = x[3]
        seq_lens.zero_()
        seq_lens[:s] = x[4]
        tables.zero_()
        tables[:s, :x[5].shape[1]] = x[5]

    load(inputs[0])
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        split_attention(q, kc, vc, cu, seq_lens, tables, head_size ** -0.5)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = split_attention(q, kc, vc, cu, seq_lens, tables, head_size ** -0.5)
    for x in inputs:
        load(x)
        graph.replay()
        torch.cuda.synchronize()
        expected = paged_attention_ref(q, kc, vc, cu, seq_lens, tables, head_size ** -0.5)
        assert_close(out, expected)


@pytest.mark.parametrize("max_query_len, routed", [(0, True), (300, True), (1, False)])
def test_steps_with_prefill_rows_are_routed_here(max_query_len, routed, monkeypatch):
    q, kc = torch.zeros(4, 8, 128, dtype=torch.bfloat16, device="cuda"), torch.zeros(
        3, 16, 2, 128, dtype=torch.bfloat16, device="cuda")
    assert prefill.serves(q, kc, max_query_len) is routed
    previous = prefill.set_enabled(False)
    try:
        assert not prefill.serves(q, kc, max_query_len)
    finally:
        prefill.set_enabled(previous)
