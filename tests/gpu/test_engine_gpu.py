"""The engine on a GPU: compiled + CUDA graphs == eager == Hugging Face transformers, greedy.

Small Llama-3 and Qwen3 shaped models with random weights are built with transformers from a
config, saved as safetensors and loaded by compilelm (an HF directory without tokenizer files:
prompts are token ids). fp32 everywhere so that greedy tokens compare exactly.
"""

import gc

import pytest
import torch

from compilelm import LLM, SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("no_tf32")]

COMMON = dict(vocab_size=1000, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
              num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=512,
              rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
SHAPES = {
    "llama3": ("LlamaConfig", "LlamaForCausalLM",
               dict(rope_theta=500000.0, rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                       "high_freq_factor": 4.0,
                                                       "original_max_position_embeddings": 128})),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(rope_theta=1000000.0)),
    # wider than the norm + QKV fusion takes (MAX_HIDDEN 2048): the QKV projection is a plain
    # linear and takes RoPE in as `qkv_rope` (Llama-3.1-8B's path)
    "llama3_wide": ("LlamaConfig", "LlamaForCausalLM", dict(rope_theta=500000.0, hidden_size=2304)),
}
MAX_TOKENS = 16
# varied lengths: with a 64-token step budget, prefill chunks and decodes share steps; 5 requests
# decode together at the end (padded to the captured size 8)
PROMPT_LENS = (7, 33, 90, 12, 150)


def build_hf_model(shape: str, path):
    import transformers

    config_cls, model_cls, extra = SHAPES[shape]
    torch.manual_seed(0)
    config = getattr(transformers, config_cls)(**{**COMMON, **extra})
    model = getattr(transformers, model_cls)(config)
    for p in model.parameters():  # larger than the default init: logits far apart, no near-ties
        if p.dim() > 1:
            torch.nn.init.normal_(p, std=0.08)
    model.save_pretrained(path, safe_serialization=True)
    return model


def prompts():
    g = torch.Generator().manual_seed(1)
    return [torch.randint(3, 1000, (n,), generator=g).tolist() for n in PROMPT_LENS]


def run_compilelm(path, device="cuda", **kwargs):
    llm = LLM(model=str(path), dtype="float32", device=device, max_model_len=256, max_num_seqs=16,
              max_num_batched_tokens=64, **kwargs)
    runner = llm.engine.model_runner
    replays = []
    if runner.cuda_graphs is not None:
        replay = runner.cuda_graphs.replay
        runner.cuda_graphs.replay = lambda size: replays.append(size) or replay(size)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    tokens = [o.outputs[0].token_ids for o in llm.generate(prompts(), params, use_tqdm=False)]
    del llm, runner
    gc.collect()
    torch.cuda.empty_cache()
    return tokens, replays


def run_hf(model):
    model = model.to("cuda").eval()
    out = []
    with torch.inference_mode():
        for p in prompts():
            ids = torch.tensor([p], device="cuda")
            gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_TOKENS,
                                 min_new_tokens=MAX_TOKENS, do_sample=False, pad_token_id=0)
            out.append(gen[0, len(p):].tolist())
    return out


@pytest.mark.parametrize("shape", list(SHAPES))
def test_graphs_eager_and_hf_agree(shape, tmp_path):
    hf_model = build_hf_model(shape, tmp_path / "model")
    expected = run_hf(hf_model)
    del hf_model
    eager, eager_replays = run_compilelm(tmp_path / "model", enforce_eager=True)
    graphs, graph_replays = run_compilelm(
        tmp_path / "model",
        compilation_config={"cache_dir": str(tmp_path / "cache"), "cudagraph_capture_sizes": [1, 2, 4, 8, 16]})
    assert eager_replays == []
    # the last decode steps (all 5 requests decoding) replay the size-8 graph, padded from 5
    assert 8 in graph_replays and set(graph_replays) <= {1, 2, 4, 8}
    assert eager == expected
    assert graphs == expected


def test_graph_padding_rows_are_harmless(tmp_path):
    """Requests decoding alone and together (batch 1..5 padded to 1, 2, 4, 8) give the same tokens
    as each request run by itself: padding rows never write the KV cache of a real request."""
    build_hf_model("llama3", tmp_path / "model")
    kwargs = dict(compilation_config={"cache_dir": str(tmp_path / "cache"), "cudagraph_capture_sizes": [1, 2, 4, 8]})
    together, _ = run_compilelm(tmp_path / "model", **kwargs)
    llm = LLM(model=str(tmp_path / "model"), dtype="float32", device="cuda", max_model_len=256, max_num_seqs=16,
              max_num_batched_tokens=64, **kwargs)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    alone = [llm.generate([p], params, use_tqdm=False)[0].outputs[0].token_ids for p in prompts()]
    assert together == alone
