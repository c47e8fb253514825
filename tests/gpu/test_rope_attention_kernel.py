"""rope_paged_attention on CUDA: a pure-decode batch in one kernel (the decode attention kernel
rotating the query and the new key itself, csrc/cuda/paged_attention_decode.cu kRope) against the
two kernels it replaces (rope_and_cache, then paged_attention): the same output and the same
cache, bit for bit; against the plain-torch reference; which kernels ran (profiler); the
fallbacks; CUDA-graph replay with new values; opcheck."""

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from compilelm.ops import paged_attention, rope_and_cache, rope_paged_attention, rope_paged_attention_ref
from tests.gpu.test_cuda_ops import assert_close
from tests.test_ops import make_decode_step

pytestmark = pytest.mark.gpu


def decode_step(contexts, **kwargs):
    return [a.cuda() if isinstance(a, torch.Tensor) else a for a in make_decode_step(contexts, **kwargs)]


def unfused(args, max_query_len):
    """The two ops, on copies of the caches: (output, key_cache, value_cache)."""
    positions, q, k, v, cos_sin, key_cache, value_cache, slots, cu, seq_lens, tables, scale = args
    key_cache, value_cache = key_cache.clone(), value_cache.clone()
    rotated = rope_and_cache(positions, q, k, v, cos_sin, None, None, 0.0, key_cache, value_cache, slots)
    out = paged_attention(rotated, key_cache, value_cache, cu, seq_lens, tables, scale, max_query_len)
    return out, key_cache, value_cache


def kernel_names(fn):
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        result = fn()
        torch.cuda.synchronize()
    return result, [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]


def check(args, max_query_len=1, fused=True):
    """rope_paged_attention == the two ops (output and caches, exactly) and ~ the reference; `fused`:
    whether it must run as one kernel (no rope_and_cache kernel), None: either."""
    want, want_k, want_v = unfused(args, max_query_len)
    out, names = kernel_names(lambda: rope_paged_attention(*args, max_query_len))
    if fused is not None:
        assert fused == (not any("rope_and_cache_kernel" in n for n in names)), names
    assert any("paged_attention_decode" in n for n in names)  # on CUDA cores or tensor cores (_mma_)
    assert out.shape == args[1].shape and out.is_contiguous()
    assert torch.equal(out, want)
    assert torch.equal(args[5], want_k) and torch.equal(args[6], want_v)  # new rows written, the rest untouched
    ref_k, ref_v = args[5].clone(), args[6].clone()
    assert_close(out, rope_paged_attention_ref(*args[:5], ref_k, ref_v, *args[7:]))
    return out


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
# query widths over 1024 (smaller models keep the two kernels); groups 3 (GP 4), 8, 4, 8, 1, 2
@pytest.mark.parametrize("head_size,num_heads,num_kv_heads",
                         [(64, 24, 8), (64, 32, 4), (128, 32, 8), (128, 16, 2), (128, 16, 16), (64, 24, 12)])
# (1,): the new key is key 0; (1024,): SmolLM2/Llama decode at batch 1; the new keys of the
# others land in different splits and steps of a split
@pytest.mark.parametrize("contexts", [(1,), (1024,), (300, 1, 1024, 77), (65, 129, 17)])
def test_fused_equals_two_kernels(dtype, head_size, num_heads, num_kv_heads, contexts, decode_kernel):
    # block tables 1024 keys wide (the engine's are max_model_len wide): the split-K is sized from
    # the width. Up to 16 programs (rows x kv heads; no padding rows here) run as clusters on an
    # H100, so fused; more may run as clusters of fewer splits or not (the launch heuristic
    # decides), either way equal. (Padding rows in the fused kernel: the fallback test's "none".)
    fused = True if len(contexts) * num_kv_heads <= 16 else None
    check(decode_step(contexts, num_heads=num_heads, num_kv_heads=num_kv_heads, head_size=head_size, dtype=dtype,
                      seed=len(contexts) + head_size, width=64, num_pad_rows=0), fused=fused)


def test_cos_sin_table_in_model_dtype():
    # model.to(dtype) casts the cos/sin buffer: the kernel reads it in the model dtype too
    check(decode_step((500, 33), num_heads=24, num_kv_heads=8, head_size=64, dtype=torch.bfloat16,
                      cos_dtype=torch.bfloat16, width=64, num_pad_rows=0))


@pytest.mark.parametrize("case", ["none", "small model", "batch 64", "head_size 256", "group 16", "fp32",
                                  "mixed batch", "no clusters", "unaligned query"])
def test_fallbacks_run_the_two_kernels(case, decode_kernel):
    # one kernel in clusters ("none"); else rope_and_cache, then paged_attention on either decode
    # kernel (batches too large for clusters: tensor cores by default)
    kwargs = dict(num_heads=16, num_kv_heads=2, head_size=128, dtype=torch.bfloat16)
    contexts, max_query_len = (40, 700), 1
    if case == "small model":  # SmolLM2-135M's heads: query width 576 <= 1024
        kwargs.update(num_heads=9, num_kv_heads=3, head_size=64)
    elif case == "batch 64":  # too many programs for resident clusters
        contexts = tuple(range(960, 1024))
    elif case == "head_size 256":
        kwargs["head_size"] = 256
    elif case == "group 16":
        kwargs.update(num_heads=32)
    elif case == "fp32":
        kwargs["dtype"] = torch.float32
    elif case == "mixed batch":  # max_query_len 0: unknown, so not promised pure decode
        max_query_len = 0
    previous = torch.ops.compilelm.set_cluster_merge(case != "no clusters")
    args = decode_step(contexts, **kwargs)
    if case == "unaligned query":  # rows 2 bytes past 16-byte vectors: no vector loads of the raw query
        q = args[1]
        wide = torch.zeros(q.shape[0], q[0].numel() + 1, dtype=q.dtype, device=q.device)
        args[1] = wide[:, 1:].view(q.shape).copy_(q)
    try:
        check(args, max_query_len, fused=case == "none")
    finally:
        torch.ops.compilelm.set_cluster_merge(previous)


@pytest.mark.parametrize("rows", [2, 40])  # 16 programs: clusters; 320: rope_and_cache + tensor cores
def test_cuda_graph_replay_with_new_values(rows, decode_kernel):
    """Captured once, replayed with new q/k/v, contexts, positions and slots in the same buffers:
    each replay equals the two ops on those values (caches included)."""
    shape = dict(num_heads=24, num_kv_heads=8, head_size=64, dtype=torch.bfloat16, num_pad_rows=2,
                 num_blocks=65 * rows, width=64, max_position=1024)
    args = decode_step((900, 1000) * (rows // 2), **shape)
    rope_paged_attention(*args, 1)  # warm-up outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = rope_paged_attention(*args, 1)
    for seed, contexts in enumerate([(5, 1000), (1000, 1), (640, 333)]):
        new = decode_step(contexts * (rows // 2), seed=seed + 1, **shape)
        for i in (0, 1, 2, 3, 7, 9, 10):  # positions, q, k, v (views of one qkv), slots, seq_lens, tables
            args[i].copy_(new[i])
        want, want_k, want_v = unfused(args, 1)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, want)
        assert torch.equal(args[5], want_k) and torch.equal(args[6], want_v)


def test_opcheck():
    args = decode_step((40, 700), num_heads=16, num_kv_heads=2, head_size=128, dtype=torch.bfloat16)
    torch.library.opcheck(torch.ops.compilelm.rope_paged_attention.default, (*args, 1))
    torch.library.opcheck(torch.ops.compilelm.rope_paged_attention.default, (*args, 0))
