"""The sampler's cost a step on the GPU, by what the batch asks: greedy (argmax_rows), plain
temperature sampling (sample_rows on the logits in their dtype), top-k + top-p (Qwen3's generation
defaults, k 20 and p 0.95: the filters from each row's top candidates), top-p alone (Llama-3's, p 0.9:
a sort of the vocabulary), and top-k + top-p with a seed per request.

    python benchmarks/bench_sampler.py [--batches 1 16 64 256] [--vocab 151936]

Logits are bf16 [batch, vocab] (Qwen3's vocabulary by default), temperature 0.6, through
`Sampler.sample_tensors` as the engine calls it. Times are the stream's, CUDA events over --iters
calls (so the host's launch cost shows where it exceeds the GPU's), median of 5 rounds. Table + JSON
(default benchmarks/results/bench_sampler.json). No asserts.
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
from compilelm.runtime.sampler import Sampler  # noqa: E402
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

        def requests(**kw):
            return [Request(str(i), [1], SamplingParams(**kw)) for i in range(batch)]

        t = args.temperature
        cases = {"greedy_us": requests(temperature=0.0), "plain_us": requests(temperature=t),
                 "top_k_top_p_us": requests(temperature=t, top_k=20, top_p=0.95),
                 "top_p_us": requests(temperature=t, top_p=0.9),
                 "seeded_top_k_top_p_us": [Request(str(i), [1], SamplingParams(temperature=t, top_k=20, top_p=0.95,
                                                                                seed=i)) for i in range(batch)]}
        point = {"batch": batch}
        for name, reqs in cases.items():
            point[name] = stream_us(lambda reqs=reqs: sampler.sample_tensors(logits, reqs), args.iters)
        rows.append(point)
    print_table(rows, ["batch", "greedy_us", "plain_us", "top_k_top_p_us", "top_p_us", "seeded_top_k_top_p_us"])
    path = write_result("bench_sampler", {"args": vars(args), "rows": rows}, args.out)
    print("wrote", path)
    return {"rows": rows}


if __name__ == "__main__":
    main()
