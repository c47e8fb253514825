"""A Hugging Face checkpoint at Llama-3.1-8B's widths (2 layers) through the folded norms and
`passes.fuse_norm_gemm` (its prepare_model fold, compilelm/ops/norm_gemm.py), bf16, against
transformers in fp32 on the same weights: teacher-forced log-probabilities of the prompts (prefill
chunks of <= 64 rows: the two-kernel path) and of the greedy tokens (decode at 8 rows in a CUDA
graph).

The norm weights are drawn away from 1, so a fold that lost them shows: the test computes how far
the fp32 model with its two layer norms' weights reset to 1 lands, and requires the folded engine to
be much closer, and about as close as the same engine with the pass off (no fold, the unfused
roundings). Both engines run bf16, so neither matches fp32 exactly.
"""

import gc

import pytest
import torch

from compilelm import LLM, SamplingParams
from compilelm.ops import norm_gemm

pytestmark = pytest.mark.gpu
hopper = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0)
                            or norm_gemm.triton is None, reason="the fold and the fused path are sm_90's")

CONFIG = dict(vocab_size=1000, hidden_size=4096, intermediate_size=4096, num_hidden_layers=2,
              num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=512,
              rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
PROMPT_LEN, NUM_PROMPTS, MAX_TOKENS = 40, 8, 12
DEVICE = "cuda"


def build_checkpoint(path):
    import transformers

    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**CONFIG))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)  # away from 1: the fold must carry them
            else:
                p.normal_(0.0, 0.02)
    model.to(torch.bfloat16).save_pretrained(path, safe_serialization=True)


def reference_logprobs(path, sequences, unit_layer_norms=False):
    """log_softmax of the fp32 model on the bf16 weights, teacher-forced: [seq][pos] -> [vocab]."""
    import transformers

    model = transformers.LlamaForCausalLM.from_pretrained(path, dtype=torch.float32).to(DEVICE).eval()
    if unit_layer_norms:  # what a fold that dropped g would compute
        for layer in model.model.layers:
            layer.input_layernorm.weight.data.fill_(1.0)
            layer.post_attention_layernorm.weight.data.fill_(1.0)
    with torch.inference_mode():
        out = [torch.log_softmax(model(torch.tensor([s], device=DEVICE)).logits[0].float(), -1).cpu()
               for s in sequences]
    del model
    gc.collect()
    torch.cuda.empty_cache()
    return out


def run_engine(path, cache_dir, fuse: bool):
    """Greedy generation with the prompts' and the tokens' log-probabilities: (sequences, [(seq,
    pos, token, logprob)]), whether the norms were folded, and the producer kernel's launches."""
    calls = []
    producer = norm_gemm._mm_add_sumsq
    norm_gemm._mm_add_sumsq = lambda *a: calls.append(a[0].shape[0]) or producer(*a)
    try:
        llm = LLM(model=str(path), dtype="bfloat16", device="cuda", max_model_len=128, max_num_seqs=8,
                  max_num_batched_tokens=64,
                  compilation_config={"cache_dir": str(cache_dir), "cudagraph_capture_sizes": [8],
                                      "passes": {"fuse_norm_gemm": fuse}})
        folded = llm.engine.model_runner.model.model.layers[0].input_layernorm.weight is None
        g = torch.Generator().manual_seed(1)
        prompts = [torch.randint(3, 1000, (PROMPT_LEN,), generator=g).tolist() for _ in range(NUM_PROMPTS)]
        params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0,
                                prompt_logprobs=0)
        outs = llm.generate(prompts, params, use_tqdm=False)
    finally:
        norm_gemm._mm_add_sumsq = producer
    sequences, points = [], []
    for i, (p, o) in enumerate(zip(prompts, outs)):
        tokens = o.outputs[0].token_ids
        sequences.append(p + tokens)
        for pos in range(1, len(p)):
            points.append((i, pos, p[pos], o.prompt_logprobs[pos][p[pos]].logprob))
        for j, t in enumerate(tokens):
            points.append((i, len(p) + j, t, o.outputs[0].logprobs[j][t].logprob))
    del llm
    gc.collect()
    torch.cuda.empty_cache()
    return sequences, points, folded, calls


def mean_error(points, ref):
    # ref[seq][pos - 1] predicts the token at pos
    return sum(abs(lp - ref[i][pos - 1, t].item()) for i, pos, t, lp in points) / len(points)


@hopper
def test_folded_engine_matches_transformers(tmp_path):
    build_checkpoint(tmp_path / "model")
    seq_on, on, folded_on, calls_on = run_engine(tmp_path / "model", tmp_path / "cache_on", True)
    seq_off, off, folded_off, calls_off = run_engine(tmp_path / "model", tmp_path / "cache_off", False)
    assert folded_on and not folded_off
    assert calls_on and max(calls_on) <= 64 and not calls_off  # prefill chunks and the decode capture ran it
    ref_on, ref_off = reference_logprobs(tmp_path / "model", seq_on), reference_logprobs(tmp_path / "model", seq_off)
    unit = reference_logprobs(tmp_path / "model", seq_on, unit_layer_norms=True)
    err_on, err_off = mean_error(on, ref_on), mean_error(off, ref_off)
    err_unit = mean_error([(i, pos, t, ref_on[i][pos - 1, t].item()) for i, pos, t, _ in on], unit)
    print(f"mean |logprob - fp32|: folded + fused {err_on:.4f}, pass off {err_off:.4f}; "
          f"fp32 with unit layer norms {err_unit:.4f} ({len(on)} tokens)")
    bound = 1.5 * err_off + 0.01
    assert err_on <= bound
    assert err_unit >= 4 * bound  # the comparison would catch a fold that lost the norm weights
