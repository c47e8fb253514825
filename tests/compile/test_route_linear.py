"""RouteLinearPass: a linear's mm on CUDA -> compilelm.linear where M may be <= 2; static M > 2,
CPU graphs, and matmuls that are not `x @ w.T` stay. Graphs are traced with fake CUDA tensors
(no GPU needed); the rewritten graph then runs on real CPU tensors (the op's CPU kernel is the
matmul) against the original."""

import pytest
import torch
from torch._dynamo.source import ConstantSource
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx
from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv
from torch.library import opcheck

import compilelm.ops  # noqa: F401
from compilelm.passes.utility.route_linear import RouteLinearPass

aten = torch.ops.aten
skinny = torch.ops.compilelm.linear.default


def linear_pair(x, w1, w2):
    h = torch.mm(x, w1.t())
    return torch.mm(h.relu(), w2.permute(1, 0)), torch.mm(h, h.t())  # the last is not a linear layer


def trace(fn, shapes, device="cuda", symbolic=False):
    """make_fx of fn on fake tensors; with `symbolic`, the first dim of the first input is a symbol."""
    mode = FakeTensorMode(shape_env=ShapeEnv())
    with mode:
        args = [torch.empty(s, device=device) for s in shapes]
        if symbolic:
            m = mode.shape_env.create_unspecified_symint_and_symbol(shapes[0][0], ConstantSource("m"),
                                                                    DimDynamic.DYNAMIC)
            args[0] = torch.empty(m, shapes[0][1], device=device)
        return make_fx(fn)(*args)


def targets(gm):
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


@pytest.mark.parametrize("m, symbolic, expected", [(1, False, 2), (2, False, 2), (3, False, 0), (64, False, 0),
                                                   (3, True, 2)])
def test_linear_mms_become_compilelm_linear_where_m_may_be_small(m, symbolic, expected):
    shapes = [(m, 16), (24, 16), (8, 24)]
    gm = trace(linear_pair, shapes, symbolic=symbolic)
    x_val = next(iter(gm.graph.find_nodes(op="placeholder"))).meta["val"]
    assert isinstance(x_val.shape[0], torch.SymInt) == symbolic
    p = RouteLinearPass()
    p(gm.graph)
    gm.recompile()
    assert p.matches == expected
    assert targets(gm).count(skinny) == expected and targets(gm).count(aten.mm.default) == 3 - expected
    gen = torch.Generator().manual_seed(0)
    args = [torch.randn(s, generator=gen) for s in shapes]
    for got, want in zip(gm(*args), linear_pair(*args)):
        torch.testing.assert_close(got, want)


def test_cpu_graphs_and_mixed_dtypes_are_kept():
    cpu = trace(linear_pair, [(1, 16), (24, 16), (8, 24)], device="cpu")
    with FakeTensorMode():
        x, w = torch.empty(1, 16, device="cuda", dtype=torch.bfloat16), torch.empty(24, 16, device="cuda")
    mixed = make_fx(lambda x, w: torch.mm(x.float(), w.t()))(x, w)  # x's producer is a cast: still fine
    with FakeTensorMode():
        x, w = torch.empty(1, 16, device="cuda", dtype=torch.bfloat16), torch.empty(24, 16, device="cuda")
    cast_weight = make_fx(lambda x, w: torch.mm(x, w.to(x.dtype).t()))(x, w)  # not a graph input: kept
    for gm, expected in ((cpu, 0), (mixed, 1), (cast_weight, 0)):
        p = RouteLinearPass()
        p(gm.graph)
        assert p.matches == expected


def test_linear_op_cpu_and_opcheck():
    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(3, 40, generator=gen), torch.randn(7, 40, generator=gen)
    torch.testing.assert_close(skinny(x, w), x @ w.t(), rtol=0, atol=0)
    opcheck(skinny, (x, w))
    with pytest.raises(RuntimeError, match="linear"), FakeTensorMode():
        skinny(torch.empty(3, 40), torch.empty(7, 41))


# -- RMSNormLinearFusionPass: the norm (and residual add) before a linear joins it ----------

EPS = 1e-6


def norm_linears(x, residual, n1, n2, w1, w2):
    """The first layer's input norm + qkv (no residual), then add + post-attention norm + gate_up."""
    from compilelm.ops.norm import rms_norm
    a = torch.mm(rms_norm(x, n1, EPS), w1.t())
    r = a + residual
    return torch.mm(rms_norm(r, n2, EPS), w2.t()), r


def norm_shared(x, n1, w1):
    """The norm's output also feeds something else: it must stay."""
    from compilelm.ops.norm import rms_norm
    h = rms_norm(x, n1, EPS)
    return torch.mm(h, w1.t()), h.sum()


def trace_decomposed(fn, shapes, dtype, extra=()):
    """As Inductor's post-grad graphs look: fake CUDA tensors, symbolic M, Inductor's
    decompositions, no-op elimination. `extra`: tensors after those of `shapes`, traced with their
    own dtype (1-d ones of length M with the symbolic M)."""
    from torch._inductor.decomposition import select_decomp_table

    from compilelm.passes.utility.noop_elimination import NoOpEliminationPass
    mode = FakeTensorMode(shape_env=ShapeEnv())
    with mode:
        m = mode.shape_env.create_unspecified_symint_and_symbol(shapes[0][0], ConstantSource("m"), DimDynamic.DYNAMIC)
        args = [torch.empty(m, *s[1:], device="cuda", dtype=dtype) if len(s) == 2 and s[0] == shapes[0][0] else
                torch.empty(s, device="cuda", dtype=dtype) for s in shapes]
        args += [torch.empty(m if t.shape == (shapes[0][0],) else t.shape, device="cuda", dtype=t.dtype) for t in extra]
        gm = make_fx(fn, decomposition_table=select_decomp_table())(*args)
    NoOpEliminationPass().run(gm.graph)
    gm.recompile()
    return gm


def linear_then(fusion, fn, shapes, dtype, extra=()):
    """fn's decomposed graph after RouteLinearPass, then `fusion`: (graph module, both passes)."""
    gm = trace_decomposed(fn, shapes, dtype, extra)
    skinny_pass = RouteLinearPass()
    skinny_pass(gm.graph)
    fusion(gm.graph)
    gm.recompile()
    return gm, skinny_pass, fusion


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_norms_before_linear_fuse_into_it(dtype):
    from compilelm.passes.fusion.fuse_norm_linear import RMSNormLinearFusionPass
    shapes = [(3, 16), (3, 8), (16,), (8,), (8, 16), (24, 8)]
    gm, skinny_pass, fusion = linear_then(RMSNormLinearFusionPass(), norm_linears, shapes, dtype)
    assert skinny_pass.matches == 2 and fusion.matches == 2
    t = targets(gm)
    assert t.count(torch.ops.compilelm.rms_norm_linear.default) == 1
    assert t.count(torch.ops.compilelm.fused_add_rms_norm_linear.default) == 1
    assert skinny not in t and aten.mean.dim not in t and aten.rsqrt.default not in t
    # the rewritten graph on real CPU tensors (the ops' CPU kernels are the references) == eager
    gen = torch.Generator().manual_seed(0)
    args = [torch.randn(s, generator=gen).to(dtype) for s in shapes]
    args[2], args[3] = args[2].abs() + 0.5, args[3].abs() + 0.5
    for got, want in zip(gm(*args), norm_linears(*args)):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_norm_with_other_users_wide_hidden_and_graphs_without_linear_are_kept():
    from compilelm.passes.fusion.fuse_norm_linear import RMSNormLinearFusionPass
    shared = trace_decomposed(norm_shared, [(3, 16), (16,), (8, 16)], torch.float32)
    RouteLinearPass()(shared.graph)
    fusion = RMSNormLinearFusionPass()
    fusion(shared.graph)
    assert fusion.matches == 0 and skinny in targets(shared)
    wide = trace_decomposed(norm_linears, [(1, 4096), (1, 8), (4096,), (8,), (8, 4096), (24, 8)], torch.float32)
    RouteLinearPass()(wide.graph)
    fusion = RMSNormLinearFusionPass()
    fusion(wide.graph)  # the first norm's hidden size (4096) is past MAX_HIDDEN; the second's (8) fuses
    assert fusion.matches == 1 and targets(wide).count(torch.ops.compilelm.rms_norm_linear.default) == 0
    plain = trace_decomposed(norm_shared, [(3, 16), (16,), (8, 16)], torch.float32)  # no linear in it
    fusion = RMSNormLinearFusionPass()
    fusion(plain.graph)
    assert fusion.matches == 0 and fusion._patterns is None  # not even registered


def test_norm_linear_ops_cpu_and_opcheck():
    from compilelm.ops.norm import rms_norm
    gen = torch.Generator().manual_seed(0)
    x, r, w = (torch.randn(s, generator=gen, dtype=torch.bfloat16) for s in ((2, 40), (2, 40), (7, 40)))
    g = torch.rand(40, generator=gen, dtype=torch.bfloat16) + 0.5
    ops = torch.ops.compilelm
    torch.testing.assert_close(ops.rms_norm_linear(x, g, EPS, w), rms_norm(x, g, EPS) @ w.t(), rtol=0, atol=0)
    y, r_out = ops.fused_add_rms_norm_linear(x, r, g, EPS, w)
    assert torch.equal(r_out, x + r)
    torch.testing.assert_close(y, rms_norm(x + r, g, EPS) @ w.t(), rtol=0, atol=0)
    opcheck(ops.rms_norm_linear.default, (x, g, EPS, w))
    opcheck(ops.fused_add_rms_norm_linear.default, (x, r, g, EPS, w))
    with pytest.raises(RuntimeError, match="norm_weight"), FakeTensorMode():
        ops.rms_norm_linear(torch.empty(3, 40), torch.empty(41), EPS, torch.empty(7, 40))


# -- SiluMulLinearFusionPass: the MLP's activation before down_proj's linear joins it -------

def mlp_down(x, w_gate_up, w_down):
    """gate_up -> SiLU-and-mul -> down_proj, as the model's MLP runs it."""
    from compilelm.layers.activation import SiluAndMul
    return torch.mm(SiluAndMul()(torch.mm(x, w_gate_up.t())), w_down.t())


def act_shared(x, w_down):
    """The activation also feeds something else: it must stay."""
    from compilelm.layers.activation import SiluAndMul
    act = SiluAndMul()(x)
    return torch.mm(act, w_down.t()), act.sum()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_mul_before_linear_fuses_into_it(dtype):
    from compilelm.passes.fusion.fuse_act_linear import SiluMulLinearFusionPass
    shapes = [(3, 16), (48, 16), (16, 24)]  # x, gate_up weight (2 x 24 rows), down weight
    gm, skinny_pass, fusion = linear_then(SiluMulLinearFusionPass(), mlp_down, shapes, dtype)
    assert skinny_pass.matches == 2 and fusion.matches == 1
    t = targets(gm)
    assert t.count(torch.ops.compilelm.silu_mul_linear.default) == 1 and t.count(skinny) == 1  # gate_up's stays
    assert aten.silu.default not in t and aten.mul.Tensor not in t
    gen = torch.Generator().manual_seed(0)
    args = [torch.randn(s, generator=gen).to(dtype) for s in shapes]
    torch.testing.assert_close(gm(*args), mlp_down(*args), rtol=0, atol=0)


def test_silu_mul_with_other_users_wide_k_and_graphs_without_linear_are_kept():
    from compilelm.passes.fusion.fuse_act_linear import MAX_INTERMEDIATE, SiluMulLinearFusionPass
    shared = trace_decomposed(act_shared, [(3, 32), (8, 16)], torch.float32)
    RouteLinearPass()(shared.graph)
    fusion = SiluMulLinearFusionPass()
    fusion(shared.graph)
    assert fusion.matches == 0 and skinny in targets(shared)
    k = MAX_INTERMEDIATE + 8  # too wide for down_proj: the activation joins gate_up_proj instead
    wide = trace_decomposed(mlp_down, [(1, 16), (2 * k, 16), (16, k)], torch.float32)
    RouteLinearPass()(wide.graph)
    fusion = SiluMulLinearFusionPass()
    fusion(wide.graph)
    t = targets(wide)
    assert fusion.matches == 1 and torch.ops.compilelm.silu_mul_linear.default not in t
    assert t.count(torch.ops.compilelm.gate_up_silu_mul.default) == 1 and t.count(skinny) == 1  # down's stays
    assert aten.silu.default not in t and aten.mul.Tensor not in t
    plain = trace_decomposed(act_shared, [(3, 32), (8, 16)], torch.float32)  # no linear in it
    fusion = SiluMulLinearFusionPass()
    fusion(plain.graph)
    assert fusion.matches == 0 and fusion._patterns is None  # not even registered


def gate_up_act(x, w_gate_up):
    """gate_up -> SiLU-and-mul, no down_proj after it."""
    from compilelm.layers.activation import SiluAndMul
    return SiluAndMul()(torch.mm(x, w_gate_up.t()))


def gate_up_shared(x, w_gate_up):
    """The gate_up product also feeds something else: it must stay."""
    from compilelm.layers.activation import SiluAndMul
    gate_up = torch.mm(x, w_gate_up.t())
    return SiluAndMul()(gate_up), gate_up.sum()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_mul_after_wide_gate_up_fuses_into_it(dtype):
    from compilelm.passes.fusion.fuse_act_linear import MAX_INTERMEDIATE, SiluMulLinearFusionPass
    i = MAX_INTERMEDIATE + 8
    shapes = [(3, 16), (2 * i, 16), (16, i)]
    gm, skinny_pass, fusion = linear_then(SiluMulLinearFusionPass(), mlp_down, shapes, dtype)
    assert skinny_pass.matches == 2 and fusion.matches == 1
    assert targets(gm).count(torch.ops.compilelm.gate_up_silu_mul.default) == 1
    gen = torch.Generator().manual_seed(0)
    args = [torch.randn(s, generator=gen).to(dtype) for s in shapes]
    torch.testing.assert_close(gm(*args), mlp_down(*args), rtol=0, atol=0)
    shared = trace_decomposed(gate_up_shared, [(3, 16), (2 * i, 16)], torch.float32)
    RouteLinearPass()(shared.graph)
    fusion = SiluMulLinearFusionPass()
    fusion(shared.graph)
    assert fusion.matches == 0 and skinny in targets(shared)
    narrow = trace_decomposed(gate_up_act, [(3, 16), (64, 16)], torch.float32)  # I = 32: down_proj's side
    RouteLinearPass()(narrow.graph)
    fusion = SiluMulLinearFusionPass()
    fusion(narrow.graph)
    assert fusion.matches == 0 and skinny in targets(narrow)


def test_gate_up_silu_mul_op_cpu_and_opcheck():
    from compilelm.layers.activation import SiluAndMul
    gen = torch.Generator().manual_seed(0)
    x, w = (torch.randn(3, 40, generator=gen, dtype=torch.bfloat16),
            torch.randn(14, 40, generator=gen, dtype=torch.bfloat16))
    ops = torch.ops.compilelm
    torch.testing.assert_close(ops.gate_up_silu_mul(x, w), SiluAndMul()(x @ w.t()), rtol=0, atol=0)
    opcheck(ops.gate_up_silu_mul.default, (x, w))
    with pytest.raises(RuntimeError, match="gate | up"), FakeTensorMode():
        ops.gate_up_silu_mul(torch.empty(3, 40), torch.empty(7, 40))


def test_silu_mul_linear_op_cpu_and_opcheck():
    gen = torch.Generator().manual_seed(0)
    x, w = (torch.randn(2, 80, generator=gen, dtype=torch.bfloat16),
            torch.randn(7, 40, generator=gen, dtype=torch.bfloat16))
    ops = torch.ops.compilelm
    want = (torch.nn.functional.silu(x[:, :40]) * x[:, 40:]) @ w.t()
    torch.testing.assert_close(ops.silu_mul_linear(x, w), want, rtol=0, atol=0)
    opcheck(ops.silu_mul_linear.default, (x, w))
    with pytest.raises(RuntimeError, match="gate | up"), FakeTensorMode():
        ops.silu_mul_linear(torch.empty(3, 40), torch.empty(7, 40))
