"""The examples of docs/writing_a_pass.md run: as a script, and registered in a real compile."""

import json
import subprocess
import sys
from pathlib import Path

import torch

from compilelm.graphs import CompiledModel
from tests.compile.toy_model import ToyModel, inputs

ROOT = Path(__file__).resolve().parents[2]


def test_my_fusion_pass_script_runs():
    out = subprocess.run([sys.executable, "examples/my_fusion_pass.py"], cwd=ROOT, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "MeanSquareFusionPass: 2 matches" in out.stdout
    assert "examples.mean_square.default(" in out.stdout


def test_my_fusion_pass_in_a_compile(make_config, tmp_path):
    from examples.my_fusion_pass import MeanSquareFusionPass

    model = ToyModel(num_layers=2)
    # dumping bypasses the caches, so every piece really runs the pass
    config = make_config(custom_passes=("examples.my_fusion_pass:MeanSquareFusionPass",), use_cache=False,
                         dump_dir=str(tmp_path / "dump"))
    compiled = CompiledModel(model, config, {"toy": "examples"})
    fn = compiled.compile()
    ids, pos = inputs(9)
    with torch.no_grad():
        torch.testing.assert_close(fn(ids, pos), model(ids, pos), atol=1e-5, rtol=1e-5)
    custom = compiled.manager.post_grad[-1]
    assert isinstance(custom, MeanSquareFusionPass)
    # every RMSNorm of every unique piece: first (input norm), middle (post-attention norm +
    # next input norm), last (post-attention norm + final norm)
    assert custom.matches == 1 + 2 + 2
    report = json.loads((tmp_path / "dump" / "report.json").read_text())
    assert [p["matches"] for p in report["passes"] if p["pass"] == "MeanSquareFusionPass"] == [5]
