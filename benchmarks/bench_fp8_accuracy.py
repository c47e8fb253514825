"""Accuracy of W8A8 FP8 against the unquantized model (CPU, the default model unless --model):
top-1 agreement of the next-token prediction and mean / max |logit difference| over a fixed text,
one eager forward each, for every FP8 scheme compilelm serves:

    channel-dynamic   per-channel weights, per-token activations (--quantization fp8; compressed-tensors FP8_DYNAMIC)
    tensor-dynamic    per-tensor weights (per packed shard), per-token activations (quant_method fp8, dynamic)
    tensor-static     per-tensor weights, static per-tensor activation scales calibrated on another
                      text (compressed-tensors FP8; quant_method fp8, static)
    block-dynamic     weights in B x B blocks, activations per 1 x B group (Qwen3-*-FP8 / DeepSeek
                      with B = 128; --block 64 on models whose widths are not multiples of 128)

The weights are quantized in memory the way a checkpoint of each format stores them and installed
on the layers with the linear methods the checkpoint loader attaches (the loader itself is tested
byte for byte in tests/test_fp8_checkpoints.py). Also prints each scheme's greedy answer to one chat.

FP8 KV cache rows (--kv-cache-dtype fp8: float8_e4m3fn K/V, scales 1.0 as vLLM's default without
checkpoint scales), against the same model with its KV cache in the model dtype:

    kv-fp8            unquantized linears, fp8 KV cache: what the KV cache's quantization costs
    kv-fp8+channel-dynamic   W8A8 (--quantization fp8) and the fp8 KV cache together, against the
                      unquantized model with the model-dtype cache

    python benchmarks/bench_fp8_accuracy.py [--model M] [--block 64] [--dtype bfloat16] [--kv-only]
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.common import print_table, write_result  # noqa: E402

TEXT = (
    "The history of the city begins with a small fishing village on the river. Over the centuries it grew "
    "into a market town, and by the nineteenth century it had become an important centre of trade and "
    "industry, known for its textile mills and its university. The railway arrived in 1840, bringing "
    "workers from the countryside and goods from the ports. Its population doubled within thirty years. "
    "In the twentieth century the mills closed one by one, and the city turned to education, medicine and "
    "services. Today the old warehouses by the water hold galleries, restaurants and small companies, and "
    "the university is the largest employer. Visitors come for the cathedral, the covered market and the "
    "long walk along the river, where herons still fish below the bridges. Every summer a festival fills "
    "the streets with music, and in winter the market square becomes an ice rink.")
CALIBRATION = ("Photosynthesis is the process by which green plants use sunlight, water and carbon dioxide to "
               "make sugar and oxygen. It takes place mainly in the leaves, inside small structures called "
               "chloroplasts, which contain the green pigment chlorophyll.")
SCHEMES = ("channel-dynamic", "tensor-dynamic", "tensor-static", "block-dynamic")
KV_SCHEMES = ("kv-fp8", "kv-fp8+channel-dynamic")


def forward_logits(llm, prompt: list[int]) -> torch.Tensor:
    """fp32 logits [n, vocab] of one eager forward over `prompt` (fresh KV cache)."""
    from compilelm.forward_context import AttentionMetadata, ForwardContext, set_forward_context
    runner, n = llm.engine.model_runner, len(prompt)
    dev = runner.device
    caches = {k: (torch.zeros_like(a), torch.zeros_like(b)) for k, (a, b) in runner.kv_caches.items()}
    bs = llm.engine.config.cache.block_size
    blocks = list(range(1, -(-n // bs) + 1))
    i32 = dict(dtype=torch.int32, device=dev)
    meta = AttentionMetadata(torch.arange(bs, bs + n, device=dev), torch.tensor([0, n], **i32),
                             torch.tensor([n], **i32), torch.tensor([blocks], **i32), n, n)
    with torch.inference_mode(), set_forward_context(ForwardContext(meta, caches, runner.kv_scales)):
        hidden = runner.model(torch.tensor(prompt, device=dev), torch.arange(n, device=dev))
        return runner.model.compute_logits(hidden).float().cpu()


def _shards(layer) -> list[tuple[int, int]]:
    offsets = getattr(layer, "shard_offsets", None)
    return list(offsets.values()) if offsets else [(0, layer.weight.shape[0])]


def install(layer, w: torch.Tensor, scheme: str, block: int) -> None:
    """Quantizes the fp32 weight w [out, in] as a checkpoint of `scheme` stores it and installs it."""
    from torch import nn

    from compilelm.layers.quantization import Fp8BlockLinearMethod, Fp8LinearMethod
    fp8, fmax = torch.float8_e4m3fn, 448.0
    weights = scheme.split("-")[0]
    if weights == "block":
        out_f, in_f = w.shape
        pad = -out_f % block
        wp = torch.nn.functional.pad(w, (0, 0, 0, pad))
        scale = wp.reshape(-1, block, in_f // block, block).abs().amax(dim=(1, 3)) / fmax  # [out/B, in/B]
        full = scale.repeat_interleave(block, 0)[:out_f].repeat_interleave(block, 1)
        method = Fp8BlockLinearMethod((block, block))
    else:
        if weights == "channel":
            full = w.abs().amax(1, keepdim=True) / fmax  # [out, 1]
        else:  # one scale per packed shard, repeated on its rows
            full = torch.empty(w.shape[0], 1)
            for first, rows in _shards(layer):
                full[first:first + rows] = w[first:first + rows].abs().amax() / fmax
        scale = full.t().contiguous()  # [1, out]
        method = Fp8LinearMethod()
    layer.weight = nn.Parameter((w / full).clamp(-fmax, fmax).to(fp8), requires_grad=False)
    layer.weight_scale = nn.Parameter(scale.float(), requires_grad=False)
    layer.input_scale = None
    layer.quant_method = method


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct")
    ap.add_argument("--block", type=int, default=128, help="block size of block-dynamic (falls back to 64 "
                                                           "when the model's widths are not multiples)")
    ap.add_argument("--schemes", nargs="+", default=list(SCHEMES), choices=SCHEMES)
    ap.add_argument("--kv-only", action="store_true", help="only the FP8 KV cache rows")
    ap.add_argument("--dtype", default="float32", help="the model's dtype (the reference's KV cache has it)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if args.kv_only:
        args.schemes = []

    from compilelm import LLM, SamplingParams
    from compilelm.layers.quantization import calibrate
    from compilelm.layers.quantization.fp8 import fp8_linears

    llm = LLM(args.model, enforce_eager=True, max_model_len=1024, num_kv_blocks=128, dtype=args.dtype)
    model = llm.engine.model_runner.model
    prompt = llm.tokenizer.encode(TEXT)
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    greedy = SamplingParams(temperature=0.0, max_tokens=16)
    ref = forward_logits(llm, prompt)
    ref_answer = llm.chat(chat, greedy, use_tqdm=False)[0].outputs[0].text
    originals = {name: layer.weight.data.clone() for name, layer in fp8_linears(model)}
    block = args.block
    if any(s % block for w in originals.values() for s in w.shape):
        block = 64
    rows = []
    for scheme in args.schemes:
        for name, layer in fp8_linears(model):
            install(layer, originals[name], scheme, block)
        if scheme.endswith("static"):
            with calibrate(model):
                forward_logits(llm, llm.tokenizer.encode(CALIBRATION))
        got = forward_logits(llm, prompt)
        err = (got - ref).abs()
        answer = llm.chat(chat, greedy, use_tqdm=False)[0].outputs[0].text
        top1 = (got.argmax(-1) == ref.argmax(-1)).float().mean().item()
        rows.append({"scheme": scheme if scheme != "block-dynamic" else f"block{block}-dynamic",
                     "tokens": len(prompt), "top1_agreement": round(top1, 4),
                     "mean_abs_logit_err": round(err.mean().item(), 4), "max_abs_logit_err": round(err.max().item(), 3),
                     "greedy_answer": answer})
    # the FP8 KV cache: the same weights (loaded again) with float8_e4m3fn K/V
    kv_llm = LLM(args.model, enforce_eager=True, max_model_len=1024, num_kv_blocks=128, dtype=args.dtype,
                 kv_cache_dtype="fp8")
    kv_model = kv_llm.engine.model_runner.model
    kv_originals = {name: layer.weight.data.clone() for name, layer in fp8_linears(kv_model)}
    for scheme in KV_SCHEMES:
        if scheme.endswith("channel-dynamic"):
            for name, layer in fp8_linears(kv_model):
                install(layer, kv_originals[name], "channel-dynamic", block)
        got = forward_logits(kv_llm, prompt)
        err = (got - ref).abs()
        answer = kv_llm.chat(chat, greedy, use_tqdm=False)[0].outputs[0].text
        top1 = (got.argmax(-1) == ref.argmax(-1)).float().mean().item()
        rows.append({"scheme": scheme, "tokens": len(prompt), "top1_agreement": round(top1, 4),
                     "mean_abs_logit_err": round(err.mean().item(), 4), "max_abs_logit_err": round(err.max().item(), 3),
                     "greedy_answer": answer})
    print(f"{args.dtype} reference: {len(prompt)} tokens, logit std {ref.std().item():.2f}; greedy answer "
          f"{ref_answer!r}")
    print_table(rows, ["scheme", "tokens", "top1_agreement", "mean_abs_logit_err", "max_abs_logit_err",
                       "greedy_answer"])
    payload = {"model": args.model or "SmolLM2-135M-Instruct (default)",
               "device": str(llm.engine.model_runner.device),
               "reference": f"{args.dtype}, unquantized, KV cache in {args.dtype}",
               "logit_std": round(ref.std().item(), 3), "reference_answer": ref_answer, "rows": rows}
    path = write_result("bench_fp8_accuracy", payload, args.out)
    print(f"wrote {path}")
    return payload


if __name__ == "__main__":
    main()
