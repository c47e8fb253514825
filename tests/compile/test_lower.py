"""Lowering Dynamo's graph one distinct piece at a time (graphs/lower.py) gives the graph
whole-model AOTAutograd gives; a piece that mutates an input falls back to whole-model AOT;
the matcher's per-match retraces are reused within one compile (passes/fusion_pass.py)."""

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import ShapeEnv

import compilelm.graphs.backend as backend
import compilelm.graphs.lower as lower
import compilelm.passes.fusion_pass as fusion_pass
from compilelm.graphs import CompiledModel
from tests.compile.toy_model import SPLIT_OP, ToyModel, inputs


def _aten_ops(make_config, monkeypatch, whole: bool, num_layers: int = 4):
    """Compiles a toy model; returns the whole-model aten graph's ops in order, the number of
    piece traces, and the compiled model."""
    seen, traces = [], []
    compile_aten = backend.CompilelmBackend._compile_aten

    def record(self, gm):
        seen.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return compile_aten(self, gm)

    def count(piece):
        traces.append(piece.name)
        return trace_piece(piece)

    trace_piece = lower.trace_piece
    monkeypatch.setattr(backend.CompilelmBackend, "_compile_aten", record)
    monkeypatch.setattr(lower, "trace_piece", count)
    if whole:
        monkeypatch.setattr(backend, "lower_to_aten", lambda gm, ops: None)
    model = ToyModel(num_layers=num_layers)
    cm = CompiledModel(model, make_config(), {"toy": f"lower-{whole}"})
    fn = cm.compile()
    monkeypatch.undo()
    return seen, traces, model, fn, cm


def test_lowered_graph_is_the_whole_graph_aot_one(make_config, monkeypatch):
    lowered, traces, model, fn, cm = _aten_ops(make_config, monkeypatch, whole=False)
    whole, _, _, _, _ = _aten_ops(make_config, monkeypatch, whole=True)
    assert len(lowered) > 100 and lowered == whole  # the same aten ops in the same order
    assert traces == ["submod_0", "submod_2", "submod_8"]  # first, middle (x3 layers), last: 3 traces
    assert cm.mode == "cold"  # called directly: no AOT wrappers, no Dynamo at run time
    with torch.no_grad():
        for n in (1, 5, 33):
            ids, pos = inputs(n, seed=n)
            torch.testing.assert_close(fn(ids, pos), model(ids, pos), rtol=1e-5, atol=1e-5)


class CountingToyModel(ToyModel):
    """Mutates a buffer in forward: its first piece is not a plain function of its inputs."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.register_buffer("calls", torch.zeros(()), persistent=False)

    def forward(self, input_ids, positions):
        self.calls.add_(1)
        return super().forward(input_ids, positions)


@pytest.mark.parametrize("model_cls, lowered", [(ToyModel, True), (CountingToyModel, False)])
def test_a_piece_mutating_an_input_is_not_lowered_piecewise(model_cls, lowered):
    """lower_to_aten returns None for a graph whose piece mutates an input (the backend then
    runs AOTAutograd on the whole graph, whose wrappers apply the mutation)."""
    results = []

    def backend_fn(gm, example_inputs):
        results.append(lower.lower_to_aten(gm, (SPLIT_OP,)))
        return gm.forward

    model = model_cls(num_layers=2)
    ids, pos = inputs(5)
    torch._dynamo.mark_dynamic(ids, 0)
    torch._dynamo.mark_dynamic(pos, 0)
    with torch.no_grad():
        torch.compile(model, backend=backend_fn, fullgraph=True)(ids, pos)
    torch._dynamo.reset()
    assert len(results) == 1 and (results[0] is not None) == lowered
    if lowered:
        ops = [n.target for n in results[0].graph.nodes if n.op == "call_function"]
        assert ops.count(torch.ops.compilelm_test.attention.default) == 2 and torch.ops.aten.mm.default in ops


def test_a_model_mutating_a_buffer_compiles_through_whole_graph_aot(make_config):
    """The fallback end to end: the dry run hands the mutated buffer back unchanged, and at run
    time AOT's wrappers apply the mutation (Dynamo stays on the call path)."""
    model = CountingToyModel(num_layers=2)
    reference = CountingToyModel(num_layers=2)
    reference.load_state_dict(model.state_dict())
    cm = CompiledModel(model, make_config(), {"toy": "mutating"})
    fn = cm.compile()
    assert cm.mode == "cold (dynamo runtime)"
    before = model.calls.item()
    assert before == reference.calls.item() == 0  # the traced call was a dry run: nothing mutated
    with torch.no_grad():
        for n in (3, 9):
            ids, pos = inputs(n, seed=n)
            torch.testing.assert_close(fn(ids, pos), reference(ids, pos), rtol=1e-5, atol=1e-5)
    assert model.calls.item() == before + 2


def _rope_like(x, w):
    return torch.cat([x * w, -x], -1).relu()


def test_trace_pattern_reuses_a_trace_per_fake_mode_and_shapes(monkeypatch):
    calls = []
    fwd_only = fusion_pass.pm.fwd_only
    monkeypatch.setattr(fusion_pass.pm, "fwd_only", lambda fn, args, **kw: calls.append(fn) or fwd_only(fn, args, **kw))
    mode = FakeTensorMode(shape_env=ShapeEnv())
    with mode:
        x, w = torch.empty(8, 4), torch.empty(4)
        a = fusion_pass.trace_pattern(_rope_like, [x, w])
        b = fusion_pass.trace_pattern(_rope_like, [torch.empty(8, 4), torch.empty(4)])  # same shapes: reused
        c = fusion_pass.trace_pattern(_rope_like, [torch.empty(3, 4), torch.empty(4)])  # new shapes: traced
    assert len(calls) == 2
    assert a is not b and a.graph is not b.graph  # each caller may edit its own copy
    first_shape = lambda gm: tuple(next(iter(gm.graph.find_nodes(op="placeholder"))).meta["val"].shape)  # noqa: E731
    assert a.code == b.code and first_shape(b) == (8, 4) and first_shape(c) == (3, 4)
    for n_a, n_b in zip(a.graph.nodes, b.graph.nodes):
        assert (n_a.op, n_a.target) == (n_b.op, n_b.target)
    b.graph.erase_node(next(iter(b.graph.find_nodes(op="output"))))  # editing a copy leaves the kept trace whole
    with mode:
        d = fusion_pass.trace_pattern(_rope_like, [x, w])
    assert len(calls) == 2 and d.code == a.code
    with FakeTensorMode(shape_env=ShapeEnv()):  # another compile: traced again
        fusion_pass.trace_pattern(_rope_like, [torch.empty(8, 4), torch.empty(4)])
    assert len(calls) == 3
    fusion_pass.trace_pattern(_rope_like, [torch.empty(8, 4), torch.empty(4)])  # real tensors: not kept
    fusion_pass.trace_pattern(_rope_like, [torch.empty(8, 4), torch.empty(4)])
    assert len(calls) == 5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_apply_rope_rounds_like_hugging_face(dtype):
    """The two-halves form gives bit-identical results to HF's x * cat(cos, cos) + rotate_half(x) * cat(sin, sin)."""
    from compilelm.ops.rope import apply_rope

    def hf(x, cos, sin, head_dim):
        n = x.shape[0]
        x = x.view(n, -1, head_dim)
        c = torch.cat([cos, cos], -1).unsqueeze(1).to(x.dtype)
        s = torch.cat([sin, sin], -1).unsqueeze(1).to(x.dtype)
        x1, x2 = x.chunk(2, -1)
        return (x * c + torch.cat([-x2, x1], -1) * s).view(n, -1)

    g = torch.Generator().manual_seed(0)
    x = torch.randn(37, 8 * 64, generator=g).to(dtype)
    cos, sin = torch.randn(37, 64, generator=g).chunk(2, -1)
    assert torch.equal(apply_rope(x, cos, sin, 64), hf(x, cos, sin, 64))
