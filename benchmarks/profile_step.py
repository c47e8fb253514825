"""Where a decode step's time goes on the GPU: kernels by kind, the top kernels, and host gaps.

For each model and batch: `batch` requests with `context`-token prompts are prefilled, then
`--steps` decode steps are run under torch.profiler twice:

- `step`: whole `engine.step()` calls (graph replay, LM head, sampling, scheduling, detokenizing).
  GPU busy = the sum of kernel times; wall - busy is the time the GPU had nothing to run.
- `graph`: the decode CUDA graph replayed alone (kernels inside a graph are traced one by one).

With `--prefill NxLEN` (repeatable): N fresh prompts of LEN tokens, one output token each, every
step until they finish (chunked by the step budget), under the profiler: where prefill goes.

Kernels are put in kinds by name (GEMM, paged attention, Triton = Inductor's fused code, fused
ops from csrc, copies, sampling, other), so a reader sees what a fusion or a kernel change can
win. No asserts; a table per case and JSON.

    python benchmarks/profile_step.py [--models dummy:smollm2-135m] [--batches 1 64] [--context 1024]
                                      [--quantization fp8] [--max-model-len 16512]
    python benchmarks/profile_step.py --models dummy:qwen3-0.6b --batches --prefill 16x2000
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.bench_decode import prompts  # noqa: E402
from benchmarks.common import print_table, write_result  # noqa: E402

KINDS = (  # first match wins
    ("attention", r"paged_attention"),
    ("gemm", r"gemm|gemv|cutlass|xmma|cublas|sm90_|sm80_|ampere_|Kernel2|splitK"),
    ("fused_op", r"rms_norm|rope|quant|silu|reshape_and_cache|allreduce"),
    ("triton", r"^triton_"),
    ("copy", r"[Cc]opy|memcpy|memset|fill|Memcpy|Memset"),
    ("sampling", r"argmax|[Ss]oftmax|sort|topk|exponential|[Rr]educe|index|gather|scatter|max"),
)


def kind_of(name: str) -> str:
    for kind, pattern in KINDS:
        if re.search(pattern, name):
            return kind
    return "other"


def kernels(prof) -> list[tuple[str, float, float]]:
    """(name, start us, duration us) of every GPU kernel/memcpy/memset in the trace."""
    out = []
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            out.append((e.name, e.time_range.start, e.time_range.elapsed_us()))
    return out


def summarize(events, wall_us: float, steps: int) -> dict:
    by_kind, by_name = collections.Counter(), collections.defaultdict(lambda: [0, 0.0])
    for name, _, dur in events:
        by_kind[kind_of(name)] += dur
        by_name[name][0] += 1
        by_name[name][1] += dur
    busy = sum(by_kind.values()) / steps
    span = (max(s + d for _, s, d in events) - min(s for _, s, _ in events)) / steps if events else 0.0
    top = sorted(by_name.items(), key=lambda kv: -kv[1][1])[:20]
    return dict(
        wall_us_per_step=wall_us / steps, gpu_busy_us_per_step=busy, gpu_span_us_per_step=span,
        kernels_per_step=sum(v[0] for v in by_name.values()) / steps,
        by_kind={k: v / steps for k, v in by_kind.most_common()},
        top=[dict(name=n[:90], kind=kind_of(n), calls_per_step=c / steps, us_per_call=t / c, us_per_step=t / steps)
             for n, (c, t) in top])


def profile(fn, steps: int) -> tuple[list, float]:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    torch.cuda.synchronize()
    with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            fn()
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t0) * 1e6
    return kernels(prof), wall


def run_case(engine, batch: int, context: int, steps: int, temperature: float = 0.0) -> dict:
    from compilelm import SamplingParams

    params = SamplingParams(temperature=temperature, max_tokens=4 * steps + 16, ignore_eos=True)
    ids = [engine.add_request(None, p, params) for p in prompts(batch, context, engine.model_config.vocab_size, batch)]
    produced = {}
    while len(produced) < batch or min(produced.values()) < 3:
        for out in engine.step():
            produced[out.request_id] = len(out.outputs[0].token_ids)
    for _ in range(steps):  # profiler warm-up outside the measured window
        engine.step()
    result = {"step": summarize(*profile(engine.step, steps), steps)}
    graphs = engine.model_runner.cuda_graphs
    size = graphs.padded_size(batch) if graphs else None
    if size is not None:
        result["graph"] = summarize(*profile(lambda: graphs.replay(size), steps), steps)
    engine.abort_request(ids)
    while engine.has_unfinished_requests():
        engine.step()
    return result


def run_prefill(engine, n: int, length: int) -> dict:
    """Every step of `n` fresh `length`-token prompts with one output token, profiled (after an
    unprofiled round of other prompts of the same shape: compile sizes, autotuning)."""
    from compilelm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    steps = []

    def round_(seed: int) -> None:
        for p in prompts(n, length, engine.model_config.vocab_size, seed):
            engine.add_request(None, p, params)
        while engine.has_unfinished_requests():
            engine.step()
            steps.append(1)

    round_(1)
    steps.clear()
    events, wall = profile(lambda: round_(2), 1)
    return {"prefill": summarize(events, wall, len(steps)), "steps": len(steps)}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["dummy:smollm2-135m"])
    ap.add_argument("--batches", type=int, nargs="*", default=[1, 64])
    ap.add_argument("--prefill", action="append", default=[], metavar="NxLEN", help="profile a prefill of N prompts")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--max-model-len", type=int, default=None,
                    help="the engine's (default: what the cases need; bench_vs_vllm runs at 16512)")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--temperature", type=float, default=0.0, help="decode cases: sample (> 0) or greedy (0)")
    ap.add_argument("--quantization", choices=["none", "fp8"], default="none", help="fp8: FP8 W8A8 linears")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("profile_step needs a CUDA GPU")
    from compilelm import LLM

    cases: list[dict] = []
    payload = dict(args=vars(args), cases=cases)
    for name in args.models:
        longest = max([args.context + 8 * args.steps] + [int(p.split("x")[1]) for p in args.prefill]) + 64
        longest = max(longest, args.max_model_len or 0)
        llm = LLM(model=name, dtype="bfloat16", max_model_len=longest,
                  quantization=None if args.quantization == "none" else args.quantization,
                  max_num_seqs=max(args.batches + [int(p.split("x")[0]) for p in args.prefill]),
                  max_num_batched_tokens=8192)
        for spec in args.prefill:
            n, length = map(int, spec.split("x"))
            case = dict(model=name, prefill_spec=spec, **run_prefill(llm.engine, n, length))
            cases.append(case)
            s = case["prefill"]
            print(f"\n{name} prefill {spec}: {case['steps']} steps, wall {s['wall_us_per_step']:.0f} us/step, GPU busy "
                  f"{s['gpu_busy_us_per_step']:.0f}, {s['kernels_per_step']:.0f} kernels/step")
            print("  by kind (us/step): " + ", ".join(f"{k} {v:.0f}" for k, v in s["by_kind"].items()))
            print_table(s["top"][:15], ["kind", "calls_per_step", "us_per_call", "us_per_step", "name"])
            write_result("profile_step", payload, args.out)
        for batch in args.batches:
            case = dict(model=name, quantization=args.quantization, batch=batch, context=args.context,
                        **run_case(llm.engine, batch, args.context, args.steps, args.temperature))
            cases.append(case)
            write_result("profile_step", payload, args.out)
            for part in ("step", "graph"):
                if part not in case:
                    continue
                s = case[part]
                print(f"\n{name} batch {batch} [{part}]: wall {s['wall_us_per_step']:.0f} us/step, GPU busy "
                      f"{s['gpu_busy_us_per_step']:.0f}, span {s['gpu_span_us_per_step']:.0f}, "
                      f"{s['kernels_per_step']:.0f} kernels/step")
                print("  by kind (us/step): " + ", ".join(f"{k} {v:.0f}" for k, v in s["by_kind"].items()))
                if part == "graph" or "graph" not in case:
                    print_table(s["top"][:15], ["kind", "calls_per_step", "us_per_call", "us_per_step", "name"])
        llm.engine.shutdown()
        del llm
        torch.cuda.empty_cache()
    path = write_result("profile_step", payload, args.out)
    print(f"wrote {path}")
    return payload


if __name__ == "__main__":
    main()
