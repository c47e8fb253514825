"""`compilelm bench latency` and `compilelm bench throughput`: vLLM's offline benchmarks through
`LLM.generate`, with the engine flags of `compilelm generate` and vLLM's report lines.

latency: one batch of `--batch-size` random prompts of `--input-len` tokens, each generating
exactly `--output-len` tokens (ignore_eos), run `--num-iters-warmup` times untimed then
`--num-iters` times timed; prints the mean and percentiles of a batch's wall time.
throughput: `--num-prompts` requests of the random or sharegpt dataset (bench/dataset.py) submitted
at once; prints requests/s, total tokens/s and output tokens/s.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
from tqdm import tqdm

from compilelm.entrypoints.bench.dataset import random_requests, sharegpt_requests
from compilelm.entrypoints.engine_args import ArgError, add_engine_args, engine_config_from_args

PERCENTILES = (10, 25, 50, 75, 90, 99)


def add_parsers(sub) -> None:
    lat = sub.add_parser("latency", help="wall time of one batch, generated start to end (vllm bench latency)")
    lat.add_argument("--input-len", type=int, default=32)
    lat.add_argument("--output-len", type=int, default=128)
    lat.add_argument("--batch-size", type=int, default=8)
    lat.add_argument("--num-iters-warmup", type=int, default=10)
    lat.add_argument("--num-iters", type=int, default=30)
    _common(lat)
    lat.set_defaults(run=run_latency)
    thr = sub.add_parser("throughput", help="offline throughput of many requests at once (vllm bench throughput)")
    thr.add_argument("--dataset-name", default="random", choices=["random", "sharegpt"],
                     help="random ids, or a ShareGPT JSON file (--dataset-path)")
    thr.add_argument("--dataset-path", default=None, help="sharegpt: the JSON file")
    thr.add_argument("--sharegpt-output-len", type=int, default=None,
                     help="sharegpt: every output this long (default: the reference completion's tokens)")
    thr.add_argument("--input-len", "--random-input-len", dest="input_len", type=int, default=1024)
    thr.add_argument("--output-len", "--random-output-len", dest="output_len", type=int, default=128)
    thr.add_argument("--num-prompts", type=int, default=1000)
    thr.add_argument("--random-range-ratio", type=float, default=0.0,
                     help="lengths uniform in [len * (1 - r), len * (1 + r)]")
    thr.add_argument("--random-prefix-len", type=int, default=0, help="random ids every prompt starts with")
    thr.add_argument("--disable-tqdm", action="store_true")
    _common(thr)
    thr.set_defaults(run=run_throughput)


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--n", type=int, default=1, help="sequences per prompt")
    p.add_argument("--output-json", default=None, metavar="PATH", help="write the results here as JSON")
    add_engine_args(p, model_positional=False)


def _sampling_params(args, output_len: int):
    from compilelm.sampling_params import SamplingParams
    # vLLM's: sampled (temperature 1), exactly output_len tokens
    return SamplingParams(n=args.n, temperature=1.0, top_p=1.0, ignore_eos=True, max_tokens=output_len)


def _llm(args):
    from compilelm.llm import LLM
    if args.n < 1:
        raise ArgError(f"--n must be at least 1, got {args.n}")
    return LLM(engine_config=engine_config_from_args(args))


def _write_json(path: str | None, result: dict) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(result, f, indent=2)
        print(f"wrote {path}")


def run_latency(args: argparse.Namespace) -> int:
    if args.num_iters < 1 or args.num_iters_warmup < 0 or args.batch_size < 1:
        raise ArgError("--num-iters and --batch-size must be at least 1, --num-iters-warmup at least 0")
    if args.input_len < 1 or args.output_len < 1:
        raise ArgError("--input-len and --output-len must be at least 1")
    llm = _llm(args)
    vocab = llm.engine.model_config.vocab_size
    prompts = [r.prompt_token_ids for r in random_requests(args.batch_size, args.input_len, 1, vocab, seed=args.seed)]
    params = _sampling_params(args, args.output_len)

    def run_once() -> float:
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - t0
        if any(len(c.token_ids) != args.output_len for o in outs for c in o.outputs):
            raise RuntimeError("a sequence stopped short of --output-len (max_model_len too small?)")
        return elapsed

    for _ in tqdm(range(args.num_iters_warmup), desc="Warmup iterations"):
        run_once()
    latencies = [run_once() for _ in tqdm(range(args.num_iters), desc="Profiling iterations")]
    points = dict(zip(PERCENTILES, np.percentile(latencies, PERCENTILES).tolist()))
    print(f"Avg latency: {np.mean(latencies)} seconds")
    for p, v in points.items():
        print(f"{p}% percentile latency: {v} seconds")
    _write_json(args.output_json, {"avg_latency": float(np.mean(latencies)), "latencies": latencies,
                                   "percentiles": {str(p): v for p, v in points.items()},
                                   "batch_size": args.batch_size, "input_len": args.input_len,
                                   "output_len": args.output_len, "n": args.n})
    return 0


def run_throughput(args: argparse.Namespace) -> int:
    if args.dataset_name == "sharegpt" and not args.dataset_path:
        raise ArgError("--dataset-path: the sharegpt dataset needs its JSON file")
    llm = _llm(args)
    try:
        if args.dataset_name == "sharegpt":
            tokenizer = llm.get_tokenizer()
            if tokenizer is None:
                raise ArgError("--dataset-name: sharegpt needs the model's tokenizer, and this model has none")
            requests = sharegpt_requests(args.dataset_path, args.num_prompts, tokenizer, args.sharegpt_output_len,
                                         args.seed)
        else:
            requests = random_requests(args.num_prompts, args.input_len, args.output_len,
                                       llm.engine.model_config.vocab_size, args.random_range_ratio,
                                       args.random_prefix_len, args.seed)
    except ValueError as e:
        raise ArgError(str(e)) from e
    prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in requests]
    params = [_sampling_params(args, r.output_len) for r in requests]
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=not args.disable_tqdm)
    elapsed = time.perf_counter() - t0
    prompt_tokens = sum(len(r.prompt_token_ids) for r in requests)
    output_tokens = sum(len(c.token_ids) for o in outs for c in o.outputs)
    total = prompt_tokens + output_tokens
    print(f"Throughput: {len(requests) / elapsed:.2f} requests/s, {total / elapsed:.2f} total tokens/s, "
          f"{output_tokens / elapsed:.2f} output tokens/s")
    print(f"Total num prompt tokens:  {prompt_tokens}")
    print(f"Total num output tokens:  {output_tokens}")
    _write_json(args.output_json, {"elapsed_time": elapsed, "num_requests": len(requests),
                                   "total_num_tokens": total, "num_prompt_tokens": prompt_tokens,
                                   "num_output_tokens": output_tokens,
                                   "requests_per_second": len(requests) / elapsed,
                                   "tokens_per_second": total / elapsed,
                                   "output_tokens_per_second": output_tokens / elapsed})
    return 0
