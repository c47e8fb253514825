"""Online serving benchmark: N concurrent streaming clients against a live `compilelm serve`.

Every request has a prompt of exactly --input-len token ids and generates exactly --output-len
tokens (ignore_eos), so runs are comparable. Reports request and token throughput, and
percentiles of time to first token (TTFT), inter-token latency (ITL: the gap between streamed
chunks, per token), time per output token (TPOT) and end-to-end latency.

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
import json
import os
import random
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


async def one_request(client: httpx.AsyncClient, model: str, prompt: list[int],
                      output_len: int) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": output_len, "ignore_eos": True,
            "temperature": 0.0, "stream": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    chunk_times: list[tuple[float, int]] = []  # (arrival, tokens so far) of chunks with text
    usage, error = None, None
    async with client.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code != 200:
            return {"error": f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"}
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                error = event["error"]["message"]
            elif event.get("usage"):
                usage = event["usage"]
            elif event["choices"] and event["choices"][0]["text"]:
                chunk_times.append(time.perf_counter())
    end = time.perf_counter()
    if error or not chunk_times:
        return {"error": error or "no tokens"}
    out_tokens = usage["completion_tokens"] if usage else len(chunk_times)
    gaps = [b - a for a, b in zip(chunk_times, chunk_times[1:])]
    per_chunk = max(1, (out_tokens - 1) // max(1, len(gaps)))  # chunks may carry several tokens
    return {"ttft": chunk_times[0] - start, "e2e": end - start, "output_tokens": out_tokens,
            "prompt_tokens": usage["prompt_tokens"] if usage else len(prompt),
            "itl": [g / per_chunk for g in gaps],
            "tpot": (end - chunk_times[0]) / (out_tokens - 1) if out_tokens > 1 else 0.0}


async def run(url: str, args) -> tuple[list[dict], float, str]:
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=args.concurrency + 4)
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=3600, limits=limits) as c:
        model = (await c.get("/v1/models")).json()["data"][0]["id"]
        rng = random.Random(args.seed)
        prompts = [[rng.randrange(100, 20000) for _ in range(args.input_len)]
                   for _ in range(args.num_prompts)]
        await one_request(c, model, prompts[0][:8], 2)  # warm-up, not measured
        queue = list(reversed(prompts))
        results: list[dict] = []

        async def client_loop():
            while queue:
                results.append(await one_request(c, model, queue.pop(), args.output_len))

        t0 = time.perf_counter()
        await asyncio.gather(*[client_loop() for _ in range(args.concurrency)])
        return results, time.perf_counter() - t0, model


def percentiles(values: list[float]) -> dict:
    if not values:
        return {}
    s = sorted(values)

    def pct(p):
        return s[min(len(s) - 1, round(p / 100 * (len(s) - 1)))]

    return {"mean": sum(s) / len(s), "p50": pct(50), "p90": pct(90), "p99": pct(99)}


def main(argv=None) -> int:
    args = parse_args(argv)
    proc, url = (None, args.base_url) if args.base_url else launch(args.server_args)
    try:
        results, duration, model = asyncio.run(run(url, args))
        version = httpx.get(f"{url}/version", timeout=10, headers={
            "Authorization": f"Bearer {args.api_key}"} if args.api_key else {}).json()
    finally:
        if proc is not None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(120)
    ok = [r for r in results if "error" not in r]
    errors = [r["error"] for r in results if "error" in r]
    out_tokens = sum(r["output_tokens"] for r in ok)
    in_tokens = sum(r["prompt_tokens"] for r in ok)
    summary = {
        "completed": len(ok), "failed": len(errors), "duration_s": duration,
        "request_throughput": len(ok) / duration, "output_throughput": out_tokens / duration,
        "total_token_throughput": (in_tokens + out_tokens) / duration,
        "ttft_s": percentiles([r["ttft"] for r in ok]),
        "itl_s": percentiles([g for r in ok for g in r["itl"]]),
        "tpot_s": percentiles([r["tpot"] for r in ok]),
        "e2e_s": percentiles([r["e2e"] for r in ok]),
    }
    print(f"\nmodel {model}, {args.num_prompts} prompts, concurrency {args.concurrency}, "
          f"input {args.input_len}, output {args.output_len} tokens: {len(ok)} ok, "
          f"{len(errors)} failed in {duration:.1f} s")
    print(f"throughput: {summary['request_throughput']:.2f} req/s, "
          f"{summary['output_throughput']:.1f} output tok/s, "
          f"{summary['total_token_throughput']:.1f} total tok/s\n")
    rows = [{"metric": name, **{k: v * 1000 for k, v in summary[key].items()}}
            for name, key in (("TTFT (ms)", "ttft_s"), ("ITL (ms)", "itl_s"),
                              ("TPOT (ms)", "tpot_s"), ("E2E (ms)", "e2e_s"))]
    print_table(rows, ["metric", "mean", "p50", "p90", "p99"])
    if errors:
        print("errors (first 3):", errors[:3])
    name = f"serve_{time.strftime('%Y%m%d-%H%M%S')}"
    path = write_result(name, {"args": vars(args), "model": model, "server_version": version,
                               "summary": summary}, args.out)
    print(f"\nwrote {path}")
    return 0 if not errors else 1


if __name__ == "__main__":
    sys.exit(main())
