"""The pass API: custom pass specs (stage, position), coexistence with the built-in passes, the
`--pass` flag, `compilelm passes list`, and the `compilelm.passes.debug.testing` harness itself."""

import argparse

import pytest
import torch

from compilelm.entrypoints.cli import main as cli_main
from compilelm.entrypoints.engine_args import add_engine_args, engine_config_from_args
from compilelm.graphs import CompileConfig
from compilelm.passes import FusionPass, PassConfig, PassManager
from compilelm.passes.debug.testing import check_pass, run_passes
from compilelm.passes.manager import parse_pass_spec

EXAMPLE = "examples.my_fusion_pass:MeanSquareFusionPass"


def pattern_double_relu(x):
    return torch.relu(x) * 2


def replace_double_relu(x):
    return torch.relu(x + x)


class DoubleReluPass(FusionPass):
    def register(self):
        self.replace(pattern_double_relu, replace_double_relu, [torch.empty(4, 8)])


@pytest.mark.parametrize("spec, parsed", [
    ("a.b:C", ("a.b:C", None, None)),
    ("a.b:C,stage=whole_graph", ("a.b:C", "whole_graph", None)),
    ("a.b:C, after=NoOpEliminationPass", ("a.b:C", None, ("after", "NoOpEliminationPass"))),
    ("a.b:C,stage=post_grad,before=X", ("a.b:C", "post_grad", ("before", "X"))),
])
def test_parse_pass_spec(spec, parsed):
    assert parse_pass_spec(spec) == parsed


@pytest.mark.parametrize("spec, message", [
    ("a.b:C,stage=inductor", "stage must be one of"),
    ("a.b:C,where=X", "options are"),
    ("a.b:C,before=X,after=Y", "one of before=/after="),
])
def test_bad_specs_are_rejected_by_the_config(spec, message):
    with pytest.raises(ValueError, match=message):
        CompileConfig(custom_passes=(spec,))


def test_custom_passes_coexist_with_builtins_in_order():
    specs = (
        "tests.compile.test_pass_api:DoubleReluPass",  # post-grad (class default), at the end
        f"{EXAMPLE},stage=whole_graph,before=RopeAttentionFusionPass",
        f"{EXAMPLE},after=NoOpEliminationPass",
    )
    m = PassManager(PassConfig(), specs)
    assert [p.name for p in m.whole_graph] == ["NoOpEliminationPass", "AllReduceRMSNormFusionPass",
                                               "MeanSquareFusionPass",
                                             "RopeAttentionFusionPass"]
    post = [p.name for p in m.post_grad]
    assert post[:2] == ["NoOpEliminationPass", "MeanSquareFusionPass"] and post[-1] == "DoubleReluPass"
    assert [p.name for p in m.tail] == ["CleanupPass", "InplaceLoweringPass", "CleanupPass"]  # always last
    assert m.whole_graph[2].stage == "whole_graph" and m.post_grad[1].stage == "post_grad"
    with pytest.raises(ValueError, match="no pass 'Nope' in the post_grad stage"):
        PassManager(PassConfig(), (f"{EXAMPLE},before=Nope",))


def test_pass_flag_maps_into_the_compile_config():
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = parser.parse_args(["dummy:smollm2-135m", "-cc", '{"custom_passes": ["x.y:Z"]}',
                              "--pass", EXAMPLE, "--pass", f"{EXAMPLE},stage=whole_graph"])
    config = engine_config_from_args(args)
    assert config.compilation.custom_passes == ("x.y:Z", EXAMPLE, f"{EXAMPLE},stage=whole_graph")


def _rows(out: str) -> dict:
    return {(line.split()[0], line.split()[2]): line.split()[-1] for line in out.splitlines()[1:]}


def test_passes_list_cli(capsys):
    assert cli_main(["passes", "list"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0].split()[-1] == "-O2"
    rows = _rows(out)
    assert rows[("whole_graph", "RopeAttentionFusionPass")] == "yes"
    assert rows[("whole_graph", "NoOpEliminationPass")] == "yes"
    assert "fuse_rope_attention" in out and "InplaceLoweringPass" in out
    assert cli_main(["passes", "list", "-O1", "--pass", f"{EXAMPLE},stage=whole_graph"]) == 0
    rows = _rows(capsys.readouterr().out)
    assert rows[("whole_graph", "RopeAttentionFusionPass")] == "no"  # off at -O1
    assert rows[("whole_graph", "MeanSquareFusionPass")] == "yes"
    assert cli_main(["passes", "list", "--pass", "no_such_module:P"]) == 2
    assert "cannot load" in capsys.readouterr().err


def test_harness_counts_and_numerics():
    def f(x):
        return torch.relu(x) * 2 + 1

    p = DoubleReluPass()
    result = check_pass(f, [torch.randn(6, 8)], [p], matches={p.name: 1},
                        ops_before={"aten.mul.Tensor": 1, "aten.relu.default": 1},
                        ops_after={"aten.mul.Tensor": 0, "aten.add.Tensor": 2}, atol=0.0)
    assert result.max_error == 0.0
    # and it fails loudly when the expectation is wrong, or the rewrite changes the numbers
    with pytest.raises(AssertionError, match="matches"):
        check_pass(f, [torch.randn(6, 8)], [DoubleReluPass()], matches={"DoubleReluPass": 2})

    class WrongPass(FusionPass):
        def register(self):
            self.replace(pattern_double_relu, lambda x: torch.relu(x) * 3, [torch.empty(4, 8)])

    assert run_passes(f, [torch.randn(6, 8)], [WrongPass()]).max_error > 0.1
