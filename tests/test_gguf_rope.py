"""Llama 3.1 / 3.2 GGUF files keep their RoPE scaling: a tiny Llama with rope_type llama3 is written
as llama.cpp's converter writes it (q/k permuted, the scaling as the `rope_freqs` tensor, no
metadata), and compilelm's logits from the GGUF match transformers' on the original checkpoint;
transformers' own GGUF reader drops the scaling (the bug this guards against)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from tests.hf_fixtures import tiny_llama, word_tokenizer

# scaling that matters at short positions: head_dim 16 (8 frequencies, wavelengths 6 to 20k) and an
# original context of 64: one frequency is kept, two are smoothed, five divided by the factor
ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64}
IDS = [1, 5, 9, 12, 7, 30, 3, 11, 17, 25, 4, 8, 19, 6, 22, 13, 2, 27, 14, 9, 10, 16, 5, 28]


def _llama_cpp_rope_freqs(head_dim: int, theta: float, scaling: dict) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel rope factors (one per frequency)."""
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old = scaling["original_max_position_embeddings"]
    out = []
    for i in range(0, head_dim, 2):
        wavelen = 2 * math.pi / (1.0 / theta ** (i / head_dim))
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def _write_gguf(hf_dir, path) -> None:
    """The HF checkpoint as llama.cpp's converter writes a Llama 3.1 (F32 tensors)."""
    import gguf
    from safetensors.torch import load_file
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(hf_dir)
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(cfg.rope_theta if hasattr(cfg, "rope_theta") else cfg.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)

    def permute(t: np.ndarray, n_head: int) -> np.ndarray:  # llama.cpp's, for its interleaved RoPE
        return t.reshape(n_head, 2, t.shape[0] // n_head // 2, *t.shape[1:]).swapaxes(1, 2).reshape(t.shape)

    names = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
             "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
             "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
    tensors = load_file(hf_dir / "model.safetensors")
    for name, t in tensors.items():
        a = t.float().numpy()
        if name == "model.embed_tokens.weight":
            out = "token_embd.weight"
        elif name == "model.norm.weight":
            out = "output_norm.weight"
        elif name == "lm_head.weight":
            out = "output.weight"
        else:
            _, _, layer, *rest = name.split(".")
            inner = ".".join(rest[:-1])
            out = f"blk.{layer}.{names[inner]}.weight"
            if inner == "self_attn.q_proj":
                a = permute(a, cfg.num_attention_heads)
            elif inner == "self_attn.k_proj":
                a = permute(a, cfg.num_key_value_heads)
        w.add_tensor(out, np.ascontiguousarray(a))
    theta = cfg.rope_theta if hasattr(cfg, "rope_theta") else cfg.rope_parameters["rope_theta"]
    w.add_tensor("rope_freqs.weight", _llama_cpp_rope_freqs(head_dim, theta, ROPE))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _hf_logprobs(model_dir, unscaled: bool = False) -> list[float]:
    from transformers import AutoModelForCausalLM

    kw = {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}} if unscaled else {}
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, **kw).eval()
    with torch.no_grad():
        logp = model(torch.tensor([IDS])).logits[0].log_softmax(-1)
    return [logp[i, t].item() for i, t in enumerate(IDS[1:])]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("gguf")
    hf = tiny_llama(root / "hf", vocab_size=32, rope_scaling=ROPE, rope_theta=10000.0, max_position_embeddings=128,
                    num_attention_heads=2, num_key_value_heads=1)
    _write_gguf(hf, root / "llama31.gguf")
    word_tokenizer(root / "tok")
    return hf, root / "llama31.gguf", root / "tok"


def test_gguf_config_keeps_the_rope_scaling(files):
    from compilelm.models.gguf_loader import gguf_model_config, open_gguf

    _, path, _ = files
    scaling = gguf_model_config(open_gguf(str(path))).rope_scaling_dict
    factors = scaling["factors"]
    assert scaling["rope_type"] == "freq_factors" and len(factors) == 8  # head_dim 16
    assert factors[0] == 1.0 and 1.0 < factors[1] < factors[2] < ROPE["factor"] == factors[3] == factors[7]


def test_gguf_logits_match_transformers_on_the_original(files):
    from compilelm import LLM, SamplingParams

    hf, path, tok = files
    llm = LLM(str(path), tokenizer=str(tok), enforce_eager=True, max_model_len=64, num_kv_blocks=16)
    out = llm.generate(IDS, SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)[0]
    got = torch.tensor([lp[t].logprob for t, lp in zip(IDS[1:], out.prompt_logprobs[1:])])
    want = torch.tensor(_hf_logprobs(hf))  # the checkpoint's own llama3 scaling
    torch.testing.assert_close(got, want, rtol=0, atol=2e-4)
    unscaled = torch.tensor(_hf_logprobs(hf, unscaled=True))
    assert (got - unscaled).abs().max() > 1e-2  # the scaling matters at these positions


def test_against_transformers_reading_of_the_gguf(files):
    """transformers' GGUF reader (5.x) has no rope-scaling keys for Llama: its model of this file
    is the unscaled one. Should it learn them, its numbers must be compilelm's."""
    from transformers import AutoModelForCausalLM

    hf, path, _ = files
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    with torch.no_grad():
        logp = model(torch.tensor([IDS])).logits[0].log_softmax(-1)
    theirs = torch.tensor([logp[i, t].item() for i, t in enumerate(IDS[1:])])
    scaling = getattr(model.config, "rope_parameters", None) or getattr(model.config, "rope_scaling", None) or {}
    if scaling.get("rope_type", "default") == "default":
        torch.testing.assert_close(theirs, torch.tensor(_hf_logprobs(hf, unscaled=True)), rtol=0, atol=2e-4)
    else:
        torch.testing.assert_close(theirs, torch.tensor(_hf_logprobs(hf)), rtol=0, atol=2e-4)


def test_dequantization_cost_is_stated(tmp_path):
    import gguf

    from compilelm.models.gguf_loader import dequantization_cost, open_gguf

    w = gguf.GGUFWriter(str(tmp_path / "q.gguf"), "llama")
    data = np.random.default_rng(0).standard_normal((64, 256)).astype(np.float32)
    q = gguf.quants.quantize(data, gguf.GGMLQuantizationType.Q8_0)
    w.add_tensor("blk.0.ffn_up.weight", q, raw_shape=q.shape, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    w.add_tensor("output_norm.weight", np.ones(256, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    text = dequantization_cost(open_gguf(str(tmp_path / "q.gguf")), 2)
    assert text.startswith("1 of 2 GGUF tensors are quantized (Q8_0)") and "-> 0 MiB in memory (1.9x)" in text
