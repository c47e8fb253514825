"""RMSNorm+quant and SiLU-mul+quant fusions on a toy FP8 block: op counts before/after, numerics.

The toy block is built from the model's own layers (RMSNorm, MergedColumnParallelLinear, SiluAndMul) quantized
by `quantize_model`, traced to aten with Inductor's decompositions and weights as constants (as
Dynamo sees a model's parameters), so the graph is the one the passes meet in a real piece.
"""

import pytest
import torch
from torch._inductor.decomposition import select_decomp_table
from torch.fx.experimental.proxy_tensor import make_fx

from compilelm.layers.activation import SiluAndMul
from compilelm.layers.layernorm import RMSNorm
from compilelm.layers.linear import Linear, MergedColumnParallelLinear
from compilelm.layers.quantization import calibrate, quantize_model
from compilelm.ops import quant as q_ops
from compilelm.ops.activation import silu_and_mul
from compilelm.ops.norm import rms_norm
from compilelm.passes import NoOpEliminationPass, max_error, snapshot
from compilelm.passes.fusion.fuse_act_quant import SiluMulQuantFusionPass
from compilelm.passes.fusion.fuse_norm_quant import RMSNormQuantFusionPass

ops = torch.ops.compilelm


class Block(torch.nn.Module):
    """norm -> o (first-layer style), add+norm -> gate_up -> silu-mul -> down: one match of each."""

    def __init__(self, hidden=64, inter=96, eps=1e-6):
        super().__init__()
        self.norm1, self.norm2 = RMSNorm(hidden, eps), RMSNorm(hidden, eps)
        self.o_proj = Linear(hidden, hidden)
        self.gate_up_proj = MergedColumnParallelLinear(hidden, {"gate": inter, "up": inter})
        self.act = SiluAndMul()
        self.down_proj = Linear(inter, hidden)

    def forward(self, x, residual):
        h = self.o_proj(self.norm1(x))
        h, residual = self.norm2(h, residual)
        return self.down_proj(self.act(self.gate_up_proj(h))), residual


def make_block(dtype, static: bool):
    torch.manual_seed(0)
    block = Block().to(dtype)
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(1.0 if p.dim() == 1 else 0.0, 0.1)
    quantize_model(block, "fp8")
    if static:
        with calibrate(block):
            block(*inputs(dtype, 16, seed=1))
    return block


def inputs(dtype, n=7, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 64, generator=g).to(dtype), torch.randn(n, 64, generator=g).to(dtype)


def trace(block, dtype):
    gm = make_fx(block, tracing_mode="symbolic", decomposition_table=select_decomp_table(),
                 _allow_non_fake_inputs=True)(*inputs(dtype))
    first = next(iter(gm.graph.nodes))
    for node in [n for n in gm.graph.nodes if n.op == "get_attr"]:  # weights first, like placeholders
        first.prepend(node)
    NoOpEliminationPass().run(gm.graph)  # runs before the fusions in every piece
    gm.recompile()
    return gm


def count(gm, target) -> int:
    return sum(n.target == target for n in gm.graph.nodes)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("static", [False, True], ids=["per_token", "static"])
def test_fusions_op_counts_and_numerics(dtype, static):
    block = make_block(dtype, static)
    gm = trace(block, dtype)
    quant = ops.quant_fp8_static.default if static else ops.quant_fp8_per_token.default
    assert count(gm, quant) == 3 and count(gm, torch.ops.aten.rsqrt.default) == 2
    before = snapshot(gm.graph)
    norm, act = RMSNormQuantFusionPass(), SiluMulQuantFusionPass()
    norm(gm.graph)
    act(gm.graph)
    gm.recompile()
    assert (norm.matches, act.matches) == (2, 1)
    assert count(gm, ops.rms_norm_quant_fp8.default) == 1
    assert count(gm, ops.fused_add_rms_norm_quant_fp8.default) == 1
    assert count(gm, ops.silu_mul_quant_fp8.default) == 1
    assert count(gm, quant) == 0  # every quant was fed by a norm or silu-mul
    assert count(gm, torch.ops.aten.rsqrt.default) == 0 and count(gm, torch.ops.aten.exp.default) == 0
    # the fused ops compute exactly what the unfused ones did
    assert max_error(before, snapshot(gm.graph)) == 0.0
    x, r = inputs(dtype, 5, seed=3)
    for got, want in zip(gm(x, r), block(x, r)):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_residual_with_other_users_still_fuses_and_plain_norm_without_quant_does_not():
    w = torch.randn(64)

    def f(x, res):
        res = x + res
        q, s = ops.quant_fp8_per_token(rms_norm(res, w, 1e-5))
        plain = rms_norm(x, w, 1e-5)  # no quant after it: stays
        return q, s, res * 2, plain

    gm = make_fx(f, tracing_mode="symbolic", decomposition_table=select_decomp_table(),
                 _allow_non_fake_inputs=True)(*inputs(torch.float32))
    first = next(iter(gm.graph.nodes))
    for node in [n for n in gm.graph.nodes if n.op == "get_attr"]:
        first.prepend(node)
    gm.recompile()
    before = snapshot(gm.graph)
    p = RMSNormQuantFusionPass()
    p(gm.graph)
    gm.recompile()
    assert p.matches == 1 and count(gm, ops.fused_add_rms_norm_quant_fp8.default) == 1
    assert count(gm, torch.ops.aten.rsqrt.default) == 1
    assert max_error(before, snapshot(gm.graph)) == 0.0


def test_quant_ops_match_references_and_dequantize_close():
    x = torch.randn(9, 64) * torch.linspace(0.1, 10, 9)[:, None]
    q, s = ops.quant_fp8_per_token(x)
    assert q.dtype == torch.float8_e4m3fn and s.shape == (9, 1)
    rel = (q.float() * s - x).abs().amax(-1) / x.abs().amax(-1)
    assert rel.max() < 2 ** -4  # e4m3: 3 mantissa bits, half-ulp relative error 1/16
    zero_q, zero_s = ops.quant_fp8_per_token(torch.zeros(2, 8))
    assert torch.isfinite(zero_s).all() and (zero_q.float() == 0).all()
    scale = torch.tensor([0.01])
    qs = ops.quant_fp8_static(x, scale)
    assert qs.float().abs().max() == 448.0  # saturates instead of overflowing to NaN
    w, res = torch.randn(64), torch.randn(9, 64)
    fq, fs, fres = ops.fused_add_rms_norm_quant_fp8(x, res, w, 1e-6, None)
    rq, rs = q_ops.quant_fp8_per_token_ref(rms_norm(x + res, w, 1e-6))
    assert torch.equal(fq.float(), rq.float()) and torch.equal(fs, rs) and torch.equal(fres, x + res)
    g = torch.randn(9, 128)
    sq, _ = ops.silu_mul_quant_fp8(g, scale)
    assert torch.equal(sq.float(), q_ops.quant_fp8_static_ref(silu_and_mul(g), scale).float())


def test_switches_on_at_O2_off_at_O1_and_skipped_without_fp8():
    from compilelm.graphs.config import CompileConfig
    from compilelm.passes import PassManager
    o1, o2 = CompileConfig.from_cli(1, None, False).passes, CompileConfig.from_cli(2, None, False).passes
    assert (o1.fuse_norm_quant, o1.fuse_act_quant) == (False, False)
    assert (o2.fuse_norm_quant, o2.fuse_act_quant) == (True, True)
    names = [p.name for p in PassManager(o2).post_grad]
    assert names.index("RMSNormQuantFusionPass") < names.index("SiluMulQuantFusionPass")
    assert "RMSNormQuantFusionPass" not in [p.name for p in PassManager(o1).post_grad]
    # an unquantized graph: the pass does not run (no record, no dump, no time)
    gm = make_fx(lambda x, w: rms_norm(x, w, 1e-5), tracing_mode="symbolic")(torch.randn(4, 8), torch.randn(8))
    p = RMSNormQuantFusionPass()
    p(gm.graph)
    assert p.matches == 0 and p.seconds == 0.0


@pytest.mark.parametrize("fmt", ["tensor-dynamic", "channel-static", "block"])
def test_fusions_on_layers_loaded_from_fp8_checkpoints(fmt):
    """Linears loaded from an FP8 checkpoint (checkpoint.py's parameters and methods): per-token
    and static activation scales meet the same fusions as `quantize_model`'s layers; block-wise
    layers quantize per 1 x 128 group, which no fusion matches (the norm and silu-mul stay unfused)."""
    from compilelm.layers.quantization import Fp8Scheme, finalize_fp8_checkpoint
    from compilelm.layers.quantization.checkpoint import _make_fp8_params
    from compilelm.layers.quantization.fp8 import fp8_linears
    weights, _, acts = fmt.partition("-")
    scheme = Fp8Scheme("compressed-tensors", weights, acts or "dynamic", (128, 128) if weights == "block" else None)
    torch.manual_seed(0)
    block = Block(hidden=128, inter=128)
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(1.0 if p.dim() == 1 else 0.0, 0.1)
    for name, layer in list(fp8_linears(block)):
        w = layer.weight.data.clone()
        _make_fp8_params(layer, scheme, name)
        layer.weight.data.copy_(w.clamp(-448, 448).to(torch.float8_e4m3fn))
        layer.weight_scale.data.fill_(0.01)
        if layer.input_scale is not None:
            layer.input_scale.data.fill_(0.02)
    finalize_fp8_checkpoint(block, scheme)
    g = torch.Generator().manual_seed(0)
    x, r = torch.randn(7, 128, generator=g), torch.randn(7, 128, generator=g)
    gm = make_fx(block, tracing_mode="symbolic", decomposition_table=select_decomp_table(),
                 _allow_non_fake_inputs=True)(x, r)
    first = next(iter(gm.graph.nodes))
    for node in [n for n in gm.graph.nodes if n.op == "get_attr"]:  # weights first, as in trace()
        first.prepend(node)
    NoOpEliminationPass().run(gm.graph)
    norm, act = RMSNormQuantFusionPass(), SiluMulQuantFusionPass()
    norm(gm.graph)
    act(gm.graph)
    gm.recompile()
    if weights == "block":
        assert (norm.matches, act.matches) == (0, 0)
        assert count(gm, ops.quant_fp8_per_token_group.default) == 3
    else:
        assert (norm.matches, act.matches) == (2, 1)
        assert count(gm, ops.quant_fp8_per_token.default) + count(gm, ops.quant_fp8_static.default) == 0
    for got, want in zip(gm(x, r), block(x, r)):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
