"""The QKV projection with RoPE and the KV-cache write in its epilogue (qkv_rope_cache and its norm
variants) on an H100: at 1-2 rows linear's kRope kernel, at 3-64 rows hopper_mm_rope_out
(compilelm/ops/hopper_gemm.py). Both against the unfused kernels (the projection, then
rope_and_cache): the rotated query and both caches bit-identical, padding slots (-1) untouched.
Also the routing (which kernels run), a CUDA graph replayed with new inputs, opcheck, bad input."""

import pytest
import torch
from torch.library import opcheck

from compilelm.ops import linear, rope_and_cache
from compilelm.ops.hopper_gemm import triton

ops = torch.ops.compilelm
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9 or triton is None,
                       reason="hopper_mm_rope_out runs on sm_90 with Triton"),
]
KERNEL = "_hopper_mm_rope_kernel"
BLOCKS, BLOCK_SIZE = 80, 16


def case(m, heads, kv_heads, head_size, k, dtype, cos_dtype, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed * 1009 + m)
    x = torch.randn(m, k, device="cuda", generator=g).to(dtype)
    w = (torch.randn((heads + 2 * kv_heads) * head_size, k, device="cuda", generator=g) * 0.05).to(dtype)
    positions = torch.randint(0, 4000, (m,), device="cuda", generator=g)
    inv = 1.0 / 500000 ** (torch.arange(0, head_size, 2, device="cuda").float() / head_size)
    angles = torch.arange(4096, device="cuda").float()[:, None] * inv[None]
    cos_sin = torch.cat([angles.cos(), angles.sin()], -1).to(cos_dtype)
    slots = torch.randperm(BLOCKS * BLOCK_SIZE, device="cuda", generator=g)[:m]
    slots[m // 2] = -1  # a padding row: no cache write
    cache = torch.randn(BLOCKS, BLOCK_SIZE, kv_heads, head_size, device="cuda", generator=g).to(dtype)
    return x, w, positions, cos_sin, slots, cache


def unfused(x, w, positions, cos_sin, slots, k_cache, v_cache, heads):
    m, head_size = x.shape[0], k_cache.shape[3]
    kv = k_cache.shape[2] * head_size
    q, k, v = linear(x, w).split([heads * head_size, kv, kv], -1)
    return rope_and_cache(positions, q.view(m, heads, head_size), k.view(m, -1, head_size), v.view(m, -1, head_size),
                          cos_sin, None, None, 0.0, k_cache, v_cache, slots)


def kernels_run(fn):
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return " ".join(e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


@pytest.mark.parametrize("m", [1, 2, 3, 17, 64])
@pytest.mark.parametrize("heads, kv_heads, head_size, k", [(32, 8, 128, 4096), (16, 8, 128, 2048), (32, 8, 64, 4096)])
@pytest.mark.parametrize("dtype, cos_dtype", [(torch.bfloat16, torch.float32), (torch.bfloat16, torch.bfloat16),
                                              (torch.float16, torch.float32)])
def test_matches_projection_then_rope_and_cache(m, heads, kv_heads, head_size, k, dtype, cos_dtype):
    x, w, positions, cos_sin, slots, cache = case(m, heads, kv_heads, head_size, k, dtype, cos_dtype)
    k_got, v_got, k_want, v_want = (cache.clone() for _ in range(4))
    q = ops.qkv_rope_cache(x, w, positions, cos_sin, k_got, v_got, slots, heads)
    q_want = unfused(x, w, positions, cos_sin, slots, k_want, v_want, heads)
    assert q.shape == (m, heads, head_size) and q.is_contiguous()
    assert torch.equal(q, q_want), (q.float() - q_want.float()).abs().max()
    assert torch.equal(k_got, k_want) and torch.equal(v_got, v_want)
    assert not torch.equal(k_got, cache) or m == 1  # (m = 1: its one row is the padding row)


def test_routing():
    """3-64 rows of a large weight: the Hopper kernel, no rope_and_cache kernel; 1-2 rows: one
    kernel (linear's); set_hopper_gemm(False), 65+ rows or a small weight: the projection, then
    rope_and_cache. The norm variants at 3-64 rows: the norm kernel, then the Hopper kernel."""
    x, w, positions, cos_sin, slots, cache = case(64, 32, 8, 128, 4096, torch.bfloat16, torch.float32)
    kc, vc = cache.clone(), cache.clone()

    def run(rows, weight=w):
        return lambda: ops.qkv_rope_cache(x[:rows, :weight.shape[1]], weight, positions[:rows], cos_sin, kc, vc,
                                          slots[:rows], 32 if weight is w else 4)
    names = kernels_run(run(17))
    assert KERNEL in names and "rope_and_cache" not in names, names
    names = kernels_run(run(1))
    assert KERNEL not in names and "rope_and_cache" not in names and "skinny_mm_kernel" in names, names
    previous = ops.set_hopper_gemm(False)
    try:
        names = kernels_run(run(17))
    finally:
        ops.set_hopper_gemm(previous)
    assert KERNEL not in names and "rope_and_cache" in names, names
    small = w[:(4 + 16) * 128, :1024].contiguous()  # 2.6M elements: the projection, then rope_and_cache
    names = kernels_run(run(17, small))
    assert KERNEL not in names and "rope_and_cache" in names, names
    many = torch.cat([x, x[:8]])
    names = kernels_run(lambda: ops.qkv_rope_cache(many, w, torch.cat([positions, positions[:8]]), cos_sin, kc, vc,
                                                   torch.cat([slots, slots[:8]]), 32))
    assert KERNEL not in names and "rope_and_cache" in names, names
    # the norm variants (a hidden size the norm does not fuse at 17 rows): norm kernel, then this kernel
    x2, w2, pos2, cs2, slots2, cache2 = case(17, 16, 8, 128, 2048, torch.bfloat16, torch.float32)
    norm_w = (torch.rand(2048, device="cuda") + 0.5).to(torch.bfloat16)
    k_got, v_got, k_want, v_want = (cache2.clone() for _ in range(4))
    names = kernels_run(lambda: ops.fused_add_rms_norm_qkv_rope_cache(x2, x2, norm_w, 1e-5, w2, pos2, cs2, k_got,
                                                                      v_got, slots2, 16))
    assert KERNEL in names and "rope_and_cache" not in names, names
    q, residual = ops.fused_add_rms_norm_qkv_rope_cache(x2, x2, norm_w, 1e-5, w2, pos2, cs2, k_got, v_got, slots2, 16)
    normed, residual_want = ops.fused_add_rms_norm(x2, x2, norm_w, 1e-5)
    assert torch.equal(residual, residual_want)
    assert torch.equal(q, unfused(normed, w2, pos2, cs2, slots2, k_want, v_want, 16))
    assert torch.equal(k_got, k_want) and torch.equal(v_got, v_want)


def test_cuda_graph_replays_with_new_inputs():
    x, w, positions, cos_sin, slots, cache = case(64, 32, 8, 128, 4096, torch.bfloat16, torch.float32)
    kc, vc = cache.clone(), cache.clone()
    ops.qkv_rope_cache(x, w, positions, cos_sin, kc, vc, slots, 32)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        q = ops.qkv_rope_cache(x, w, positions, cos_sin, kc, vc, slots, 32)
    x2, _, positions2, _, slots2, _ = case(64, 32, 8, 128, 4096, torch.bfloat16, torch.float32, seed=1)
    x.copy_(x2), positions.copy_(positions2), slots.copy_(slots2)
    kc.copy_(cache), vc.copy_(cache)
    graph.replay()
    k_want, v_want = cache.clone(), cache.clone()
    assert torch.equal(q, unfused(x2, w, positions2, cos_sin, slots2, k_want, v_want, 32))
    assert torch.equal(kc, k_want) and torch.equal(vc, v_want)


def test_opcheck_and_bad_input():
    x, w, positions, cos_sin, slots, cache = case(8, 32, 8, 128, 4096, torch.bfloat16, torch.float32)
    q_out = torch.empty(8, 32, 128, device="cuda", dtype=torch.bfloat16)
    opcheck(ops.hopper_mm_rope_out.default, (x, w, positions, cos_sin, cache.clone(), cache.clone(), slots, q_out,
                                             True))
    opcheck(ops.qkv_rope_cache.default, (x, w, positions, cos_sin, cache.clone(), cache.clone(), slots, 32))
    with pytest.raises(RuntimeError, match="hopper_mm_rope_out"):  # q_out of the wrong head count
        ops.hopper_mm_rope_out(x, w, positions, cos_sin, cache, cache, slots, q_out[:, :16], True)
    with pytest.raises(RuntimeError, match="qkv_rope_cache"):  # K of x and weight differ
        ops.qkv_rope_cache(x[:, :2048], w, positions, cos_sin, cache, cache, slots, 32)
    with pytest.raises(RuntimeError, match="num_heads"):  # weight rows != (heads + 2 kv heads) * head_size
        ops.qkv_rope_cache(x, w, positions, cos_sin, cache, cache, slots, 30)
