"""Offline throughput in nano-vllm's shape: many requests of random lengths submitted at once.

256 requests (seeded), each a prompt of random token ids whose length is uniform in
[--min-len, --max-len] and an output length drawn the same way; `ignore_eos` and
`max_tokens` = the drawn output length, temperature 0.6 (nano-vllm's bench.py). All go to
`LLM.generate` in one call after a short warm-up; output tokens/s = sum of output lengths / wall
time (total tokens/s adds the prompt tokens).

Hugging Face transformers, same model shape with random weights (the tokens are not compared;
with ignore_eos the work does not depend on the weights), batched `generate`: left-padded
batches of --hf-batch requests in submission order, each run for the batch's longest output
(`max_new_tokens` = `min_new_tokens` = that length: HF cannot stop rows at different lengths
inside one batch). Only each request's own drawn output tokens count as useful, so the padding
rows' and the early-finished rows' extra tokens are HF's loss, as they would be in a real
batch. `--hf-num-requests` times HF on the first N requests only (its rate is per useful token,
so a subset is comparable; one batch of 64 costs as many steps as the whole run) to keep the run
short, `--hf-models` picks the models HF runs on.

Published anchor: vLLM 8.6k-9.5k output tok/s for Qwen3-0.6B on A100/A800 (nano-vllm README).

    python benchmarks/bench_throughput.py [--models dummy:smollm2-135m dummy:qwen3-0.6b]
    python benchmarks/bench_throughput.py --num-requests 4 --max-len 16 --layers 2 --enforce-eager  # CPU smoke
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import sys
import time

import torch
from tqdm import tqdm

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.common import print_table, write_result  # noqa: E402

ANCHOR = "vLLM 8.6k-9.5k output tok/s, Qwen3-0.6B, A100/A800 (nano-vllm README)"
TEMPERATURE = 0.6


def workload(num_requests: int, min_len: int, max_len: int, vocab: int, seed: int):
    """(prompts, output lengths): nano-vllm's recipe, token ids below min(10000, vocab)."""
    rng = random.Random(seed)
    prompts = [[rng.randint(0, min(10000, vocab) - 1) for _ in range(rng.randint(min_len, max_len))]
               for _ in range(num_requests)]
    out_lens = [rng.randint(min_len, max_len) for _ in range(num_requests)]
    return prompts, out_lens


def sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def bench_ours(name: str, args, overrides: dict) -> tuple[dict, list, list]:
    from compilelm import LLM, SamplingParams

    t0 = time.perf_counter()
    llm = LLM(model=name, dtype=args.dtype, max_model_len=2 * args.max_len + 16, max_num_seqs=args.max_num_seqs,
              max_num_batched_tokens=args.max_num_batched_tokens, enforce_eager=args.enforce_eager,
              model_overrides=overrides)
    startup = time.perf_counter() - t0
    print(f"{name}: engine ready in {startup:.1f} s", flush=True)
    engine = llm.engine
    prompts, out_lens = workload(args.num_requests, args.min_len, args.max_len, engine.model_config.vocab_size,
                                 args.seed)
    params = [SamplingParams(temperature=TEMPERATURE, ignore_eos=True, max_tokens=n) for n in out_lens]
    llm.generate([1, 2, 3], SamplingParams(max_tokens=8, ignore_eos=True), use_tqdm=False)  # warm-up
    sync(engine.device)
    t0 = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=True)
    sync(engine.device)
    wall = time.perf_counter() - t0
    produced = sum(len(o.outputs[0].token_ids) for o in outputs)
    row = dict(model=name, engine="compilelm", requests=len(prompts), wall_s=wall, output_tokens=produced,
               prompt_tokens=sum(map(len, prompts)), output_tok_s=produced / wall,
               total_tok_s=(produced + sum(map(len, prompts))) / wall, startup_s=startup,
               device=str(engine.device), dtype=str(engine.dtype).replace("torch.", ""))
    if produced != sum(out_lens):
        row["note"] = f"produced {produced} tokens, expected {sum(out_lens)}"
    del llm, engine
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return row, prompts, out_lens


def hf_model(name: str, overrides: dict, device, dtype):
    """Hugging Face model of the dummy preset's shape (as bench_decode builds it), random weights."""
    import transformers

    from compilelm.models.config import DUMMY_PRESETS

    cfg = {**DUMMY_PRESETS[name.split(":", 1)[1]], **overrides}
    arch = cfg.pop("architectures")[0]
    config = getattr(transformers, arch.replace("ForCausalLM", "Config"))(**cfg)
    with torch.device(device):
        model = getattr(transformers, arch)._from_config(config, dtype=dtype)
    return model.eval()


def bench_hf(name: str, args, overrides: dict, prompts: list, out_lens: list, device, dtype) -> dict:
    model = hf_model(name, overrides, device, dtype)
    n = min(args.hf_num_requests or len(prompts), len(prompts))
    prompts, out_lens = prompts[:n], out_lens[:n]

    def generate(batch_prompts, new_tokens: int) -> int:
        width = max(map(len, batch_prompts))
        ids = torch.zeros(len(batch_prompts), width, dtype=torch.long)  # left padding with id 0
        mask = torch.zeros_like(ids)
        for i, p in enumerate(batch_prompts):
            ids[i, width - len(p):] = torch.tensor(p)
            mask[i, width - len(p):] = 1
        out = model.generate(ids.to(device), attention_mask=mask.to(device), max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, do_sample=True, temperature=TEMPERATURE, top_k=0,
                             pad_token_id=0)
        return (out.shape[1] - width) * len(batch_prompts)

    with torch.inference_mode():
        generate(prompts[:2], 4)  # warm-up (cuBLAS handles, allocator)
        sync(device)
        generated, t0 = 0, time.perf_counter()
        for i in tqdm(range(0, n, args.hf_batch), desc=f"HF {name}", unit="batch"):
            generated += generate(prompts[i:i + args.hf_batch], max(out_lens[i:i + args.hf_batch]))
        sync(device)
        wall = time.perf_counter() - t0
    useful = sum(out_lens)
    print(f"HF {name}: {useful / wall:.0f} useful output tok/s ({wall:.1f} s)", flush=True)
    model = None  # (generate() holds the cell: this frees the model)
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return dict(model=name, engine=f"hf generate (batch {args.hf_batch})", requests=n, wall_s=wall,
                output_tokens=useful, prompt_tokens=sum(map(len, prompts)), output_tok_s=useful / wall,
                total_tok_s=(useful + sum(map(len, prompts))) / wall, hf_generated_tokens=generated,
                device=str(device), dtype=str(dtype).replace("torch.", ""))


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["dummy:smollm2-135m", "dummy:qwen3-0.6b"])
    ap.add_argument("--num-requests", type=int, default=256)
    ap.add_argument("--min-len", type=int, default=None,
                    help="shortest prompt/output (default 100, or max-len // 2 if smaller)")
    ap.add_argument("--max-len", type=int, default=1024, help="longest prompt/output")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtype", default="auto", help="auto: bfloat16 on CUDA, float32 on CPU")
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192)
    ap.add_argument("--enforce-eager", action="store_true", help="no compile, no CUDA graphs (CPU smoke tests)")
    ap.add_argument("--layers", type=int, default=None, help="override num_hidden_layers (smoke tests)")
    ap.add_argument("--hf-batch", type=int, default=64)
    ap.add_argument("--hf-num-requests", type=int, default=None, help="time HF on the first N requests (default all)")
    ap.add_argument("--hf-models", nargs="*", default=None, help="models to also time HF on (default: all)")
    ap.add_argument("--no-hf", action="store_true")
    ap.add_argument("--out", default=None, help="JSON path (default benchmarks/results/bench_throughput.json)")
    args = ap.parse_args(argv)
    if args.min_len is None:
        args.min_len = min(100, max(1, args.max_len // 2))
    if not 1 <= args.min_len <= args.max_len:
        ap.error(f"need 1 <= --min-len <= --max-len, got {args.min_len} and {args.max_len}")
    overrides = {"num_hidden_layers": args.layers} if args.layers else {}
    rows: list[dict] = []
    payload = dict(args=vars(args), anchor=ANCHOR, rows=rows)
    save = lambda: write_result("bench_throughput", payload, args.out)  # noqa: E731 (partial results survive)
    for name in args.models:
        try:
            row, prompts, out_lens = bench_ours(name, args, overrides)
        except Exception as e:  # report, go on with the next model
            rows.append(dict(model=name, engine="compilelm", error=f"{type(e).__name__}: {e}"[:500]))
            print(f"{name}: FAILED {rows[-1]['error']}", flush=True)
            continue
        rows.append(row)
        print(f"{name}: {row['output_tok_s']:.0f} output tok/s ({row['wall_s']:.1f} s)", flush=True)
        save()
        if not args.no_hf and (args.hf_models is None or name in args.hf_models):
            device = torch.device(row["device"])
            try:
                hf = bench_hf(name, args, overrides, prompts, out_lens, device, getattr(torch, row["dtype"]))
                row["speedup_vs_hf"] = row["output_tok_s"] / hf["output_tok_s"]
                rows.append(hf)
            except Exception as e:
                rows.append(dict(model=name, engine="hf", error=f"{type(e).__name__}: {e}"[:500]))
            save()
    path = save()
    print(f"\n{args.num_requests} requests, prompt and output lengths uniform in [{args.min_len}, {args.max_len}], "
          f"ignore_eos; anchor: {ANCHOR}")
    columns = ["model", "engine", "requests", "wall_s", "output_tokens", "output_tok_s", "total_tok_s",
               "speedup_vs_hf", "startup_s"]
    print_table(rows, columns + (["error"] if any("error" in r for r in rows) else []))
    print(f"wrote {path}")
    return payload


if __name__ == "__main__":
    main()
