"""generation_config.json applied as vLLM applies it: the model's default sampling for the fields a
request leaves unset (Qwen3's temperature 0.6, top_p 0.95, top_k 20), max_new_tokens as a cap, its
extra EOS ids ending generation; `--generation-config vllm | DIR`, `--override-generation-config`."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.hf_fixtures import tiny_llama
from tests.server.utils import InProcessServer, RemoteServer

QWEN3_LIKE = {"bos_token_id": 1, "do_sample": True, "eos_token_id": [2, 7], "pad_token_id": 0,
              "temperature": 0.6, "top_k": 20, "top_p": 0.95, "repetition_penalty": 1.0, "max_new_tokens": 5}
SMALL = dict(max_model_len=64, num_kv_blocks=16, enforce_eager=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = tiny_llama(tmp_path_factory.mktemp("gen") / "m", vocab_size=64)
    (d / "generation_config.json").write_text(json.dumps(QWEN3_LIKE))
    return d


def test_defaults_from_the_file(model_dir, tmp_path):
    from compilelm.models.generation_config import load_generation_defaults
    from compilelm.models.loader import resolve_model

    source = resolve_model(str(model_dir))
    auto = load_generation_defaults(source)
    assert auto.sampling_dict() == {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "max_tokens": 5}
    assert auto.eos_token_ids == (2, 7)
    neutral = load_generation_defaults(source, "vllm")
    assert neutral.sampling_dict() == {} and neutral.eos_token_ids == (2, 7)  # vLLM keeps the EOS ids
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": 0.3, "top_k": 50}))
    other = load_generation_defaults(source, str(tmp_path), {"min_p": 0.1})
    assert other.sampling_dict() == {"temperature": 0.3, "min_p": 0.1}  # top_k 50 is transformers' default
    with pytest.raises(ValueError, match="unknown key 'beams'"):
        load_generation_defaults(source, "auto", {"beams": 2})


def test_llm_api_uses_the_defaults(model_dir):
    from compilelm import LLM, SamplingParams

    llm = LLM(str(model_dir), **SMALL)
    params = llm.get_default_sampling_params()
    assert (params.temperature, params.top_p, params.top_k, params.max_tokens) == (0.6, 0.95, 20, 5)
    out = llm.generate([5, 6, 8], use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) <= 5
    forced = llm.generate([5, 6, 8], SamplingParams(temperature=0, max_tokens=10,
                                                    logits_processors=[_force(7)]), use_tqdm=False)[0]
    assert forced.outputs[0].token_ids == [7] and forced.outputs[0].finish_reason == "stop"  # an EOS id
    assert LLM(str(model_dir), generation_config="vllm", **SMALL).get_default_sampling_params().temperature == 1.0


def _force(token: int):
    def processor(output_ids, logits):
        logits[token] = logits.max() + 100
        return logits
    return processor


def _capturing_server(model_dir, **engine_kw):
    """The real app around an engine of `model_dir`, recording every SamplingParams it gets."""
    from compilelm.entrypoints.openai.api_server import build_app
    from compilelm.entrypoints.openai.metrics import ServerMetrics
    from compilelm.entrypoints.openai.serving_engine import ServerState
    from compilelm.llm import make_engine_config
    from compilelm.runtime.async_engine import AsyncLLMEngine
    from compilelm.runtime.engine import LLMEngine

    config = make_engine_config(str(model_dir), **SMALL, **engine_kw)
    async_engine = AsyncLLMEngine(lambda: LLMEngine(config))
    seen = []
    generate = async_engine.generate
    async_engine.generate = lambda rid, ids, params, **kw: seen.append(params) or generate(rid, ids, params, **kw)
    state = ServerState(async_engine, ["m"])
    state.metrics = async_engine.metrics = ServerMetrics("m", lambda: async_engine.stats)
    return InProcessServer(build_app(state), state), seen


@pytest.mark.parametrize("mode", ["auto", "vllm"])
def test_server_fills_unset_fields_and_the_request_wins(model_dir, mode):
    srv, seen = _capturing_server(model_dir, generation_config=mode)
    try:
        with httpx.Client(base_url=srv.url, timeout=60) as c:
            c.post("/v1/completions", json={"prompt": [5, 6], "max_tokens": 3}).raise_for_status()
            c.post("/v1/completions", json={"prompt": [5, 6], "max_tokens": 30, "temperature": 0,
                                            "top_p": 0.5}).raise_for_status()
    finally:
        srv.close()
    unset, given = seen
    if mode == "auto":
        assert (unset.temperature, unset.top_p, unset.top_k, unset.max_tokens) == (0.6, 0.95, 20, 3)
        assert (given.temperature, given.top_p, given.top_k, given.max_tokens) == (0.0, 0.5, 20, 5)
    else:
        assert (unset.temperature, unset.top_p, unset.top_k, unset.max_tokens) == (1.0, 1.0, 0, 3)
        assert given.max_tokens == 30


def test_serve_cli_applies_max_new_tokens_and_eos_ids(model_dir):
    srv = RemoteServer([str(model_dir), "--enforce-eager", "--max-model-len", "64", "--num-kv-blocks", "16"])
    try:
        with httpx.Client(base_url=srv.url, timeout=60) as c:
            r = c.post("/v1/completions", json={"prompt": [5, 6], "max_tokens": 40, "ignore_eos": True}).json()
            assert r["usage"]["completion_tokens"] == 5 and r["choices"][0]["finish_reason"] == "length"
            r = c.post("/v1/completions", json={"prompt": [5, 6], "logit_bias": {"7": 100}}).json()
            assert r["choices"][0]["finish_reason"] == "stop" and r["choices"][0]["stop_reason"] == 7
        assert "Default sampling parameters have been overridden" in srv.log()
    finally:
        srv.close()
