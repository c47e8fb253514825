"""The FP8 quant -> GEMM prologue fusion (passes/fusion/fuse_quant_linear.py) on toy FP8 graphs
traced as test_fuse_quant.py traces them: what it takes (a per-token quant feeding only one FP8
linear), what it leaves (quants the producer fusions took, static quants, a quant shared by two
linears), and numerics (bit-identical on CPU)."""

import torch
from torch.fx.experimental.proxy_tensor import make_fx

from compilelm.layers.linear import Linear
from compilelm.layers.quantization import calibrate, quantize_model
from compilelm.ops.fp8_gemm import fp8_quant_linear_ref
from compilelm.passes import max_error, snapshot
from compilelm.passes.fusion.fuse_act_quant import SiluMulQuantFusionPass
from compilelm.passes.fusion.fuse_norm_quant import RMSNormQuantFusionPass
from compilelm.passes.fusion.fuse_quant_linear import QuantLinearFusionPass
from tests.compile.test_fuse_quant import count, inputs, make_block, trace

ops = torch.ops.compilelm


class Proj(torch.nn.Module):
    """o_proj-like: the linear's input comes from no producer in the graph; `shared` adds a second
    linear on the same input (one quant, two users)."""

    def __init__(self, shared=False, bias=False):
        super().__init__()
        self.o_proj = Linear(64, 64, bias=bias)
        self.other = Linear(64, 32) if shared else None

    def forward(self, x, residual):
        out = self.o_proj(x) + residual
        return out if self.other is None else (out, self.other(x))


def make(dtype=torch.bfloat16, static=False, **kw):
    torch.manual_seed(0)
    m = Proj(**kw).to(dtype)
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0.0, 0.1)
    quantize_model(m, "fp8")
    if static:
        with calibrate(m):
            m(*inputs(dtype, 16, seed=1))
    return m


def run_pass(gm):
    p = QuantLinearFusionPass()
    p(gm.graph)
    gm.recompile()
    return p.matches


def test_fuses_a_quant_that_feeds_one_fp8_linear():
    for bias in (False, True):
        m = make(bias=bias)
        gm = trace(m, torch.bfloat16)
        assert count(gm, ops.quant_fp8_per_token.default) == 1 and count(gm, ops.fp8_linear.default) == 1
        before = snapshot(gm.graph)
        assert run_pass(gm) == 1
        assert count(gm, ops.fp8_quant_linear.default) == 1
        assert count(gm, ops.quant_fp8_per_token.default) == 0 and count(gm, ops.fp8_linear.default) == 0
        assert max_error(before, snapshot(gm.graph)) == 0.0
        x, r = inputs(torch.bfloat16, 5, seed=3)
        torch.testing.assert_close(gm(x, r), m(x, r), rtol=0, atol=0)
        want = fp8_quant_linear_ref(x, m.o_proj.weight, m.o_proj.weight_scale, m.o_proj.bias, torch.bfloat16) + r
        torch.testing.assert_close(gm(x, r), want, rtol=0, atol=0)


def test_leaves_shared_static_and_producer_fused_quants():
    m = make(shared=True)  # two layers on one input: each quantizes it, each fuses
    gm = trace(m, torch.bfloat16)
    assert count(gm, ops.quant_fp8_per_token.default) == 2 and run_pass(gm) == 2
    x, r = inputs(torch.bfloat16, 5, seed=3)
    for got, want in zip(gm(x, r), m(x, r)):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    w, ws = m.o_proj.weight, m.o_proj.weight_scale

    def one_quant_two_linears(x):  # (q, scale) with a second user: the quant stays
        q, s = ops.quant_fp8_per_token(x)
        return ops.fp8_linear(q, s, w, ws, None, torch.bfloat16), ops.fp8_linear(q, s, w, ws, None, torch.bfloat16)

    gm = make_fx(one_quant_two_linears, tracing_mode="symbolic", _allow_non_fake_inputs=True)(x)
    assert run_pass(gm) == 0 and count(gm, ops.quant_fp8_per_token.default) == 1
    gm = trace(make(static=True), torch.bfloat16)  # static scales: no prologue variant
    assert run_pass(gm) == 0 and count(gm, ops.quant_fp8_static.default) == 1
    block = make_block(torch.bfloat16, static=False)  # every quant has a norm or SiLU-mul producer
    gm = trace(block, torch.bfloat16)
    RMSNormQuantFusionPass()(gm.graph)
    SiluMulQuantFusionPass()(gm.graph)
    assert run_pass(gm) == 0 and count(gm, ops.fp8_linear.default) == 3


def test_skipped_without_fp8_linears():
    gm = torch.fx.symbolic_trace(lambda x: x * 2)
    p = QuantLinearFusionPass()
    p(gm.graph)
    assert p.matches == 0 and p.seconds == 0.0
