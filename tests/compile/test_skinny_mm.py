"""SkinnyMMPass: a linear's mm on CUDA -> compilelm.skinny_mm where M may be <= 2; static M > 2,
CPU graphs, and matmuls that are not `x @ w.T` stay. Graphs are traced with fake CUDA tensors
(no GPU needed); the rewritten graph then runs on real CPU tensors (the op's CPU kernel is the
matmul) against the original."""

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx
from torch._dynamo.source import ConstantSource
from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv
from torch.library import opcheck

import compilelm.ops  # noqa: F401
from compilelm.passes.skinny_mm import SkinnyMMPass

aten = torch.ops.aten
skinny = torch.ops.compilelm.skinny_mm.default


def linear_pair(x, w1, w2):
    h = torch.mm(x, w1.t())
    return torch.mm(h.relu(), w2.permute(1, 0)), torch.mm(h, h.t())  # the last is not a linear layer


def trace(fn, shapes, device="cuda", symbolic=False):
    """make_fx of fn on fake tensors; with `symbolic`, the first dim of the first input is a symbol."""
    mode = FakeTensorMode(shape_env=ShapeEnv())
    with mode:
        args = [torch.empty(s, device=device) for s in shapes]
        if symbolic:
            m = mode.shape_env.create_unspecified_symint_and_symbol(shapes[0][0], ConstantSource("m"), DimDynamic.DYNAMIC)
            args[0] = torch.empty(m, shapes[0][1], device=device)
        return make_fx(fn)(*args)


def targets(gm):
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


@pytest.mark.parametrize("m, symbolic, expected", [(1, False, 2), (2, False, 2), (3, False, 0), (64, False, 0),
                                                   (3, True, 2)])
def test_linear_mms_become_skinny_mm_where_m_may_be_small(m, symbolic, expected):
    shapes = [(m, 16), (24, 16), (8, 24)]
    gm = trace(linear_pair, shapes, symbolic=symbolic)
    x_val = next(iter(gm.graph.find_nodes(op="placeholder"))).meta["val"]
    assert isinstance(x_val.shape[0], torch.SymInt) == symbolic
    p = SkinnyMMPass()
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
        p = SkinnyMMPass()
        p(gm.graph)
        assert p.matches == expected


def test_skinny_mm_op_cpu_and_opcheck():
    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(3, 40, generator=gen), torch.randn(7, 40, generator=gen)
    torch.testing.assert_close(skinny(x, w), x @ w.t(), rtol=0, atol=0)
    opcheck(skinny, (x, w))
    with pytest.raises(RuntimeError, match="skinny_mm"):
        with FakeTensorMode():
            skinny(torch.empty(3, 40), torch.empty(7, 41))
