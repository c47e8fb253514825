"""The sampler's cost a step on the GPU: plain temperature sampling through sample_rows (one kernel
over the logits in their dtype) against the general path it replaces for such rows (an fp32 copy,
temperature, softmax, exponential noise, the race's argmax), with greedy argmax_rows beside them;
and the same for seeded requests, whose general path draws each row's noise on the host from the
request's own generator (`seeded_*`).

    python benchmarks/bench_sampler.py [--batches 1 16 64 256] [--vocab 151936]

Logits are bf16 [batch, vocab] (Qwen3's vocabulary by default), every row at temperature 0.6
(greedy: 0). Each path is `Sampler.sample_tensors` as the engine calls it, or for the general path
`sample()` on the fp32 logits (what sample_tensors ran for these rows before sample_rows). Times are
the stream's, CUDA events over --iters calls (so the host's launch cost shows where it exceeds the
GPU's), median of 5 rounds. Table + JSON (default benchmarks/results/bench_sampler.json). No asserts.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..")))

from benchmarks.common import print_table, write_result  # noqa: E402
from compilelm.runtime.request import Request  # noqa: E402
from compilelm.runtime.sampler import Sampler, sample  # noqa: E402
from compilelm.sampling_params import SamplingParams  # noqa: E402


def stream_us(fn, iters: int) -> float:
    """Median over 5 rounds of the stream's time per call of fn, iters calls a round."""
    fn()
    torch.cuda.synchronize()
    rounds = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        end.synchronize()
        rounds.append(start.elapsed_time(end) * 1e3 / iters)
    return statistics.median(rounds)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64, 256])
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--temperature", type=float, default=0.6)
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--out", default=None, help="JSON path (default benchmarks/results/bench_sampler.json)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench_sampler needs a CUDA GPU")
    sampler, rows = Sampler(), []
    for batch in args.batches:
        logits = torch.randn(batch, args.vocab, device="cuda").mul_(3).to(torch.bfloat16)
        sampled = [Request(str(i), [1], SamplingParams(temperature=args.temperature)) for i in range(batch)]
        greedy = [Request(str(i), [1], SamplingParams(temperature=0.0)) for i in range(batch)]
        seeded = [Request(str(i), [1], SamplingParams(temperature=args.temperature, seed=i)) for i in range(batch)]
        point = {
            "batch": batch,
            "greedy_argmax_us": stream_us(lambda: sampler.sample_tensors(logits, greedy), args.iters),
            "sample_rows_us": stream_us(lambda: sampler.sample_tensors(logits, sampled), args.iters),
            "general_path_us": stream_us(lambda: sample(logits.float(), sampled), args.iters),
            "seeded_sample_rows_us": stream_us(lambda: sampler.sample_tensors(logits, seeded), args.iters),
            "seeded_general_us": stream_us(lambda: sample(logits.float(), seeded), max(1, args.iters // 10)),
        }
        point["speedup"] = point["general_path_us"] / point["sample_rows_us"]
        rows.append(point)
    print_table(rows, ["batch", "greedy_argmax_us", "sample_rows_us", "general_path_us", "speedup",
                       "seeded_sample_rows_us", "seeded_general_us"])
    path = write_result("bench_sampler", {"args": vars(args), "rows": rows}, args.out)
    print("wrote", path)
    return {"rows": rows}


if __name__ == "__main__":
    main()
