"""`compile --dump`: the files are there and the report's numbers agree with the counters."""

import json
import logging
import os
import shutil
import subprocess
import sys

import pytest
import torch

from compilelm.graphs import CompiledModel
from compilelm.passes import CompilePass
from tests.compile.html_page import read_report
from tests.compile.toy_model import ToyModel, inputs


class ScaleEmbeddingPass(CompilePass):
    """A pass with a load-time rewrite only: doubles, then halves, the embedding (the same model)."""

    def applies_to(self, graph):  # no graph rewrite: never run, never recorded
        return False

    def prepare_model(self, model):
        with torch.no_grad():
            model.embed.weight.mul_(2).div_(2)
        return "the embedding scaled by 2 and back"


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def test_dump_contents_and_report(make_config, tmp_path):
    model = ToyModel(num_layers=3)
    dump = tmp_path / "dump"
    config = make_config(dump_dir=str(dump), verify_passes=True,
                         custom_passes=("tests.compile.test_dump:ScaleEmbeddingPass",))
    cm = CompiledModel(model, config, {"toy": "dump"})
    fn = cm.compile()
    with torch.no_grad():
        ids, pos = inputs(5)
        torch.testing.assert_close(fn(ids, pos), model(ids, pos), rtol=1e-5, atol=1e-5)

    for name in ("01_dynamo_graph.py", "02_aten_graph.py", "03_after_whole_graph_passes.py", "04_split_graph.py",
                 "05_stitched_graph.py", "06_dynamo_bytecode_decompiled.py", "split.md", "report.md", "report.html"):
        assert (dump / name).stat().st_size > 0, name
    assert "compilelm_test.attention" in (dump / "02_aten_graph.py").read_text()
    assert (dump / "05_stitched_graph.py").read_text().count("op0(") == 3  # one attention call per layer
    assert "def forward" in (dump / "06_dynamo_bytecode_decompiled.py").read_text() or cm.depyf_error

    report = json.loads((dump / "report.json").read_text())
    # numbers in the report are the counters of this compilation
    assert report["counters"] == cm.counters
    rewrite = "ScaleEmbeddingPass: the embedding scaled by 2 and back"  # the pass's prepare_model, before tracing
    assert report["load_rewrites"] == [rewrite] and rewrite in (dump / "report.md").read_text()
    assert report["counters"]["pieces"] == 4 == len(report["pieces"])
    assert report["counters"]["unique_pieces"] == 3 == len({p["key"] for p in report["pieces"]})
    assert report["counters"]["inductor_compiles"] == 3 == len([f for f in os.listdir(dump / "inductor")
                                                                if f.endswith(".py")])
    # op counts per piece, checked against the toy's structure
    ops = {p["name"]: p["ops"] for p in report["pieces"]}
    assert ops["submod_0"].get("embedding") == 1 and ops["submod_0"].get("mm") == 1  # embed + layer 0's qkv
    assert ops["submod_2"].get("mm") == 4  # o_proj, gate_up, down of layer 0; qkv of layer 1
    assert ops["submod_6"].get("mm") == 3 and ops["submod_6"].get("rsqrt") == 2  # o_proj, gate_up, down; 2 norms
    # every pass ran on the whole graph or on each of the 3 compiled pieces, with matches and time
    by_pass = {(p["stage"], p["pass"]): p for p in report["passes"]}
    assert by_pass[("whole_graph", "NoOpEliminationPass")]["graphs"] == 1
    assert by_pass[("post_grad", "NoOpEliminationPass")]["graphs"] == 3
    assert by_pass[("post_grad", "CleanupPass")]["graphs"] == 6
    for (stage, name), p in by_pass.items():
        runs = [r for r in cm.recorder.records
                if r.name == name and (r.graph == "whole_graph") == (stage == "whole_graph")]
        assert p["matches"] == sum(r.matches for r in runs)
        assert p["seconds"] == pytest.approx(sum(r.seconds for r in runs))
        assert p["max_error"] == 0.0, (stage, name, p)  # --verify: no pass changed the numbers
    # the toy's whole-graph slices x[..., :half] are real; the [0:end] slices of cos/sin are no-ops
    aten_before = (dump / "02_aten_graph.py").read_text().count("aten.slice")
    aten_after = (dump / "03_after_whole_graph_passes.py").read_text().count("aten.slice")
    assert aten_before - aten_after == by_pass[("whole_graph", "NoOpEliminationPass")]["matches"] > 0
    # before/after dumps of every pass of every compiled piece
    for piece in {p["compiled_as"] for p in report["pieces"]}:
        files = sorted(os.listdir(dump / "passes" / piece))
        assert files[:2] == ["00.NoOpEliminationPass.after.py", "00.NoOpEliminationPass.before.py"]
        assert len(files) == 2 * 4
    # torch's structured trace of the compile, for tlparse (one log: Dynamo, AOT, Inductor)
    logs = list((dump / "trace").glob("*.log"))
    assert len(logs) == 1 and "tlparse" in (dump / "report.md").read_text()
    trace = logs[0].read_text()
    assert '"dynamo_start"' in trace and '"inductor_output_code"' in trace
    tlparse = shutil.which("tlparse") or os.path.join(os.path.dirname(sys.executable), "tlparse")
    if os.path.exists(tlparse):  # a test extra
        cmd = report["tlparse"].split("&& ", 1)[1].split()[2:]  # past "tlparse DIR/trace/*.log"
        subprocess.run([tlparse, str(logs[0]), *cmd], check=True, capture_output=True, timeout=120)
        assert (dump / "tlparse" / "index.html").exists()
    assert report["times_s"]["total"] >= report["times_s"]["inductor"] > 0
    _check_html(dump, report)


def _check_html(dump, report):
    """report.html: self-contained, every link resolves, and each part shows what the dump holds."""
    page = read_report(dump)
    for stage, file in [("dynamo", "01_dynamo_graph.py"), ("aten", "02_aten_graph.py"),
                        ("whole-graph", "03_after_whole_graph_passes.py"), ("split", "04_split_graph.py"),
                        ("inductor", "inductor/"), ("stitched", "05_stitched_graph.py")]:
        assert f"stage-{stage}" in page.text and file in page.links, stage
    # the pipeline links each pass to its diffs: the whole-graph no-op elimination removed the slices
    assert "#pass-whole_graph-NoOpEliminationPass" in page.links
    noop = page.text["pass-whole_graph-NoOpEliminationPass"]
    removed = report["passes"][0]["matches"]
    assert page.tags["pass-whole_graph-NoOpEliminationPass"] == "details" and "aten.slice" in noop
    assert f"{removed} matches" in noop and "before line" in noop
    assert "no change" in page.text["pass-post_grad-CleanupPass"]
    # a unique piece: its call sites, its op histogram, its kernels in call order with source lines
    assert "#piece-submod_2" in page.links
    piece = page.text["piece-submod_2"]
    assert "3 call sites" not in piece and "submod_2, submod_4" in piece and "mm" in piece
    first = page.text["kernel-submod_2-dyn-1"]
    assert "extern_kernels.addmm" in first and "toy_model.py:62" in first
    norm = next(k for k in report["kernels"]["submod_2-dyn"] if k["name"].startswith("cpp_fused"))
    assert "toy_model.py:36" in page.text[f"kernel-submod_2-dyn-{norm['call']}"]
    assert "extern \"C\"" in page.text[f"kernel-submod_2-dyn-{norm['call']}"]  # the kernel's code inline
    assert "ScaleEmbeddingPass: the embedding scaled by 2 and back" in page.text["rewrites"]
    assert "pass runs checked, largest error 0" in page.text["verify"]
    assert "compilelm_source" in page.text["cache-key"] and "tlparse" in page.text["summary"]


def test_verify_on_a_warm_cache_compiles_fresh(make_config):
    """`--verify` after a compile that filled the cache: a warm start would run no pass and check
    nothing, so it compiles fresh (and saves nothing) and every pass run is measured."""
    from compilelm.entrypoints.cli_compile import _verify_line
    from compilelm.graphs.dump import report_data

    model = ToyModel(num_layers=2)
    CompiledModel(model, make_config(), {"toy": "warm"}).compile()
    warm = CompiledModel(model, make_config(), {"toy": "warm"})
    warm.compile()
    assert warm.mode == "warm" and not warm.recorder.records  # what --verify used to "check"

    cm = CompiledModel(model, make_config(verify_passes=True), {"toy": "warm"})
    inductor_log, records = logging.getLogger("torch._inductor.standalone_compile"), _Records()
    inductor_log.addHandler(records)
    try:
        cm.compile()
    finally:
        inductor_log.removeHandler(records)
    # a fresh compile is never saved: Inductor's warning that it cannot save one is not for the user
    assert not [m for m in records.messages if "cannot save" in m], records.messages
    assert cm.mode == "cold" and cm.cache.key == warm.cache.key
    assert cm.counters["inductor_compiles"] == 3 and cm.counters["artifacts_loaded"] == 0
    verify = report_data(cm)["verify"]
    assert verify["checked"] == len(cm.recorder.records) > 0 and verify["max_error"] == 0.0
    assert _verify_line(verify).startswith(f"--verify: {verify['checked']} pass runs checked")
    assert "NOTHING was checked" in _verify_line({"checked": 0, "max_error": None, "failed": []})
