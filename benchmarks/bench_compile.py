"""Compile-time and decode-speed benchmark for compilelm's compiler on CPU.

    python benchmarks/bench_compile.py [--model default] [--batch-sizes 1 16] [--tokens 32]

1. Cold and warm compile of the model, each in a fresh process (`compilelm compile` code path):
   cold = empty compile cache *and* empty Inductor cache; warm = the same directories again.
   Reported: the compiler's own time, and the process wall time until the model is compiled
   (imports and weight loading included).
2. Decode tokens/s at each batch size: compilelm engine compiled (-O2), eager (-O0), and Hugging
   Face transformers on the same weights (greedy, KV cache, `generate`). Engine numbers are
   batch / median decode-step time; HF's are from the best of 3 runs.

Prints a table and writes JSON (default benchmarks/results/bench_compile.json). No asserts.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, REPO)


def child_compile(model: str, cache_dir: str) -> None:
    """Runs in a subprocess: load + compile, print timings as JSON."""
    start = time.perf_counter()
    from compilelm.entrypoints.cli_compile import load_model
    from compilelm.graphs import CompileConfig, CompiledModel
    from compilelm.llm import make_engine_config

    config = make_engine_config(None if model == "default" else model)
    model_, factors = load_model(config)
    loaded = time.perf_counter()
    cm = CompiledModel(model_, CompileConfig(cache_dir=cache_dir), factors)
    cm.compile()
    print(json.dumps({"mode": cm.mode, "compile_s": cm.times["total"], "times": cm.times, "counters": cm.counters,
                      "load_weights_s": loaded - start, "wall_to_compiled_s": time.perf_counter() - start}))


def compile_times(model: str) -> dict:
    out = {}
    with tempfile.TemporaryDirectory(prefix="compilelm-bench-") as cache_dir:
        for run in ("cold", "warm"):
            t = time.perf_counter()
            proc = subprocess.run([sys.executable, __file__, "--child-compile", model, cache_dir],
                                  capture_output=True, text=True, cwd=REPO)
            if proc.returncode != 0:
                raise RuntimeError(proc.stderr[-3000:])
            out[run] = {**json.loads(proc.stdout.strip().splitlines()[-1]), "process_s": time.perf_counter() - t}
    return out


def engine_decode(model: str, batch: int, tokens: int, enforce_eager: bool, prompt_len: int = 8) -> float:
    """Decode tokens/s of the compilelm engine: batch / median time of a decode step (the
    median keeps other processes on a shared machine from skewing the number)."""
    from compilelm import LLM, SamplingParams

    llm = LLM(None if model == "default" else model, enforce_eager=enforce_eager)
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    step_times = []
    for round_ in range(2):  # round 0 warms up
        for i in range(batch):
            engine.add_request(None, [1] + [100 + (7 * i + j) % 1000 for j in range(prompt_len - 1)], params)
        engine.step()  # prefill (+ first token)
        while engine.has_unfinished_requests():
            t = time.perf_counter()
            engine.step()
            if round_:
                step_times.append(time.perf_counter() - t)
    return batch / statistics.median(step_times)


def hf_decode(model: str, batch: int, tokens: int, prompt_len: int = 8) -> float:
    """Decode tokens/s of transformers' generate (greedy, KV cache) on the same weights."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    if model == "default":
        from compilelm.models.loader import default_model_path
        path = default_model_path()
        hf = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                  dtype=torch.float32)
    else:  # dummy:<preset>: random weights of the same shape (speed only)
        from compilelm.models.config import DUMMY_PRESETS
        hf = LlamaForCausalLM(LlamaConfig(**{k: v for k, v in DUMMY_PRESETS[model.split(":", 1)[1]].items()
                                             if k != "architectures"}))
    hf.eval()
    ids = torch.tensor([[1] + [100 + (7 * i + j) % 1000 for j in range(prompt_len - 1)] for i in range(batch)])

    def run(n):
        t = time.perf_counter()
        hf.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
        return time.perf_counter() - t

    with torch.inference_mode():
        run(2)  # warm-up
        # best of 3: the least disturbed run on a shared machine
        return batch * (tokens - 1) / (min(run(tokens) for _ in range(3)) - min(run(1) for _ in range(3)))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="default", help="default (SmolLM2-135M GGUF) or dummy:<preset>")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16])
    p.add_argument("--tokens", type=int, default=32, help="new tokens per request")
    p.add_argument("--skip-hf", action="store_true")
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads (default: torch's); 1 gives stable numbers on a busy machine")
    p.add_argument("--out", default=os.path.join(REPO, "benchmarks", "results", "bench_compile.json"))
    p.add_argument("--child-compile", nargs=2, metavar=("MODEL", "CACHE_DIR"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.threads:  # before torch starts its thread pools; inherited by the compile subprocesses
        os.environ["OMP_NUM_THREADS"] = str(args.threads)
    if args.child_compile:
        return child_compile(*args.child_compile)

    import torch

    if args.threads:
        torch.set_num_threads(args.threads)

    result = {"model": args.model, "torch": torch.__version__, "threads": torch.get_num_threads(),
              "cpus": os.cpu_count(), "load_avg_start": os.getloadavg()[0]}
    result["compile"] = compile_times(args.model)
    result["decode_tok_s"] = {}
    for bs in args.batch_sizes:
        row = {"compiled": engine_decode(args.model, bs, args.tokens, enforce_eager=False),
               "eager": engine_decode(args.model, bs, args.tokens, enforce_eager=True)}
        if not args.skip_hf:
            row["hf"] = hf_decode(args.model, bs, args.tokens)
        row["compiled_vs_eager"] = row["compiled"] / row["eager"]
        result["decode_tok_s"][str(bs)] = row
    result["load_avg_end"] = os.getloadavg()[0]

    c = result["compile"]
    print(f"\ncompile ({args.model}, CPU, {result['threads']} threads, load avg {result['load_avg_start']:.1f})")
    print(f"{'':6} {'compile s':>10} {'process s':>10}  breakdown")
    for run in ("cold", "warm"):
        r = c[run]
        detail = ", ".join(f"{k} {v:.1f}" for k, v in r["times"].items() if k != "total" and v >= 0.05)
        print(f"{run:6} {r['compile_s']:10.2f} {r['wall_to_compiled_s']:10.2f}  {detail}")
    print(f"\ndecode tokens/s ({args.tokens} new tokens per request)")
    print(f"{'batch':>5} {'compiled':>10} {'eager':>10} {'hf':>10} {'compiled/eager':>15}")
    for bs, row in result["decode_tok_s"].items():
        hf = f"{row['hf']:10.1f}" if "hf" in row else f"{'-':>10}"
        print(f"{bs:>5} {row['compiled']:10.1f} {row['eager']:10.1f} {hf} {row['compiled_vs_eager']:15.2f}")
    from benchmarks.common import write_result  # records machine, torch version and commit
    print(f"\nwrote {write_result('bench_compile', result, args.out)}")


if __name__ == "__main__":
    main()
