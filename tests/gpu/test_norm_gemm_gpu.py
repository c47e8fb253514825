"""compilelm/ops/norm_gemm.py on the GPU: projection + residual add + weightless RMSNorm + projection
(gate_up with SiLU-and-mul; the QKV projection with RoPE and the cache write) at Llama-3.1-8B's
widths. At 3-64 rows on sm_90 the two-kernel path (the producer's partial sums of squares, the
consumer's rstd epilogue) against the unfused composition in fp32 math (within bf16 roundings: the
fast path rounds once after the rstd, where rms_norm rounds before the GEMM); at 2 rows the
unfused kernels; CUDA-graph replay == the eager call."""

import pytest
import torch

from compilelm.ops import norm_gemm

pytestmark = pytest.mark.gpu
ops = torch.ops.compilelm
HID, INTER, HEADS, KV_HEADS, D, EPS = 4096, 2048, 32, 8, 128, 1e-5
hopper = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
                            reason="the fast path is sm_90's")


def rel_err(got, want):
    return ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()


def operands(m, rows2, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    rand = lambda *s, scale=1.0: (torch.randn(*s, device="cuda", generator=g) * scale).to(torch.bfloat16)  # noqa
    return rand(m, HID), rand(HID, HID, scale=0.02), rand(m, HID), rand(rows2, HID, scale=0.02)


def reference(x, w, residual, w2):
    """The unfused graph in fp32 math with its roundings: h, then rms_norm(h) rounded, then w2."""
    h = (x.float() @ w.float().t()).to(x.dtype) + residual
    hf = h.float()
    normed = (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + EPS)).to(x.dtype)
    return normed.float() @ w2.float().t(), h


def replayed(fn):
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    graph.replay()
    torch.cuda.synchronize()
    return out


@hopper
@pytest.mark.parametrize("m", [2, 3, 17, 64])
def test_mlp_side(m):
    x, w, residual, w2 = operands(m, 2 * INTER, m)
    assert norm_gemm.takes(x, w, w2) == (m >= 3)
    act, h = ops.linear_add_rms_norm_gate_up_silu_mul(x, w, residual, EPS, w2)
    prod, want_h = reference(x, w, residual, w2)
    gate, up = prod.to(x.dtype).float().split(INTER, -1)
    want = ((gate / (1 + torch.exp(-gate))).to(x.dtype).float() * up).to(x.dtype)
    assert act.shape == (m, INTER) and h.shape == (m, HID)
    assert rel_err(h, want_h) < 1e-2 and (h == want_h).float().mean() > 0.99
    assert rel_err(act, want) < 2e-2
    got_act, got_h = replayed(lambda: ops.linear_add_rms_norm_gate_up_silu_mul(x, w, residual, EPS, w2))
    assert torch.equal(got_act, act) and torch.equal(got_h, h)


@hopper
@pytest.mark.parametrize("m", [2, 5, 64])
def test_qkv_side(m):
    x, w, residual, w2 = operands(m, (HEADS + 2 * KV_HEADS) * D, 100 + m)
    blocks, bs = 2 * m + 4, 16
    caches = [torch.zeros(blocks, bs, KV_HEADS, D, device="cuda", dtype=x.dtype) for _ in range(4)]
    slots = torch.randperm(blocks * bs, device="cuda")[:m].long()
    slots[-1] = -1  # a padding row
    positions = torch.randint(0, 512, (m,), device="cuda")
    inv = 1.0 / (500000 ** (torch.arange(0, D, 2, device="cuda").float() / D))
    ang = torch.arange(1024, device="cuda").float()[:, None] * inv[None]
    cos_sin = torch.cat([ang.cos(), ang.sin()], -1)
    q, h = ops.linear_add_rms_norm_qkv_rope_cache(x, w, residual, EPS, w2, positions, cos_sin, *caches[:2],
                                                  slots, HEADS)
    prod, want_h = reference(x, w, residual, w2)
    # the reference's projection (rounded) through rope_and_cache, as qkv_rope_cache's reference
    parts = [t.reshape(m, -1, D).contiguous()
             for t in prod.to(x.dtype).split([HEADS * D, KV_HEADS * D, KV_HEADS * D], -1)]
    want_q = ops.rope_and_cache(positions, *parts, cos_sin, None, None, 0.0, *caches[2:], slots)
    assert q.shape == (m, HEADS, D) and rel_err(q, want_q) < 2e-2 and rel_err(h, want_h) < 1e-2
    for got, want in zip(caches[:2], caches[2:]):
        assert want.abs().sum() > 0 and rel_err(got, want) < 2e-2
        # the same (slot, head) rows written, the padding row's skipped
        assert torch.equal(got.abs().sum(-1) > 0, want.abs().sum(-1) > 0)
