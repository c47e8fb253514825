"""Passes on small graphs: op counts before/after and numerics (graph before vs after)."""

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from compilelm.passes import (
    CompilePass,
    FusionPass,
    InplaceLoweringPass,
    NoOpEliminationPass,
    PassConfig,
    PassManager,
    load_pass,
    max_error,
    pass_uuid,
    register_inplace,
    snapshot,
)

aten = torch.ops.aten


def trace(fn, *args):
    """Symbolic (dynamic-shape) aten graph of fn, with fake values on every node."""
    return make_fx(fn, tracing_mode="symbolic")(*args)


def count(gm, target) -> int:
    return sum(n.target == target for n in gm.graph.nodes)


def run_pass(p: CompilePass, gm):
    before = snapshot(gm.graph)
    p(gm.graph)
    gm.recompile()
    return before, gm


# -- no-op elimination -----------------------------------------------------------------------

def test_noop_elimination_counts_and_numerics():
    def f(x, w):
        n = x.shape[0]
        a = x.view(n, 4, 16).view(n, 64)  # reshape chain back to the same shape
        b = a[:, :]  # slices covering the whole tensor
        c = b[0:n]
        h = (c @ w).reshape(n, 2, 32).reshape(n * 2, 32)  # chain collapsed to one reshape
        return h.relu()

    gm = trace(f, torch.randn(5, 64), torch.randn(64, 64))
    assert count(gm, aten.view.default) == 4 and count(gm, aten.slice.Tensor) >= 2
    p = NoOpEliminationPass()
    before, after = run_pass(p, gm)
    assert count(after, aten.view.default) == 1  # only the real [n*2, 32] reshape is left
    assert count(after, aten.slice.Tensor) == 0
    assert p.matches >= 5
    assert max_error(before, after) == 0.0


def test_noop_elimination_keeps_real_slices_and_reshapes():
    def f(x):
        return x[1:].reshape(-1, 8) + 1, x[:, :3]  # traces as slice(x, 0, 1), view, slice(slice(x, 0, 0, end), 1, 0, 3)

    gm = trace(f, torch.randn(6, 16))
    p = NoOpEliminationPass()
    before, after = run_pass(p, gm)
    assert p.matches == 1  # only the whole-dimension slice of dim 0 goes
    assert [(n.args[1], n.args[2]) for n in after.graph.nodes if n.target == aten.slice.Tensor] == [(0, 1), (1, 0)]
    assert count(after, aten.view.default) == 1
    assert max_error(before, after) == 0.0


# -- in-place lowering -----------------------------------------------------------------------

@torch.library.custom_op("compilelm_test::scale", mutates_args=())
def scale(x: torch.Tensor, alpha: float) -> torch.Tensor:
    return x * alpha


@scale.register_fake
def _(x, alpha):
    return torch.empty_like(x)


@torch.library.custom_op("compilelm_test::scale_", mutates_args=("x",))
def scale_(x: torch.Tensor, alpha: float) -> None:
    x.mul_(alpha)


register_inplace(torch.ops.compilelm_test.scale.default, torch.ops.compilelm_test.scale_.default, {0: "x"})
SCALE, SCALE_ = torch.ops.compilelm_test.scale.default, torch.ops.compilelm_test.scale_.default


def test_inplace_lowering_when_input_dies():
    def f(x):
        t = x + 1  # an intermediate, dead after scale
        return torch.ops.compilelm_test.scale(t, 3.0) @ x.T

    gm = trace(f, torch.randn(4, 8))
    p = InplaceLoweringPass()
    before, after = run_pass(p, gm)
    assert p.matches == 1
    assert count(after, SCALE) == 0 and count(after, SCALE_) == 1
    assert max_error(before, after) == 0.0


@pytest.mark.parametrize("case", ["graph_input", "used_later", "view_used_later"])
def test_inplace_lowering_refuses_observable_overwrites(case):
    def f(x):
        if case == "graph_input":
            return torch.ops.compilelm_test.scale(x, 2.0)
        t = x * 2
        v = t.view(-1)
        y = torch.ops.compilelm_test.scale(t, 3.0)
        return y + (t if case == "used_later" else v.view(t.shape))

    gm = trace(f, torch.randn(4, 8))
    p = InplaceLoweringPass()
    before, after = run_pass(p, gm)
    assert p.matches == 0 and count(after, SCALE) == 1
    assert max_error(before, after) == 0.0


def test_register_inplace_validates():
    with pytest.raises(ValueError, match="not mutable"):
        register_inplace(SCALE, SCALE, {0: "x"})
    with pytest.raises(ValueError, match="every output"):
        register_inplace(SCALE, SCALE_, {1: "x"})


# -- the fusion-pass API ----------------------------------------------------------------------

@torch.library.custom_op("compilelm_test::fused_mul_add", mutates_args=())
def fused_mul_add(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return torch.addcmul(x, x, y)


@fused_mul_add.register_fake
def _(x, y):
    return torch.empty_like(x)


def pattern_mul_add(x, y):
    return x * y + x


def replace_mul_add(x, y):
    return torch.ops.compilelm_test.fused_mul_add(x, y)


class MulAddFusionPass(FusionPass):
    def register(self):
        self.replace(pattern_mul_add, replace_mul_add, [torch.empty(2, 4), torch.empty(2, 4)])


def test_fusion_pass_in_a_few_lines():
    def f(a, b):
        return (a * b + a).relu() + (b * a + b)  # two occurrences

    gm = trace(f, torch.randn(3, 4), torch.randn(3, 4))
    p = MulAddFusionPass()
    before, after = run_pass(p, gm)
    assert p.matches == 2 and p.seconds > 0
    FUSED = torch.ops.compilelm_test.fused_mul_add.default
    assert count(after, FUSED) == 2 and count(after, aten.mul.Tensor) == 0 and count(after, aten.add.Tensor) == 1
    assert max_error(before, after) < 1e-6


# -- identity, manager, loading ----------------------------------------------------------------

def test_uuid_follows_source_and_config(tmp_path, monkeypatch):
    src = ("from compilelm.passes import CompilePass\nclass P(CompilePass):\n"
           "    def run(self, graph):\n        return 0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "uuid_pass_a.py").write_text(src)
    (tmp_path / "uuid_pass_b.py").write_text(src + "# edited\n")
    a, b = load_pass("uuid_pass_a:P"), load_pass("uuid_pass_b:P")
    assert a().uuid() != b().uuid()  # same class, different file contents
    assert pass_uuid(a, {}) != pass_uuid(a, {"eps": 1e-6})  # config enters the uuid
    assert a().uuid() == a().uuid()


def test_manager_order_switches_and_uuid():
    on = PassManager(PassConfig())
    assert [p.name for p in on.whole_graph] == ["NoOpEliminationPass", "AllReduceRMSNormFusionPass",
                                                "RopeAttentionFusionPass"]
    assert [p.name for p in on.post_grad + on.tail] == ["NoOpEliminationPass", "UnfuseResidualAddmmPass",
                                                        "RouteLinearPass", "RMSNormLinearFusionPass",
                                                        "SiluMulLinearFusionPass",
                                                        "QKVRopeFusionPass", "NormGemmFusionPass",
                                                        "RMSNormQuantFusionPass",
                                                        "SiluMulQuantFusionPass", "QuantLinearFusionPass",
                                                        "CleanupPass", "InplaceLoweringPass", "CleanupPass"]
    off = PassManager(PassConfig(eliminate_noops=False, lower_inplace=False, fuse_rope_attention=False,
                                 fuse_norm_quant=False, fuse_act_quant=False, fuse_allreduce_rms=False,
                                 unfuse_residual_addmm=False, route_linear=False, fuse_norm_linear=False,
                                 fuse_act_linear=False, fuse_qkv_rope=False, fuse_norm_gemm=False,
                                 fuse_quant_linear=False))
    assert [p.name for p in off.passes] == ["CleanupPass"]
    assert on.uuid() != off.uuid()
    custom = PassManager(PassConfig(), custom_passes=("tests.compile.test_passes:MulAddFusionPass",))
    assert [p.name for p in custom.post_grad][-1] == "MulAddFusionPass"
    assert custom.uuid() != on.uuid()


@pytest.mark.parametrize("spec, message", [
    ("no_colon", "must look like"),
    ("compilelm.nonexistent_module:X", "cannot load"),
    ("compilelm.passes:PassConfig", "not a compilelm.passes.CompilePass"),
])
def test_load_pass_errors(spec, message):
    with pytest.raises(ValueError, match=message):
        load_pass(spec)


def test_manager_runs_inside_inductor(inductor_dir, monkeypatch):
    """The manager as Inductor's post-grad custom pass: it runs, is timed, and the result is right."""
    from compilelm.passes import PassRecorder

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", inductor_dir)

    manager = PassManager(PassConfig())
    recorder = PassRecorder(verify=True)
    manager.set_recorder(recorder)

    def f(x, w):
        return torch.nn.functional.silu(x @ w).view(-1, 4, 8).view(-1, 32)

    x, w = torch.randn(6, 16), torch.randn(16, 32)
    compiled = torch.compile(f, backend="inductor", options={"post_grad_custom_post_pass": manager,
                                                             "fx_graph_cache": False})
    with torch._functorch.config.patch(enable_autograd_cache=False):  # make Inductor really run
        torch.testing.assert_close(compiled(x, w), f(x, w))
    assert [r.name for r in recorder.records] == ["NoOpEliminationPass", "CleanupPass", "InplaceLoweringPass",
                                                  "CleanupPass"]
    assert all(r.max_error == 0.0 for r in recorder.records)
