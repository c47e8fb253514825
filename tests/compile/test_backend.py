"""The compile pipeline on a toy model: split, dedup, numerics, no recompiles, static sizes."""

import torch
from torch._dynamo.utils import counters as dynamo_counters

from compilelm.graphs import CompiledModel, compile_counters, compile_model
from tests.compile.toy_model import ToyModel, ToyModelWithGlobal, inputs


def test_split_count_dedup_and_numerics(make_config):
    model = ToyModel(num_layers=4)
    before = compile_counters.snapshot()
    cm = CompiledModel(model, make_config(), {"toy": "split"})
    fn = cm.compile()
    delta = compile_counters.delta(before)
    assert delta["dynamo_traces"] == 1
    assert delta["pieces"] == 4 + 1  # one piece between consecutive attention ops, plus the ends
    # first, middle (x3, identical) and last piece: three Inductor compiles
    assert delta["unique_pieces"] == 3 and delta["inductor_compiles"] == 3
    assert [p["compiled_as"] for p in cm.backend.pieces] == ["submod_0", "submod_2", "submod_2", "submod_2", "submod_8"]
    assert cm.mode == "cold"  # every input is a model tensor or an argument: no Dynamo at run time
    with torch.no_grad():
        for n in (1, 2, 7, 64):
            ids, pos = inputs(n)
            torch.testing.assert_close(fn(ids, pos), model(ids, pos), rtol=1e-5, atol=1e-5)


def test_no_recompiles_across_batch_sizes(make_config):
    model = ToyModel(num_layers=2)
    fn = compile_model(model, make_config(), {"toy": "recompile"})
    before, graphs = compile_counters.snapshot(), dynamo_counters["stats"]["unique_graphs"]
    with torch.no_grad():
        for n in range(1, 301):
            out = fn(*inputs(n, seed=n))
            assert out.shape == (n, 64)
    assert compile_counters.delta(before) == dict.fromkeys(before, 0)
    assert dynamo_counters["stats"]["unique_graphs"] == graphs


def test_dynamo_runtime_fallback_never_recompiles(make_config):
    """A model that reads a global tensor keeps Dynamo on the call path; with guards dropped it
    still never recompiles, whatever the batch size."""
    model = ToyModelWithGlobal(num_layers=2)
    cm = CompiledModel(model, make_config(), {"toy": "global"})
    fn = cm.compile()
    assert cm.mode == "cold (dynamo runtime)"
    before, graphs = compile_counters.snapshot(), dynamo_counters["stats"]["unique_graphs"]
    with torch.no_grad():
        for n in (1, 2, 3, 17, 100, 300):
            ids, pos = inputs(n)
            torch.testing.assert_close(fn(ids, pos), model(ids, pos), rtol=1e-5, atol=1e-5)
    assert compile_counters.delta(before)["dynamo_traces"] == 0
    assert dynamo_counters["stats"]["unique_graphs"] == graphs


def test_static_compile_sizes(make_config):
    model = ToyModel(num_layers=2)
    before = compile_counters.snapshot()
    cm = CompiledModel(model, make_config(compile_sizes=(4,)), {"toy": "sizes"})
    fn = cm.compile()
    # every unique piece is compiled twice: for the symbolic range and for 4 tokens
    assert compile_counters.delta(before)["inductor_compiles"] == 2 * compile_counters.delta(before)["unique_pieces"]
    with torch.no_grad():
        for n in (3, 4, 5):  # 4 runs the static compile, 3 and 5 the symbolic one
            ids, pos = inputs(n)
            torch.testing.assert_close(fn(ids, pos), model(ids, pos), rtol=1e-5, atol=1e-5)


def test_level_zero_is_eager(make_config):
    model = ToyModel(num_layers=1)
    assert compile_model(model, make_config(level=0), {}) == model.forward


def test_two_models_of_one_class_in_one_process(make_config):
    """Guard-free Dynamo entries must not leak from one model to another of the same class."""
    a, b = ToyModel(num_layers=1), ToyModel(num_layers=3)
    fa = compile_model(a, make_config(), {"toy": "a"})
    fb = compile_model(b, make_config(), {"toy": "b"})
    ids, pos = inputs(5)
    with torch.no_grad():
        torch.testing.assert_close(fa(ids, pos), a(ids, pos), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(fb(ids, pos), b(ids, pos), rtol=1e-5, atol=1e-5)


def test_no_splitting_ops_compiles_one_piece(make_config):
    """splitting_ops=[] keeps the whole forward in one piece (what a full CUDA graph needs)."""
    model = ToyModel(num_layers=2)
    cm = CompiledModel(model, make_config(splitting_ops=()), {"toy": "whole"})
    fn = cm.compile()
    assert cm.counters["pieces"] == 1 and cm.counters["inductor_compiles"] == 1
    with torch.no_grad():
        ids, pos = inputs(6)
        torch.testing.assert_close(fn(ids, pos), model(ids, pos), rtol=1e-5, atol=1e-5)


def test_wrap_pieces_hook(make_config):
    """Every piece call goes through the wrapper (the CUDA-graph hook), one per call site."""
    model = ToyModel(num_layers=3)
    cm = CompiledModel(model, make_config(), {"toy": "wrap"})
    fn = cm.compile()
    calls = []

    def wrap(site, runner):
        def call(*args):
            calls.append(site)
            return runner(*args)
        return call

    cm.wrap_pieces(wrap)
    with torch.no_grad():
        ids, pos = inputs(5)
        torch.testing.assert_close(fn(ids, pos), model(ids, pos), rtol=1e-5, atol=1e-5)
    assert calls == ["submod_0", "submod_2", "submod_4", "submod_6"]


def test_use_cache_false_writes_nothing(make_config, tmp_path):
    model = ToyModel(num_layers=1)
    for _ in range(2):
        cm = CompiledModel(model, make_config(use_cache=False), {"toy": "nocache"})
        cm.compile()
        assert cm.mode == "cold" and cm.counters["cache_hits"] == 0
    assert not (tmp_path / "cache").exists()
