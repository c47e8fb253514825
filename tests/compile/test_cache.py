"""The compile cache: warm starts skip Dynamo and Inductor; the key is portable; pass edits
invalidate it; concurrent compiles and corrupt files are survived."""

import importlib
import json
import os
import shutil
import subprocess
import sys

import torch

from compilelm.graphs import CompiledModel
from tests.compile.toy_model import ToyModel, inputs

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


def _check(fn, model):
    with torch.no_grad():
        for n in (1, 6):
            ids, pos = inputs(n)
            torch.testing.assert_close(fn(ids, pos), model(ids, pos), rtol=1e-5, atol=1e-5)


def test_cold_then_warm(make_config):
    model = ToyModel(num_layers=3)
    cold = CompiledModel(model, make_config(), {"toy": "warm"})
    _check(cold.compile(), model)
    assert cold.counters["inductor_compiles"] == 3 and cold.counters["cache_misses"] == 1

    torch.manual_seed(1)
    other = ToyModel(num_layers=3)  # same shapes, other weights: the compiled pieces still apply
    warm = CompiledModel(other, make_config(), {"toy": "warm"})
    _check(warm.compile(), other)
    assert warm.mode == "warm" and warm.cache.key == cold.cache.key
    assert warm.counters["cache_hits"] == 1 and warm.counters["artifacts_loaded"] == 3
    assert warm.counters["dynamo_traces"] == 0 and warm.counters["inductor_compiles"] == 0
    assert warm.inductor_counters.get("fxgraph_cache_miss", 0) == 0  # no Inductor codegen at all


def test_key_is_portable(make_config, tmp_path):
    model = ToyModel(num_layers=2)
    a = CompiledModel(model, make_config(cache_dir=str(tmp_path / "a")), {"toy": "portable"})
    a.compile()
    factors = json.dumps(a.factors)
    assert str(tmp_path) not in factors and os.path.expanduser("~") not in factors
    shutil.copytree(tmp_path / "a", tmp_path / "b")  # e.g. shipped to another host
    b = CompiledModel(model, make_config(cache_dir=str(tmp_path / "b")), {"toy": "portable"})
    _check(b.compile(), model)
    assert b.cache.key == a.cache.key and b.mode == "warm" and b.counters["inductor_compiles"] == 0
    with open(os.path.join(b.cache.dir, "cache_key_factors.json")) as f:
        assert json.load(f)["model"] == {"toy": "portable"}


PASS_SOURCE = '''
from compilelm.passes import CompilePass

class CountMatmuls(CompilePass):
    """Rewrites nothing; counts aten.mm nodes."""
    def run(self, graph):
        return sum(n.target is __import__("torch").ops.aten.mm.default for n in graph.nodes){suffix}
'''


def test_editing_a_pass_invalidates_the_cache(make_config, tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))
    module = "compilelm_test_custom_pass"
    (tmp_path / f"{module}.py").write_text(PASS_SOURCE.format(suffix=""))
    config = make_config(custom_passes=(f"{module}:CountMatmuls",))
    model = ToyModel(num_layers=2)

    first = CompiledModel(model, config, {"toy": "uuid"})
    first.compile()
    assert sum(r.matches for r in first.recorder.records if r.name == "CountMatmuls") > 0  # the pass ran

    (tmp_path / f"{module}.py").write_text(PASS_SOURCE.format(suffix=" + 0  # edited"))
    importlib.reload(importlib.import_module(module))
    second = CompiledModel(model, config, {"toy": "uuid"})
    assert second.manager.uuids()["post_grad.CountMatmuls"] != first.manager.uuids()["post_grad.CountMatmuls"]
    assert second.cache.key != first.cache.key
    second.compile()
    assert second.counters["cache_misses"] == 1 and second.counters["inductor_compiles"] == 3
    assert second.inductor_counters.get("fxgraph_cache_miss", 0) == 3  # Inductor's own cache also missed

    (tmp_path / f"{module}.py").write_text(PASS_SOURCE.format(suffix=""))
    importlib.reload(importlib.import_module(module))
    third = CompiledModel(model, config, {"toy": "uuid"})
    third.compile()
    assert third.cache.key == first.cache.key and third.mode == "warm"


def test_corrupt_artifact_is_recompiled(make_config):
    model = ToyModel(num_layers=2)
    first = CompiledModel(model, make_config(), {"toy": "corrupt"})
    first.compile()
    victim = sorted(os.listdir(os.path.join(first.cache.dir, "pieces")))[0]
    with open(os.path.join(first.cache.dir, "pieces", victim), "wb") as f:
        f.write(b"not an artifact")
    second = CompiledModel(model, make_config(), {"toy": "corrupt"})
    _check(second.compile(), model)
    assert second.counters["inductor_compiles"] == 1 and second.counters["artifacts_loaded"] == 2
    third = CompiledModel(model, make_config(), {"toy": "corrupt"})
    third.compile()
    assert third.mode == "warm"


def test_two_processes_compile_at_once(tmp_path, inductor_dir):
    cache = str(tmp_path / "shared")
    cmd = [sys.executable, os.path.join(REPO, "tests", "compile", "compile_worker.py"), cache, inductor_dir, "2"]
    procs = [subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(2)]
    results = []
    for p in procs:
        out, err = p.communicate(timeout=600)
        assert p.returncode == 0, err[-3000:]
        results.append(json.loads(out.strip().splitlines()[-1]))
    assert results[0]["key"] == results[1]["key"]
    assert all(r["max_error"] < 1e-4 for r in results)
    # Whatever the interleaving, the cache left behind is complete and valid: a third process
    # starts warm, with no Dynamo and no Inductor.
    out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    warm = json.loads(out.stdout.strip().splitlines()[-1])
    assert warm["mode"] == "warm" and warm["inductor_compiles"] == 0 and warm["dynamo_traces"] == 0
    assert warm["max_error"] < 1e-4
