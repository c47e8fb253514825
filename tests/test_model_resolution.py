"""A model given as vLLM users give it: a Hugging Face repo id in the local HF cache (offline),
`--revision`, a folder whose weights the index file names, a `.bin`-only folder, `--tokenizer`,
`--chat-template`, `--served-model-name`. Every checkpoint is built here from a tiny random model."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import httpx
import pytest
import torch

from tests.hf_fixtures import WORDS, hf_cache_repo, tiny_llama, word_tokenizer
from tests.server.utils import RemoteServer

SMALL = ["--enforce-eager", "--max-model-len", "64", "--num-kv-blocks", "16"]


def _cli(*args, env=None):
    return subprocess.run([sys.executable, "-m", "compilelm.entrypoints.cli", *args], capture_output=True,
                          text=True, timeout=300, env={**os.environ, **(env or {})})


@pytest.fixture(scope="module")
def hf_home(tmp_path_factory):
    """An HF_HOME whose cache holds acme/tiny: main -> commit a..a, tag v2 -> commit b..b (a
    different model, with a tokenizer)."""
    root = tmp_path_factory.mktemp("hf")
    src = tiny_llama(root / "src", vocab_size=128)
    hf_cache_repo(root / "hub", "acme/tiny", src, commit="a" * 40, ref="main")
    src2 = tiny_llama(root / "src2", vocab_size=len(WORDS) + 4)
    word_tokenizer(src2)
    hf_cache_repo(root / "hub", "acme/tiny", src2, commit="b" * 40, ref="v2")
    return root


@pytest.fixture
def offline(hf_home, monkeypatch):
    monkeypatch.setenv("HF_HOME", str(hf_home))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    return hf_home


def test_repo_id_runs_from_the_hf_cache(offline):
    r = _cli("generate", "hi", "--model", "acme/tiny", "--max-tokens", "3", *SMALL)
    assert r.returncode == 0, r.stderr
    assert "weights loaded: acme/tiny" in r.stderr


def test_repo_id_not_in_the_cache_names_repo_and_cache(offline):
    r = _cli("generate", "hi", "--model", "acme/absent", *SMALL)
    assert r.returncode == 2
    assert "'acme/absent'" in r.stderr and str(offline / "hub") in r.stderr and "HF_HUB_OFFLINE" in r.stderr
    assert "Traceback" not in r.stderr


def test_revision_picks_the_snapshot(offline):
    from compilelm.models.loader import resolve_model

    main = resolve_model("acme/tiny")
    assert main.kind == "hf" and main.name == "acme/tiny" and main.path.endswith("a" * 40)
    assert resolve_model("acme/tiny", revision="v2").path.endswith("b" * 40)
    assert resolve_model("acme/tiny", revision="b" * 40).path.endswith("b" * 40)
    with pytest.raises(FileNotFoundError, match="revision nope"):
        resolve_model("acme/tiny", revision="nope")


def test_download_dir_is_the_cache(hf_home, monkeypatch, tmp_path):
    from compilelm.models.loader import resolve_model

    monkeypatch.setenv("HF_HOME", str(tmp_path))  # an empty cache: only --download-dir has it
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert resolve_model("acme/tiny", download_dir=str(hf_home / "hub")).path.endswith("a" * 40)


def _prompt_logprobs(model_dir, ids):
    from compilelm import LLM, SamplingParams

    llm = LLM(str(model_dir), enforce_eager=True, max_model_len=64, num_kv_blocks=16)
    out = llm.generate(ids, SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)[0]
    return [lp[t].logprob for t, lp in zip(ids[1:], out.prompt_logprobs[1:])]


def test_index_file_picks_the_weights_of_a_mistral_folder(tmp_path):
    """Sharded weights + model.safetensors.index.json + Mistral's consolidated.safetensors (the
    same weights under other names): the index's files are loaded, and give transformers' numbers."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    d = tiny_llama(tmp_path / "mistral", vocab_size=128, max_shard_size="40KB")
    index = json.loads((d / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    merged = {}
    for f in set(index["weight_map"].values()):
        merged.update(load_file(d / f))
    save_file({k.replace("model.layers.", "layers.").replace("self_attn.q_proj", "attention.wq"): v
               for k, v in merged.items()}, d / "consolidated.safetensors")
    ids = [1, 5, 9, 12, 7, 30, 3]
    got = _prompt_logprobs(d, ids)
    ref = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    with torch.no_grad():
        logp = ref(torch.tensor([ids])).logits[0].float().log_softmax(-1)
    want = [logp[i, t].item() for i, t in enumerate(ids[1:])]
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=0, atol=1e-4)


def test_bin_only_checkpoint_is_refused(tmp_path):
    d = tiny_llama(tmp_path / "m", vocab_size=128)
    os.remove(d / "model.safetensors")
    (d / "pytorch_model.bin").write_bytes(b"not unpickled")
    r = _cli("generate", "hi", "--model", str(d), *SMALL)
    assert r.returncode == 2 and "PyTorch .bin" in r.stderr and "safetensors only" in r.stderr, r.stderr


def test_chat_template_that_names_a_missing_file_is_a_flag_error():
    r = _cli("generate", "hi", "--model", "dummy:smollm2-135m", "--chat-template", "/no/such/template.jinja")
    assert r.returncode == 2 and "--chat-template" in r.stderr and "does not exist" in r.stderr


def test_chat_template_inline_or_file(tmp_path):
    from compilelm.models.tokenizer import load_chat_template

    assert load_chat_template("{{ messages[0].content }}\\n") == "{{ messages[0].content }}\n"
    (tmp_path / "t.jinja").write_text("{{ 'x' }}")
    assert load_chat_template(str(tmp_path / "t.jinja")) == "{{ 'x' }}"


def test_serve_repo_id_with_tokenizer_chat_template_and_names(offline, tmp_path):
    """`compilelm serve acme/tiny --revision v2 --tokenizer DIR --chat-template FILE
    --served-model-name a b`: both names are listed and served, the template renders the prompt."""
    tok = word_tokenizer(tmp_path / "tok")
    (tmp_path / "chat.jinja").write_text(
        "{% for m in messages %}{{ m.role }} : {{ m.content }} {% endfor %}"
        "{% if add_generation_prompt %}assistant :{% endif %}")
    srv = RemoteServer(["acme/tiny", "--revision", "v2", "--tokenizer", str(tok), "--chat-template",
                        str(tmp_path / "chat.jinja"), "--served-model-name", "a", "b", *SMALL])
    try:
        with httpx.Client(base_url=srv.url, timeout=60) as c:
            assert [m["id"] for m in c.get("/v1/models").json()["data"]] == ["a", "b"]
            r = c.post("/tokenize", json={"model": "b", "messages": [{"role": "user", "content": "the cat"}],
                                          "return_token_strs": True}).json()
            assert r["token_strs"] == ["user", ":", "the", "cat", "assistant", ":"]
            chat = c.post("/v1/chat/completions", json={
                "model": "a", "messages": [{"role": "user", "content": "hello world"}], "max_tokens": 2,
                "temperature": 0})
            assert chat.status_code == 200, chat.text
            assert chat.json()["usage"]["prompt_tokens"] == 6
    finally:
        srv.close()
