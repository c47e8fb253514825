"""Decode tokens/s of compilelm vs Hugging Face `generate` on the same model and machine (CPU).

Same prompts (token ids of equal length, so HF needs no padding), greedy, every request generates
exactly N tokens (ignore_eos / min_new_tokens). Decode throughput is measured as a difference of
two runs, N_long and N_short new tokens, so prefill cost cancels out:
    decode tok/s = batch * (N_long - N_short) / (t(N_long) - t(N_short))

    python benchmarks/bench_cpu.py [--model M] [--batches 1 16] [--prompt-len 64]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.common import print_table, write_result  # noqa: E402


def _prompts(batch: int, length: int, vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return torch.randint(100, min(vocab, 30000), (batch, length), generator=g).tolist()


def time_ours(llm, prompts, n_new: int) -> float:
    from compilelm import SamplingParams
    params = SamplingParams(temperature=0.0, max_tokens=n_new, ignore_eos=True)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    dt = time.perf_counter() - t0
    assert all(len(o.outputs[0].token_ids) == n_new for o in outs)
    return dt


def time_hf(model, prompts, n_new: int) -> float:
    ids = torch.tensor(prompts)
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n_new,
                             min_new_tokens=n_new, do_sample=False, pad_token_id=0)
    dt = time.perf_counter() - t0
    assert out.shape[1] == ids.shape[1] + n_new
    return dt


def load_hf(model_path: str, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM
    d, f = os.path.dirname(model_path), os.path.basename(model_path)
    return AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=dtype).eval()


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct GGUF")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--short", type=int, default=4)
    ap.add_argument("--long", type=int, default=36)
    ap.add_argument("-O", dest="level", type=int, default=None,
                    help="compilelm optimization level (default: the engine's)")
    ap.add_argument("--dtype", default="auto", help="compilelm dtype (auto = float32 on CPU)")
    ap.add_argument("--hf-dtype", default="float32", help="dtype of the Hugging Face baseline")
    ap.add_argument("--no-hf", action="store_true")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)

    from tqdm.auto import tqdm

    from compilelm import LLM
    from compilelm.models.loader import resolve_model
    llm = LLM(args.model, optimization_level=args.level, dtype=args.dtype,
              max_model_len=args.prompt_len + args.long + 8, max_num_seqs=max(args.batches))
    hf = None
    if not args.no_hf:
        src = resolve_model(args.model)
        if src.kind != "gguf":
            sys.exit("the HF baseline is wired for GGUF models (the default); pass --no-hf otherwise")
        hf = load_hf(src.path, getattr(torch, args.hf_dtype))
    vocab = llm.engine.model_config.vocab_size
    rows = []
    for batch in tqdm(args.batches, desc="bench_cpu", unit="batch"):
        prompts = _prompts(batch, args.prompt_len, vocab)
        time_ours(llm, prompts, 2)  # warm-up
        ours = batch * (args.long - args.short) / (time_ours(llm, prompts, args.long)
                                                   - time_ours(llm, prompts, args.short))
        row = {"batch": batch, "compilelm_tok_s": ours}
        if hf is not None:
            time_hf(hf, prompts, 2)
            theirs = batch * (args.long - args.short) / (time_hf(hf, prompts, args.long)
                                                         - time_hf(hf, prompts, args.short))
            row.update(hf_tok_s=theirs, ratio=ours / theirs)
        rows.append(row)
    print_table(rows, ["batch", "compilelm_tok_s", "hf_tok_s", "ratio"])
    level = getattr(llm.engine.config.compilation, "level", 0)
    path = write_result("bench_cpu", {"model": llm.engine.source.name, "optimization_level": level,
                                      "dtype": str(llm.engine.dtype), "hf_dtype": args.hf_dtype,
                                      "prompt_len": args.prompt_len, "decode_tokens": args.long - args.short,
                                      "rows": rows}, args.out)
    print(f"wrote {path}")
    return {"rows": rows}


if __name__ == "__main__":
    main()
