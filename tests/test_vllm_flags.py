"""A vLLM command line pasted as is: vLLM's flags (and their `--no-` forms), `--config FILE.yaml`,
`--max_model_len` spellings, `-O.key=value`, `--dtype auto`'s rule, and the flags that cannot
apply here warning once with the reason."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from compilelm.entrypoints.argv import expand_argv
from compilelm.entrypoints.cli import build_parser
from tests.hf_fixtures import tiny_llama, word_tokenizer

SMALL = ["--enforce-eager", "--max-model-len", "64", "--num-kv-blocks", "16"]


def _parse(*argv):
    parser = build_parser()
    return parser.parse_args(expand_argv(list(argv), parser))


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "compilelm.entrypoints.cli", *args], capture_output=True,
                          text=True, timeout=300)


def test_serve_accepts_a_pasted_vllm_command_line():
    args = _parse("serve", "Qwen/Qwen3-8B", "--enable-prefix-caching", "--enable-chunked-prefill",
                  "--disable-log-requests", "--enable-log-requests", "--uvicorn-log-level", "warning",
                  "--trust-remote-code", "--kv-cache-dtype", "fp8", "--chat-template", "t.jinja",
                  "--tokenizer", "Qwen/Qwen3-8B", "--generation-config", "vllm", "--revision", "main",
                  "--served-model-name", "qwen", "qwen3", "--max_num_seqs", "8", "--gpu-memory-utilization",
                  "0.8", "--allowed-origins", '["https://a.example"]', "--disable-uvicorn-access-log",
                  "--disable-log-stats", "-tp", "1", "-O3")
    assert args.model_tag == "Qwen/Qwen3-8B" and args.enable_prefix_caching and args.enable_chunked_prefill
    assert args.log_level == "warning" and args.kv_cache_dtype == "fp8" and args.max_num_seqs == 8
    assert args.served_model_name == ["qwen", "qwen3"] and args.allowed_origins == ["https://a.example"]
    assert args.optimization_level == 3
    off = _parse("serve", "m", "--no-enable-prefix-caching", "--no-enable-chunked-prefill")
    assert off.enable_prefix_caching is False and off.enable_chunked_prefill is False
    sizes = _parse("serve", "m", "--max-model-len", "32k", "--max-num-batched-tokens=8K")
    assert (sizes.max_model_len, sizes.max_num_batched_tokens) == (32000, 8192)
    assert _parse("serve", "m", "--max-model-len", "25.6k").max_model_len == 25600


def test_config_yaml_then_command_line(tmp_path):
    (tmp_path / "c.yaml").write_text(
        "model: acme/tiny\nmax_model_len: 128\nenable-prefix-caching: false\nserved-model-name: [a, b]\n"
        "compilation-config:\n  use_cache: false\nport: 9000\ntrust-remote-code: true\n")
    args = _parse("serve", "--config", str(tmp_path / "c.yaml"), "--max-model-len", "256")
    assert args.model == "acme/tiny" and args.max_model_len == 256 and args.port == 9000
    assert args.enable_prefix_caching is False and args.trust_remote_code is True
    assert args.served_model_name == ["a", "b"] and json.loads(args.compilation_config) == {"use_cache": False}
    args = _parse("serve", "m", "--config", str(tmp_path / "c.yaml"))  # the positional model stays first
    assert args.model_tag == "m" and args.served_model_name == ["a", "b"]


def test_config_file_errors_name_the_flag(tmp_path):
    (tmp_path / "bad.yaml").write_text("max-model-len: [1\n")
    for path, words in ((tmp_path / "bad.yaml", "not valid YAML"), (tmp_path / "none.yaml", "cannot read"),
                        (tmp_path / "c.json", "not a .yaml")):
        r = _cli("generate", "hi", "--config", str(path))
        assert r.returncode == 2 and "--config" in r.stderr and words in r.stderr, r.stderr


def test_override_generation_config_keys_are_checked():
    r = _cli("generate", "hi", "--model", "dummy:smollm2-135m", "--override-generation-config", '{"beams": 2}')
    assert r.returncode == 2 and "--override-generation-config: unknown key(s) beams" in r.stderr, r.stderr


def test_dotted_compilation_overrides():
    from compilelm.entrypoints.engine_args import engine_config_from_args

    args = _parse("generate", "hi", "--model", "dummy:smollm2-135m", "-O.level=1", "-O.use_cache", "false",
                  "--compilation-config", '{"compile_sizes": [4]}', "-cc.max_autotune=true")
    assert json.loads(args.compilation_config) == {"compile_sizes": [4], "level": 1, "use_cache": False,
                                                   "max_autotune": True}
    comp = engine_config_from_args(args).compilation
    assert (comp.level, comp.use_cache, comp.compile_sizes, comp.max_autotune) == (1, False, (4,), True)
    assert _parse("compile", "m", "-O=3").optimization_level == 3


def test_generate_runs_with_vllm_flags_and_warns_once_for_inapplicable_ones(tmp_path):
    model = tiny_llama(tmp_path / "m", vocab_size=32)
    word_tokenizer(tmp_path / "m")
    r = _cli("generate", "the cat", "--model", str(model), "--trust-remote-code", "--kv-cache-dtype", "fp8",
             "--enable-prefix-caching", "--no-enable-chunked-prefill", "--generation-config", "vllm",
             "--max-tokens", "2", *SMALL)
    assert r.returncode == 0, r.stderr
    assert r.stderr.count("--trust-remote-code: ignored") == 1
    assert "--kv-cache-dtype" not in r.stderr  # fp8 is real now: no warning
    assert "KV cache (float8_e4m3fn)" in r.stderr


def test_chunked_prefill_off_raises_the_token_budget_to_max_model_len():
    from compilelm.llm import make_engine_config
    from compilelm.runtime.engine import LLMEngine

    config = make_engine_config("dummy:smollm2-135m", model_overrides={"num_hidden_layers": 1}, max_model_len=4096,
                                num_kv_blocks=300, enforce_eager=True, enable_chunked_prefill=False,
                                enable_prefix_caching=False)
    engine = LLMEngine(config)
    assert engine.config.scheduler.max_num_batched_tokens == 4096
    assert engine.config.scheduler.enable_chunked_prefill is False
    assert engine.kv_cache_manager.block_pool.enable_caching is False


def _fake_gpu(monkeypatch, name, gib):
    import types

    import torch

    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda index: types.SimpleNamespace(name=name, total_memory=gib * 2**30))


@pytest.mark.parametrize("gpu, gib, usage, want", [
    ("NVIDIA H200", 141, "llm_class", (16384, 1024)), ("NVIDIA H100 80GB HBM3", 80, "openai_api_server", (8192, 1024)),
    ("NVIDIA A100-SXM4-80GB", 80, "llm_class", (8192, 256)), ("NVIDIA L4", 24, "openai_api_server", (2048, 256)),
])
def test_step_limits_default_as_vllm_picks_them_for_the_gpu_and_entry_point(monkeypatch, gpu, gib, usage, want):
    """vLLM's EngineArgs defaults (0.26.0): a large non-A100 GPU gets 16384 / 8192 tokens (LLM /
    server) and 1024 sequences; others 8192 / 2048 and 256. A value the user gives wins."""
    import torch

    from compilelm.config import scheduler_defaults
    from compilelm.llm import make_engine_config

    _fake_gpu(monkeypatch, gpu, gib)
    config = make_engine_config("dummy:qwen3-0.6b", device="cuda", usage_context=usage)
    assert config.scheduler is None  # the engine settles it: scheduler_defaults(its device, its usage)
    assert scheduler_defaults(torch.device("cuda"), usage) == {"max_num_batched_tokens": want[0],
                                                                "max_num_seqs": want[1]}
    given = make_engine_config("dummy:qwen3-0.6b", device="cuda", usage_context=usage, max_num_seqs=64).scheduler
    assert (given.max_num_batched_tokens, given.max_num_seqs) == (want[0], 64)


def test_step_limits_on_the_cpu_and_through_serve_flags(monkeypatch):
    import torch

    from compilelm.config import scheduler_defaults
    from compilelm.entrypoints.engine_args import engine_config_from_args

    assert scheduler_defaults(torch.device("cpu"), "llm_class") == {"max_num_batched_tokens": 2048, "max_num_seqs": 256}
    with pytest.raises(ValueError, match="usage_context must be one of"):
        scheduler_defaults(torch.device("cpu"), "batch")
    _fake_gpu(monkeypatch, "NVIDIA H200", 141)
    args = _parse("serve", "dummy:qwen3-0.6b", "--device", "cuda", "--max-num-seqs", "8")
    sched = engine_config_from_args(args, usage_context="openai_api_server").scheduler
    assert (sched.max_num_batched_tokens, sched.max_num_seqs) == (8192, 8)


@pytest.mark.parametrize("device, checkpoint, want", [
    ("cuda", "bfloat16", "bfloat16"), ("cuda", "float16", "float16"), ("cuda", "float32", "bfloat16"),
    ("cuda", None, "bfloat16"), ("cpu", "bfloat16", "float32"), ("cpu", "float32", "float32")])
def test_dtype_auto_follows_the_checkpoint(tmp_path, monkeypatch, device, checkpoint, want):
    import torch

    from compilelm.models.dtype import resolve_dtype
    from compilelm.models.loader import ModelSource

    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    cfg = {"architectures": ["LlamaForCausalLM"]} | ({"torch_dtype": checkpoint} if checkpoint else {})
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    source = ModelSource("hf", str(tmp_path), "m")
    assert resolve_dtype("auto", source, device) == want
    assert resolve_dtype("float16", source, device) == "float16"
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: False)
    if device == "cuda" and checkpoint in ("float32", None):
        assert resolve_dtype("auto", source, device) == "float16"  # no bfloat16 on this GPU


def test_engine_settles_dtype_auto(tmp_path):
    from compilelm.llm import make_engine_config
    from compilelm.runtime.engine import LLMEngine

    model = tiny_llama(tmp_path / "m", vocab_size=32, torch_dtype="bfloat16")
    engine = LLMEngine(make_engine_config(str(model), max_model_len=64, num_kv_blocks=16, enforce_eager=True))
    assert engine.config.dtype == "float32"  # CPU: auto is float32 whatever the checkpoint says
    assert os.path.basename(engine.source.path) == "m"
