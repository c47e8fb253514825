"""Online serving benchmark: N concurrent streaming clients against a live `compilelm serve`.

Every request has a prompt of exactly --input-len token ids and generates exactly --output-len
tokens (ignore_eos), so runs are comparable. The client is `compilelm bench serve`'s
(compilelm/entrypoints/bench/serve.py, vLLM's metrics): request and token throughput, and
percentiles of time to first token (TTFT), inter-token latency (ITL: each gap between streamed
chunks), time per output token (TPOT) and end-to-end latency (E2EL). This script adds the
launch of a server and the results JSON of benchmarks/.

    # CPU / CI size: launches the default model (eager) on a free port
    python benchmarks/bench_serve.py
    # against a running server, full size
    python benchmarks/bench_serve.py --base-url http://127.0.0.1:8000 --num-prompts 1000 \\
        --concurrency 64 --input-len 512 --output-len 128
    # launch with server flags (GPU machine)
    python benchmarks/bench_serve.py --server-args "--max-model-len 4096" --num-prompts 500 ...
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shlex
import signal
import socket
import subprocess
import sys
import time

import httpx

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.common import print_table, write_result  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--base-url", default=None, help="a running server (default: launch one)")
    p.add_argument("--server-args", default="--enforce-eager --max-model-len 1024",
                   help="flags for the launched `compilelm serve` (model first if any)")
    p.add_argument("--api-key", default=None)
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--concurrency", type=int, default=8, help="clients sending at once")
    p.add_argument("--input-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="JSON path (default benchmarks/results/serve_*.json)")
    return p.parse_args(argv)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(server_args: str) -> tuple[subprocess.Popen, str]:
    port = _free_port()
    cmd = [sys.executable, "-m", "compilelm.entrypoints.cli", "serve", *shlex.split(server_args),
           "--host", "127.0.0.1", "--port", str(port)]
    print("launching:", " ".join(cmd), flush=True)
    proc = subprocess.Popen(cmd)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 1800
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"server exited with {proc.returncode}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise SystemExit("server did not become healthy")


def bench_args(args) -> argparse.Namespace:
    """This benchmark's flags as `compilelm bench serve`'s: closed-loop clients are requests sent at
    once (rate inf) with at most --concurrency in flight; lengths fixed, ignore_eos."""
    from compilelm.entrypoints.bench.serve import add_parser
    sub = argparse.ArgumentParser().add_subparsers()
    add_parser(sub)
    return sub.choices["serve"].parse_args([
        "--num-prompts", str(args.num_prompts), "--max-concurrency", str(args.concurrency),
        "--random-input-len", str(args.input_len), "--random-output-len", str(args.output_len),
        "--seed", str(args.seed), "--ignore-eos", "--percentile-metrics", "ttft,tpot,itl,e2el",
        "--metric-percentiles", "50,90,99", "--disable-tqdm"])


def main(argv=None) -> int:
    from compilelm.entrypoints.bench import serve
    from compilelm.entrypoints.bench.dataset import random_requests

    args = parse_args(argv)
    if args.api_key:
        os.environ["OPENAI_API_KEY"] = args.api_key
    proc, url = (None, args.base_url) if args.base_url else launch(args.server_args)
    b = bench_args(args)
    metrics, points = serve.check_args(b)
    headers = serve.auth_headers()
    try:
        model = httpx.get(f"{url}/v1/models", headers=headers, timeout=30).json()["data"][0]["id"]
        vocab = len(serve.load_tokenizer_for(model))
        requests = random_requests(args.num_prompts, args.input_len, args.output_len, vocab, seed=args.seed)
        texts = [None] * len(requests)
        asyncio.run(serve.benchmark(b, url, requests[:1], texts[:1], model, "/v1/completions"))  # warm-up
        results, duration, peak = asyncio.run(serve.benchmark(b, url, requests, texts, model, "/v1/completions"))
        version = httpx.get(f"{url}/version", timeout=10, headers=headers).json()
    finally:
        if proc is not None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(120)
    summary = serve.summarize(results, duration, metrics, points)
    print(f"\nmodel {model}, {args.num_prompts} prompts, concurrency {args.concurrency} (peak {peak}), "
          f"input {args.input_len}, output {args.output_len} tokens\n")
    serve.print_report(summary, metrics, points, b, peak)
    rows = [{"metric": f"{m.upper()} (ms)", **{k: summary[f"{k}_{m}_ms"] for k in ("mean", "p50", "p90", "p99")}}
            for m in metrics]
    print_table(rows, ["metric", "mean", "p50", "p90", "p99"])
    name = f"serve_{time.strftime('%Y%m%d-%H%M%S')}"
    path = write_result(name, {"args": vars(args), "model": model, "server_version": version,
                               "peak_concurrency": peak, "summary": summary}, args.out)
    print(f"\nwrote {path}")
    return 0 if not summary["failed"] else 1


if __name__ == "__main__":
    sys.exit(main())
