"""The `compilelm` command line, run as a user would (a subprocess)."""

import subprocess
import sys

import pytest


def _cli(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "compilelm.entrypoints.cli", *args],
                          capture_output=True, text=True, timeout=timeout)


def test_help_lists_subcommands():
    r = _cli("--help")
    assert r.returncode == 0
    assert "generate" in r.stdout


def test_generate_on_tiny_dummy_model():
    r = _cli("generate", "Hello", "--model", "dummy:smollm2-135m", "--max-tokens", "4",
             "--max-model-len", "128", "--num-kv-blocks", "16", "--enforce-eager")
    assert r.returncode == 0, r.stderr
    assert "Loading weights" in r.stderr or "weights loaded" in r.stderr
    # the engine's gc.freeze() is undone at exit: nothing it froze is reported leaked (nanobind
    # extensions such as Triton's print dozens of lines otherwise)
    assert "leaked" not in r.stderr, r.stderr[-2000:]


@pytest.mark.parametrize("args, flag", [
    (["--max-tokens", "0"], "--max-tokens"),
    (["--temperature", "-1"], "--temperature"),
    (["--dtype", "int3"], "--dtype"),
    (["--max-model-len", "1"], "--max-model-len"),
    (["--tensor-parallel-size", "2"], "--tensor-parallel-size"),  # 9 heads do not split in 2
    (["--tensor-parallel-size", "0"], "--tensor-parallel-size"),
    (["--custom-all-reduce-min-bytes", "-5"], "--custom-all-reduce-min-bytes"),
])
def test_bad_flag_is_named(args, flag):
    r = _cli("generate", "Hi", "--model", "dummy:smollm2-135m", *args)
    assert r.returncode == 2
    assert flag in r.stderr, r.stderr
    assert "Traceback" not in r.stderr


def test_missing_model_is_clear():
    r = _cli("generate", "Hi", "--model", "/no/such/dir")
    assert r.returncode == 2 and "does not exist" in r.stderr


@pytest.mark.slow
def test_generate_default_model_matches_api():
    from compilelm import LLM, SamplingParams
    r = _cli("generate", "The capital of France is", "--max-tokens", "8", "--enforce-eager",
             "--max-model-len", "512")
    assert r.returncode == 0, r.stderr
    ref = LLM(enforce_eager=True, max_model_len=512).generate(
        "The capital of France is", SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    assert r.stdout.rstrip("\n") == ref[0].outputs[0].text


def test_engine_freezes_startup_objects():
    """An engine (`compilelm serve`'s, the LLM API's) freezes what startup left alive, so that the
    collections its steps trigger no longer walk it; the engine still runs."""
    import gc

    from compilelm import SamplingParams
    from compilelm.llm import make_engine_config
    from compilelm.runtime.engine import LLMEngine

    config = make_engine_config("dummy:smollm2-135m", model_overrides={"num_hidden_layers": 1}, max_model_len=64,
                                enforce_eager=True)
    before = gc.get_freeze_count()
    try:
        engine = LLMEngine(config)
        assert gc.get_freeze_count() > before + 1000
        engine.add_request("r", [5, 6, 7], SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))
        outs = []
        while engine.has_unfinished_requests():
            outs += engine.step()
        assert outs[-1].finished and len(outs[-1].outputs[0].token_ids) == 2
    finally:
        gc.unfreeze()


@pytest.mark.parametrize("args, message", [
    (["--enable-auto-tool-choice", "--tool-call-parser", "nope"], "--tool-call-parser: unknown parser 'nope'"),
    (["--enable-auto-tool-choice"], "--enable-auto-tool-choice needs --tool-call-parser"),
    (["--reasoning-parser", "o1"], "--reasoning-parser: unknown parser 'o1' (choose from deepseek_r1, qwen3)"),
])
def test_serve_names_a_bad_parser_before_loading(args, message):
    r = _cli("serve", "dummy:smollm2-135m", "--port", "1", *args)
    assert r.returncode == 2 and message in r.stderr, r.stderr
    assert "Traceback" not in r.stderr
