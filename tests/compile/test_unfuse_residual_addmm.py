"""UnfuseResidualAddmmPass: addmm(residual, x, w) on CUDA -> mm + add; bias rows, CPU graphs and
scaled addmms stay as they are. Graphs are traced with fake CUDA tensors (no GPU needed); the
rewritten graph is then run on real CPU tensors against the original."""

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

from compilelm.passes.utility.unfuse_residual_addmm import UnfuseResidualAddmmPass

aten = torch.ops.aten


def trace(fn, *shapes, device="cuda"):
    with FakeTensorMode():
        args = [torch.empty(s, device=device) for s in shapes]
        return make_fx(fn)(*args)


def targets(gm):
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


def two_residual_adds(residual, x, w1, w2):
    # a decoder layer's shape: o_proj + residual, then down_proj + that sum
    h = torch.addmm(residual, x, w1)
    return torch.addmm(h, x, w2), h.pow(2).mean(-1)


def test_residual_addmms_become_mm_plus_add():
    gm = trace(two_residual_adds, (5, 8), (5, 8), (8, 8), (8, 8))
    assert targets(gm).count(aten.addmm.default) == 2
    p = UnfuseResidualAddmmPass()
    p(gm.graph)
    gm.recompile()
    assert p.matches == 2
    assert aten.addmm.default not in targets(gm)
    assert targets(gm).count(aten.mm.default) == 2 and targets(gm).count(aten.add.Tensor) == 2
    for node in gm.graph.nodes:
        if node.target in (aten.mm.default, aten.add.Tensor):
            assert node.meta["val"].shape == (5, 8) and node.meta["val"].device.type == "cuda"
    gen = torch.Generator().manual_seed(0)
    args = [torch.randn(s, generator=gen) for s in ((5, 8), (5, 8), (8, 8), (8, 8))]
    for got, expected in zip(gm(*args), two_residual_adds(*args)):
        torch.testing.assert_close(got, expected)


def test_bias_rows_cpu_graphs_and_scaled_addmm_are_kept():
    bias = trace(lambda b, x, w: torch.addmm(b, x, w), (8,), (5, 8), (8, 8))
    cpu = trace(lambda r, x, w: torch.addmm(r, x, w), (5, 8), (5, 8), (8, 8), device="cpu")
    scaled = trace(lambda r, x, w: torch.addmm(r, x, w, beta=2.0), (5, 8), (5, 8), (8, 8))
    for gm in (bias, cpu, scaled):
        p = UnfuseResidualAddmmPass()
        p(gm.graph)
        assert p.matches == 0 and aten.addmm.default in targets(gm)
