"""report.html and --profile on a real dump of the default model (slow: one compile of
SmolLM2-135M with --dump --verify --profile, shared with the browser test)."""

import json

import pytest

from tests.compile.html_page import read_report

pytestmark = pytest.mark.slow


def test_report_page_of_the_default_model(default_model_dump):
    dump = default_model_dump
    report = json.loads((dump / "report.json").read_text())
    page = read_report(dump)  # self-contained, every link resolves
    pipeline = page.text["pipeline"]
    for stage in ("Dynamo graph", "aten graph", "whole-graph passes", "split", "pieces", "Inductor", "stitched graph"):
        assert stage in pipeline
    assert "RopeAttentionFusionPass (30)" in pipeline and "31 pieces" in pipeline and "submod_2 ×29" in pipeline
    # the RoPE + attention fusion, once per layer: layer 0 (which also gathers cos/sin) and one more
    # region shown, the 28 layers like it counted
    rope = page.text["pass-whole_graph-RopeAttentionFusionPass"]
    assert "30 matches" in rope and "(and 28 more like it, up to numbers)" in rope
    assert "unified_attention_rotated" in rope and "rope_cache" in rope and "rotary_embedding.py" in rope
    piece = page.text["piece-submod_2"]
    assert "29 call sites" in piece and "submod_58" in piece
    kernels = report["kernels"]["submod_2-dyn"]
    norm = next(k for k in kernels if k["name"].startswith("cpp_fused") and "rsqrt" in k["name"])
    text = page.text[f"kernel-submod_2-dyn-{norm['call']}"]
    assert "compilelm/ops/norm.py:21" in text and 'extern "C"' in text
    assert "none" in page.text["rewrites"] and "pass runs checked" in page.text["verify"]
    assert "compilelm_source" in page.text["cache-key"]
    assert "decode: 4 × 1 new tokens at context 64" in page.text["profile"]
    assert "Unfused elementwise chains" in page.text["profile"]


def test_profile_of_the_default_model_adds_up_to_the_step(default_model_dump):
    dump = default_model_dump
    profile = json.loads((dump / "profile" / "profile.json").read_text())
    assert [s["name"] for s in profile["steps"]] == ["decode", "prefill"]
    for step in profile["steps"]:
        families = {f["family"]: f["ms"] for f in step["families"]}
        assert {"GEMM", "attention", "norm", "launch gaps"} <= set(families), families
        assert sum(families.values()) == pytest.approx(step["step_ms"], rel=0.05)  # the table sums to the step
        assert step["measured_ms"] > 0 and (dump / step["trace"]).exists()
        # the kernels of the layers' piece are matched to their kernel-table entries (nodes, source)
        layer = [k for k in step["kernels"] if k["compiled_as"] == "submod_2" and isinstance(k["call"], int)]
        assert layer and all(k["count"] == 29 for k in layer) and any(k["source"] for k in layer)
        assert any(c["piece"] == "submod_2" for c in step["chains"])
    assert "## Profile: decode 4x64" in (dump / "report.md").read_text()
