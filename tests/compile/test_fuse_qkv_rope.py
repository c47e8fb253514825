"""QKVRopeFusionPass: a (normed) QKV projection's q | k | v -> rope_cache becomes one op. The graph
is traced as Inductor's post-grad graphs look on CUDA (fake CUDA tensors, symbolic M), taken
through RouteLinearPass and RMSNormLinearFusionPass, then rewritten; the result runs on real CPU
tensors (the ops' CPU kernels are the torch compositions) against the eager function, the KV
cache included. Also the ops themselves (CPU == reference, opcheck, bad shapes)."""

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.library import opcheck

from compilelm.forward_context import AttentionMetadata, ForwardContext, set_forward_context
from compilelm.ops.norm import rms_norm
from compilelm.passes.fusion.fuse_norm_linear import RMSNormLinearFusionPass
from compilelm.passes.fusion.fuse_qkv_rope import QKVRopeFusionPass
from tests.compile.test_route_linear import EPS, linear_then, targets

ops = torch.ops.compilelm
HEADS, KV_HEADS, HEAD_DIM, HIDDEN, BLOCK, M = 4, 2, 16, 32, 4, 3
WIDTHS = [HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM]


def qkv_rope(x, residual, norm_w, w_qkv, positions, cos_sin_cache):
    """add + RMSNorm -> QKV projection -> split -> rope_cache, as a small model's layer."""
    h = x + residual
    q, k, v = torch.mm(rms_norm(h, norm_w, EPS), w_qkv.t()).split(WIDTHS, dim=-1)
    return ops.rope_cache(q, k, v, positions, cos_sin_cache, HEAD_DIM), h


def first_layer(x, norm_w, w_qkv, positions, cos_sin_cache):
    q, k, v = torch.mm(rms_norm(x, norm_w, EPS), w_qkv.t()).split(WIDTHS, dim=-1)
    return ops.rope_cache(q, k, v, positions, cos_sin_cache, HEAD_DIM)


def plain(x, w_qkv, positions, cos_sin_cache):
    """A model too wide for the norm to fuse: the norm stays, the projection is a plain linear."""
    q, k, v = torch.mm(x, w_qkv.t()).split(WIDTHS, dim=-1)
    return ops.rope_cache(q, k, v, positions, cos_sin_cache, HEAD_DIM)


def leaky(x, norm_w, w_qkv, positions, cos_sin_cache):
    """k also feeds something else: the projection's output must stay."""
    q, k, v = torch.mm(rms_norm(x, norm_w, EPS), w_qkv.t()).split(WIDTHS, dim=-1)
    return ops.rope_cache(q, k, v, positions, cos_sin_cache, HEAD_DIM), k.sum()


def context(dtype):
    shape = (3, BLOCK, KV_HEADS, HEAD_DIM)
    meta = AttentionMetadata(torch.tensor([5, 6, -1]), torch.arange(M + 1, dtype=torch.int32),
                             torch.full((M,), 7, dtype=torch.int32), torch.tensor([[1, 2]] * M, dtype=torch.int32),
                             1, 7)
    return ForwardContext(meta, {"layer0": (torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype))})


def inputs(fn, dtype):
    gen = torch.Generator().manual_seed(0)
    x, r = (torch.randn(M, HIDDEN, generator=gen).to(dtype) for _ in range(2))
    norm_w = (torch.rand(HIDDEN, generator=gen) + 0.5).to(dtype)
    w = torch.randn(sum(WIDTHS), HIDDEN, generator=gen).to(dtype)
    positions, cos_sin = torch.tensor([3, 9, 0]), torch.randn(16, HEAD_DIM, generator=gen)
    return {qkv_rope: [x, r, norm_w, w], plain: [x, w]}.get(fn, [x, norm_w, w]) + [positions, cos_sin]


FUSED = {qkv_rope: ops.fused_add_rms_norm_qkv_rope.default, first_layer: ops.rms_norm_qkv_rope.default,
         plain: ops.qkv_rope.default}


@pytest.mark.parametrize("fn", [qkv_rope, first_layer, plain])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_projection_takes_rope_and_cache_write_in(fn, dtype):
    args = inputs(fn, dtype)
    shapes = [tuple(a.shape) for a in args]
    fusion = QKVRopeFusionPass()
    gm, _, _ = linear_then(lambda g: (RMSNormLinearFusionPass()(g), fusion(g)), fn, shapes[:-2], dtype,
                              extra=args[-2:])
    t = targets(gm)
    assert fusion.matches == 1 and t.count(FUSED[fn]) == 1, gm.code
    assert ops.rope_cache.default not in t and torch.ops.aten.split_with_sizes.default not in t
    assert not {ops.linear.default, ops.rms_norm_linear.default, ops.fused_add_rms_norm_linear.default} & set(t)
    # on CPU: the fused op (its CPU kernel: the composition) == the function, outputs and KV cache
    got_ctx, want_ctx = context(dtype), context(dtype)
    with set_forward_context(got_ctx):
        got = gm(*args)
    with set_forward_context(want_ctx):
        want = fn(*args)
    for g, w in zip(got if isinstance(got, tuple) else [got], want if isinstance(want, tuple) else [want]):
        torch.testing.assert_close(g, w, rtol=0, atol=0)
    for g, w in zip(got_ctx.kv_caches["layer0"], want_ctx.kv_caches["layer0"]):
        assert w.abs().sum() > 0 and torch.equal(g, w)  # slots 5 and 6 written, -1 skipped


def test_projection_with_other_users_is_kept():
    args = inputs(leaky, torch.float32)
    fusion = QKVRopeFusionPass()
    gm, _, _ = linear_then(lambda g: (RMSNormLinearFusionPass()(g), fusion(g)), leaky,
                              [tuple(a.shape) for a in args[:-2]], torch.float32, extra=args[-2:])
    assert fusion.matches == 0 and ops.rope_cache.default in targets(gm)


def test_ops_cpu_match_reference_and_opcheck():
    dtype = torch.bfloat16
    x, r, norm_w, w, positions, cos_sin = inputs(qkv_rope, dtype)
    caches = [torch.zeros(3, BLOCK, KV_HEADS, HEAD_DIM, dtype=dtype) for _ in range(4)]
    slots = torch.tensor([5, 6, -1])
    q, r_out = ops.fused_add_rms_norm_qkv_rope_cache(x, r, norm_w, EPS, w, positions, cos_sin, *caches[:2], slots,
                                                     HEADS)
    qkv = rms_norm(x + r, norm_w, EPS) @ w.t()
    parts = [t.view(M, -1, HEAD_DIM) for t in qkv.split(WIDTHS, dim=-1)]
    want = ops.rope_and_cache(positions, *parts, cos_sin, None, None, 0.0, *caches[2:], slots)
    assert q.shape == (M, HEADS, HEAD_DIM) and torch.equal(q, want) and torch.equal(r_out, x + r)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
    q1 = ops.rms_norm_qkv_rope_cache(x, norm_w, EPS, w, positions, cos_sin, *caches[:2], slots, HEADS)
    assert q1.shape == (M, HEADS, HEAD_DIM)
    # without the norm: qkv_rope_cache, and the Hopper kernel's op (its CPU kernel: the same composition)
    plain_caches = [torch.zeros_like(c) for c in caches]
    q2 = ops.qkv_rope_cache(x, w, positions, cos_sin, *plain_caches[:2], slots, HEADS)
    parts = [t.view(M, -1, HEAD_DIM) for t in (x @ w.t()).split(WIDTHS, dim=-1)]
    assert torch.equal(q2, ops.rope_and_cache(positions, *parts, cos_sin, None, None, 0.0, *plain_caches[2:], slots))
    assert torch.equal(plain_caches[0], plain_caches[2]) and torch.equal(plain_caches[1], plain_caches[3])
    assert plain_caches[0].abs().sum() > 0
    q_out = torch.empty(M, HEADS, HEAD_DIM, dtype=dtype)
    ops.hopper_mm_rope_out(x, w, positions, cos_sin, *plain_caches[:2], slots, q_out, True)
    assert torch.equal(q_out, q2)
    opcheck(ops.qkv_rope_cache.default, (x, w, positions, cos_sin, *caches[:2], slots, HEADS))
    opcheck(ops.hopper_mm_rope_out.default, (x, w, positions, cos_sin, *caches[:2], slots, q_out, True))
    opcheck(ops.rms_norm_qkv_rope_cache.default, (x, norm_w, EPS, w, positions, cos_sin, *caches[:2], slots, HEADS))
    opcheck(ops.fused_add_rms_norm_qkv_rope_cache.default,
            (x, r, norm_w, EPS, w, positions, cos_sin, *caches[:2], slots, HEADS))
    with pytest.raises(RuntimeError, match="num_heads"), FakeTensorMode():
        ops.rms_norm_qkv_rope_cache(torch.empty(2, HIDDEN), torch.empty(HIDDEN), EPS, torch.empty(64, HIDDEN),
                                    torch.empty(2, dtype=torch.long), torch.empty(16, HEAD_DIM),
                                    torch.empty(3, BLOCK, KV_HEADS, HEAD_DIM),
                                    torch.empty(3, BLOCK, KV_HEADS, HEAD_DIM), torch.empty(2, dtype=torch.long), 5)


def test_next_kv_cache_follows_the_attention_ops():
    """The ops inside the pieces name no layer: they write the cache of the layer after the last
    attention op run, the first one at the start of a forward and again after the last layer."""
    caches = {f"l{i}": (torch.full((1,), i), torch.full((1,), -i)) for i in range(3)}
    ctx = ForwardContext(None, caches)
    seen = []
    for _ in range(2):  # two forwards through one context (as a test's before / after graphs)
        for name in caches:
            seen.append(int(ctx.next_kv_cache()[0]))
            ctx.attention_done(name)
    assert seen == [0, 1, 2, 0, 1, 2]
    ctx.attention_done("l0")  # an attention op of layer 0 run again: layer 1 is next
    assert int(ctx.next_kv_cache()[0]) == 1
