"""The compiler on the real models (slow tier): compiled vs eager greedy tokens and logprobs on
the default model and on dummy Qwen3 / Llama-3 models, split count == layers + 1, and the
`compilelm compile --dump` CLI on a Llama model."""

import json

import pytest

from compilelm import LLM, SamplingParams
from compilelm.entrypoints.cli import main as cli_main
from compilelm.graphs import compile_counters
from tests.e2e.conftest import MAX_NEW_TOKENS, PROMPTS

pytestmark = pytest.mark.slow

GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS, logprobs=5)


def _cc(tmp_path, inductor_dir) -> dict:
    return {"cache_dir": str(tmp_path / "cache"), "inductor_cache_dir": inductor_dir}


def _compare(compiled_outs, eager_outs, atol=1e-4):
    for c, e in zip(compiled_outs, eager_outs):
        assert c.outputs[0].token_ids == e.outputs[0].token_ids
        for step_c, step_e in zip(c.outputs[0].logprobs, e.outputs[0].logprobs):
            assert step_c.keys() == step_e.keys()
            for tok in step_e:
                assert step_c[tok].logprob == pytest.approx(step_e[tok].logprob, abs=atol)


def test_default_model_compiled_equals_eager(tmp_path, inductor_dir):
    before = compile_counters.snapshot()
    compiled = LLM(compilation_config=_cc(tmp_path, inductor_dir))
    delta = compile_counters.delta(before)
    layers = compiled.engine.model_config.num_hidden_layers
    assert delta["pieces"] == layers + 1 and delta["unique_pieces"] == 3
    eager = LLM(enforce_eager=True)
    _compare(compiled.generate(PROMPTS, GREEDY, use_tqdm=False), eager.generate(PROMPTS, GREEDY, use_tqdm=False))


@pytest.mark.parametrize("preset", ["qwen3-0.6b", "llama-3.2-1b"])
def test_dummy_models_compiled_equal_eager(preset, tmp_path, inductor_dir):
    overrides = {"num_hidden_layers": 3, "vocab_size": 4096}
    prompts = [[1, 17, 230, 9, 44, 1000, 5], [1, 3000, 12], list(range(100, 140))]
    params = SamplingParams(temperature=0.0, max_tokens=8, logprobs=3)
    before = compile_counters.snapshot()
    compiled = LLM(f"dummy:{preset}", model_overrides=overrides, compilation_config=_cc(tmp_path, inductor_dir))
    assert compile_counters.delta(before)["pieces"] == 3 + 1
    eager = LLM(f"dummy:{preset}", model_overrides=overrides, enforce_eager=True)
    _compare(compiled.generate(prompts, params, use_tqdm=False), eager.generate(prompts, params, use_tqdm=False))


def test_compile_cli_dump_on_llama(tmp_path, inductor_dir, capsys):
    dump = tmp_path / "dump"
    cc = json.dumps(_cc(tmp_path, inductor_dir))
    assert cli_main(["compile", "dummy:smollm2-135m", "--dump", str(dump), "--verify", "-cc", cc]) == 0
    out = capsys.readouterr().out
    report = json.loads((dump / "report.json").read_text())
    assert report["counters"]["pieces"] == 30 + 1 and report["counters"]["unique_pieces"] == 3
    assert "pieces: 31 (3 unique)" in out
    assert len(report["pieces"]) == 31 and report["depyf_error"] is None
    assert all(p["max_error"] == 0.0 for p in report["passes"])
    stitched = (dump / "05_stitched_graph.py").read_text()
    assert stitched.count("op0(") == 30  # one unified_attention per layer, between the pieces
    assert "'model.layers.29.self_attn.attn'" in stitched
    # Without --dump the same command compiles into the cache, and a second run loads it.
    assert cli_main(["compile", "dummy:smollm2-135m", "-cc", cc]) == 0
    assert cli_main(["compile", "dummy:smollm2-135m", "-cc", cc]) == 0
    assert "compiled (warm)" in capsys.readouterr().out
    # ... and so does the engine: `compilelm compile` pre-warms the cache `serve` uses
    before = compile_counters.snapshot()
    LLM("dummy:smollm2-135m", compilation_config=json.loads(cc))
    delta = compile_counters.delta(before)
    assert delta["cache_hits"] == 1 and delta["inductor_compiles"] == 0 and delta["dynamo_traces"] == 0


def test_compile_cli_rejects_eager(capsys):
    assert cli_main(["compile", "dummy:smollm2-135m", "--enforce-eager"]) == 2
    assert "nothing to compile" in capsys.readouterr().err
