"""compilelm against vLLM on one machine: the same random-weight shapes, the same requests, one
engine per process, one table of ratios.

Each (engine, model) runs in a process of its own (vLLM from `--vllm-site`, a folder built by
../shared/peers/build_vllm_site.sh; without it, compilelm alone) and measures, through its
offline `LLM.generate` with token-id prompts, `ignore_eos` and no detokenization:

- start: process start -> the engine ready (imports, weights, compile, CUDA graphs);
- decode ms/step for each `--decode BATCHxCONTEXT` case (default batch 1 and 64 at context 1000,
  1 and 16 at 16000): (t(long) - t(short)) / (long - short) for `batch` fresh prompts of `context`
  tokens and `--decode-steps` (short, long) output tokens, greedy, so the prefill cancels;
- prefill tok/s: `--prefill` batches of prompts (e.g. 16x2000), one output token, fresh prompts
  (no prefix-cache hits), best of `--repeat`;
- offline throughput in output tok/s on two mixes: nano-vllm's (256 requests, prompt and output
  lengths uniform in 100-1024, temperature 0.6) and long prompts / short outputs (prompts
  1000-4000, outputs 50-300);
- online latency at each `--online RATE` (requests/s, Poisson arrivals; 200 requests, prompts
  200-1000, outputs 50-200 tokens, greedy), through the engine's own add_request/step loop, the
  same loop for both engines: TTFT (arrival -> first token, queueing included) and ITL (time
  between a stream's tokens) p50 / p99 in ms.

Random weights: compilelm's `dummy:<preset>`; vLLM's `load_format="dummy"` over a folder holding
only that preset's config.json. The prompts of both engines come from the same seeds.

    python benchmarks/bench_vs_vllm.py [--models dummy:qwen3-0.6b ...] [--vllm-site /tmp/vllm_site]
    python benchmarks/bench_vs_vllm.py --models dummy:smollm2-135m --layers 2 --small   # CPU smoke
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.common import print_table, write_result  # noqa: E402

MIXES = {"nano-vllm": dict(n=256, prompt=(100, 1024), output=(100, 1024), temperature=0.6),
         "long-prompt": dict(n=128, prompt=(1000, 4000), output=(50, 300), temperature=0.6)}
SMALL_MIXES = {"nano-vllm": dict(n=6, prompt=(4, 24), output=(4, 12), temperature=0.6),
               "long-prompt": dict(n=4, prompt=(24, 48), output=(2, 6), temperature=0.6)}
ONLINE = dict(n=200, prompt=(200, 1000), output=(50, 200))
SMALL_ONLINE = dict(n=6, prompt=(4, 24), output=(3, 6))


def token_prompts(n: int, lengths: tuple[int, int], vocab: int, seed: int) -> list[list[int]]:
    """`n` prompts of random token ids below min(10000, vocab), lengths uniform in `lengths`."""
    rng = random.Random(seed)
    return [[rng.randrange(min(10000, vocab)) for _ in range(rng.randint(*lengths))] for _ in range(n)]


# -- the engines, behind one interface: generate(prompts, max_tokens per prompt, temperature) ----

class CompilelmEngine:
    def __init__(self, model: str, args):
        from compilelm import LLM, SamplingParams
        from compilelm.ops import prefill_attention

        prefill_attention.set_enabled(args.prefill_kernel == "triton")
        self.sp = SamplingParams
        overrides = {"num_hidden_layers": args.layers} if args.layers else {}
        self.llm = LLM(model, max_model_len=args.max_model_len, model_overrides=overrides,
                       enforce_eager=args.enforce_eager, seed=0, kv_cache_dtype=args.kv_cache_dtype,
                       tensor_parallel_size=args.tensor_parallel_size, quantization=quantization(args),
                       **step_limits(args))
        self.vocab = self.llm.engine.model_config.vocab_size
        sched = self.llm.engine.config.scheduler
        self.limits = {"max_num_batched_tokens": sched.max_num_batched_tokens, "max_num_seqs": sched.max_num_seqs}

    def generate(self, prompts, max_tokens, temperature=0.0) -> int:
        params = [self.sp(temperature=temperature, max_tokens=m, ignore_eos=True) for m in max_tokens]
        outs = self.llm.generate(prompts, params, use_tqdm=False)
        return sum(len(o.outputs[0].token_ids) for o in outs)

    def add(self, request_id: str, prompt: list[int], max_tokens: int) -> None:
        self.llm.engine.add_request(request_id, prompt, self.sp(temperature=0.0, max_tokens=max_tokens,
                                                                ignore_eos=True))

    def step(self) -> list[tuple[str, int, bool]]:
        """One engine step: (request id, tokens so far, finished) of each request it advanced."""
        return [(o.request_id, len(o.outputs[0].token_ids), o.finished) for o in self.llm.engine.step()]


class VllmEngine:
    def __init__(self, model: str, args):
        from vllm import LLM, SamplingParams

        from compilelm.models.config import DUMMY_PRESETS

        config = {**DUMMY_PRESETS[model.split(":", 1)[1]], "torch_dtype": "bfloat16"}
        config["model_type"] = "qwen3" if config["architectures"][0].startswith("Qwen3") else "llama"
        if args.layers:
            config["num_hidden_layers"] = args.layers
        self.dir = tempfile.mkdtemp(prefix="vllm_dummy_")
        with open(os.path.join(self.dir, "config.json"), "w") as f:
            json.dump(config, f)
        self.sp = SamplingParams
        self.llm = LLM(model=self.dir, load_format="dummy", skip_tokenizer_init=True, dtype="bfloat16",
                       max_model_len=args.max_model_len, gpu_memory_utilization=0.85, seed=0,
                       enforce_eager=args.enforce_eager, kv_cache_dtype=args.kv_cache_dtype,
                       tensor_parallel_size=args.tensor_parallel_size, quantization=quantization(args),
                       **step_limits(args))
        self.vocab = config["vocab_size"]
        sched = self.llm.llm_engine.vllm_config.scheduler_config
        self.limits = {"max_num_batched_tokens": sched.max_num_batched_tokens, "max_num_seqs": sched.max_num_seqs}

    def generate(self, prompts, max_tokens, temperature=0.0) -> int:
        params = [self.sp(temperature=temperature, max_tokens=m, ignore_eos=True, detokenize=False)
                  for m in max_tokens]
        outs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return sum(len(o.outputs[0].token_ids) for o in outs)

    def add(self, request_id: str, prompt: list[int], max_tokens: int) -> None:
        self.llm.llm_engine.add_request(request_id, {"prompt_token_ids": prompt},
                                        self.sp(temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
                                                detokenize=False))

    def step(self) -> list[tuple[str, int, bool]]:
        return [(o.request_id, len(o.outputs[0].token_ids), o.finished) for o in self.llm.llm_engine.step()]


def quantization(args) -> str | None:
    """Both engines' `quantization`: None (the model's dtype) or "fp8" (dynamic W8A8 linears)."""
    return None if args.quantization == "none" else args.quantization


def step_limits(args) -> dict:
    """The step limits given on the command line, for either engine (else each picks its own)."""
    return {k: getattr(args, k) for k in ("max_num_batched_tokens", "max_num_seqs") if getattr(args, k) is not None}


def sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(engine, prompts, max_tokens, temperature=0.0) -> tuple[float, int]:
    sync()
    t0 = time.perf_counter()
    tokens = engine.generate(prompts, max_tokens, temperature)
    sync()
    return time.perf_counter() - t0, tokens


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0-100) of `values`, linearly interpolated."""
    v = sorted(values)
    i = (len(v) - 1) * q / 100
    lo = int(i)
    return v[lo] + (v[min(lo + 1, len(v) - 1)] - v[lo]) * (i - lo)


def online(engine, prompts: list[list[int]], max_tokens: list[int], rate: float, seed: int) -> dict:
    """Requests arriving at `rate` per second (Poisson), served by the engine's step loop: TTFT
    (arrival -> the step that returns its first token, queueing included) and ITL (the gaps
    between a stream's tokens; a step returning k tokens counts k gaps of 1/k of its gap) in ms."""
    rng = random.Random(seed)
    arrivals, t = [], 0.0
    for _ in prompts:
        t += rng.expovariate(rate)
        arrivals.append(t)
    ttft, itl = [], []
    seen, last = {}, {}  # unfinished requests by index: tokens so far, time of the last
    nxt, done = 0, 0
    t0 = time.perf_counter()
    while done < len(prompts):
        now = time.perf_counter() - t0
        while nxt < len(prompts) and arrivals[nxt] <= now:
            engine.add(f"online{nxt}.", prompts[nxt], max_tokens[nxt])  # (an engine may suffix the id)
            seen[nxt], nxt = 0, nxt + 1
        if not seen:  # idle until the next arrival
            time.sleep(max(0.0, arrivals[nxt] - now))
            continue
        outs = engine.step()
        now = time.perf_counter() - t0
        for request_id, tokens, finished in outs:
            rid = int(request_id[len("online"):request_id.index(".")])
            new = tokens - seen[rid]
            if new > 0:
                if seen[rid] == 0:
                    ttft.append(now - arrivals[rid])
                else:
                    itl.extend([(now - last[rid]) / new] * new)
                seen[rid], last[rid] = tokens, now
            if finished:
                done += 1
                del seen[rid]
                last.pop(rid, None)
    ms = 1e3
    return {"ttft_ms_p50": percentile(ttft, 50) * ms, "ttft_ms_p99": percentile(ttft, 99) * ms,
            "itl_ms_p50": percentile(itl, 50) * ms, "itl_ms_p99": percentile(itl, 99) * ms}


def measure(engine_name: str, model: str, args, started: float) -> dict:
    """Every measurement of one engine on one model (in this process)."""
    engine = (VllmEngine if engine_name == "vllm" else CompilelmEngine)(model, args)
    out = {"engine": engine_name, "model": model, "kv_cache_dtype": args.kv_cache_dtype,
           "quantization": args.quantization,
           "start_s": time.time() - started, **engine.limits, "tensor_parallel_size": args.tensor_parallel_size}
    vocab, seed = engine.vocab, iter(range(1000, 10**6))
    timed(engine, token_prompts(2, (8, 16), vocab, 0), [4, 4])  # warm-up (lazy init, first sizes)
    short, long_ = args.decode_steps
    for spec in args.decode:
        batch, context = map(int, spec.split("x"))
        times = []
        for steps in (short, long_):
            prompts = token_prompts(batch, (context, context), vocab, next(seed))
            times.append(timed(engine, prompts, [steps] * batch)[0])
        out[f"decode_ms b{batch} c{context}"] = 1e3 * (times[1] - times[0]) / (long_ - short)
    for spec in args.prefill:
        n, length = map(int, spec.split("x"))
        best = min(timed(engine, token_prompts(n, (length, length), vocab, next(seed)), [1] * n)[0]
                   for _ in range(args.repeat))
        out[f"prefill_tok_s {spec}"] = n * length / best
    rng = random.Random(7)
    for name, mix in (SMALL_MIXES if args.small else MIXES).items():
        if name not in args.mixes:
            continue
        prompts = token_prompts(mix["n"], mix["prompt"], vocab, next(seed))
        lens = [rng.randint(*mix["output"]) for _ in prompts]
        wall, tokens = timed(engine, prompts, lens, mix["temperature"])
        out[f"throughput_tok_s {name}"] = tokens / wall
    spec = SMALL_ONLINE if args.small else ONLINE
    for rate in args.online:
        prompts = token_prompts(spec["n"], spec["prompt"], vocab, next(seed))
        lens = [rng.randint(*spec["output"]) for _ in prompts]
        for k, v in online(engine, prompts, lens, rate, seed=11).items():
            out[f"{k} r{rate:g}"] = v
    return out


def run_one(engine_name: str, model: str, args) -> dict:
    """`measure` in a fresh process (vLLM's with its site folder on PYTHONPATH)."""
    env = dict(os.environ)
    if engine_name == "vllm":
        env.update(PYTHONPATH=os.pathsep.join([args.vllm_site, env.get("PYTHONPATH", "")]).rstrip(os.pathsep),
                   VLLM_USE_FLASHINFER_SAMPLER="0", HF_HUB_OFFLINE="1", VLLM_NO_USAGE_STATS="1")
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        result = f.name
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", engine_name, model, result, *sys.argv[1:]]
    env["BENCH_VS_VLLM_LAUNCHED"] = repr(time.time())  # the worker's start_s counts from here
    try:
        code = subprocess.run(cmd, env=env, timeout=args.timeout).returncode
        error = None if code == 0 else f"exit code {code}"
    except subprocess.TimeoutExpired:  # killed; a row written before a hung exit still counts
        error = f"timed out after {args.timeout:g} s"
    if not os.path.getsize(result):
        return {"engine": engine_name, "model": model, "error": error or "no result"}
    with open(result) as f:
        row = json.load(f)
    if error is not None:
        row["exit"] = error  # measured, but the process did not exit cleanly (e.g. a TP rank's teardown)
    return row


def ratios(rows: list[dict]) -> list[dict]:
    """One row per (model, metric): compilelm, vLLM and compilelm's advantage (> 1: compilelm ahead;
    for ms/step and start time, the inverse ratio)."""
    table = []
    for model in dict.fromkeys(r["model"] for r in rows):
        ours = next((r for r in rows if r["model"] == model and r["engine"] == "compilelm"), {})
        peer = next((r for r in rows if r["model"] == model and r["engine"] == "vllm"), {})
        # (kv_cache_dtype, quantization, tensor_parallel_size: both engines ran with them, in the rows)
        for metric in [k for k in ours if k not in ("engine", "model", "error", "kv_cache_dtype",
                                                    "quantization", "tensor_parallel_size")]:
            a, b = ours[metric], peer.get(metric)
            lower_is_better = metric.startswith(("decode_ms", "start_s", "ttft_ms", "itl_ms"))
            settings = metric in ("max_num_batched_tokens", "max_num_seqs")  # each engine's own: what ran
            adv = None if b is None or settings else (b / a if lower_is_better else a / b)
            table.append({"model": model, "metric": metric, "compilelm": a, "vllm": b, "compilelm_advantage": adv})
    return table


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", default=["dummy:qwen3-0.6b", "dummy:llama-3.2-1b", "dummy:llama-3.1-8b"])
    ap.add_argument("--vllm-site", default=os.environ.get("VLLM_SITE", "/tmp/vllm_site"),
                    help="vLLM's site-packages folder (build_vllm_site.sh); absent: compilelm alone")
    ap.add_argument("--decode", nargs="*", default=["1x1000", "64x1000", "1x16000", "16x16000"],
                    metavar="BATCHxCONTEXT", help="decode cases")
    ap.add_argument("--decode-steps", type=int, nargs=2, default=[16, 80])
    ap.add_argument("--prefill", nargs="+", default=["16x2000", "4x8000"], help="NxLENGTH prompt batches")
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--mixes", nargs="*", choices=list(MIXES), default=list(MIXES), help="offline throughput mixes")
    ap.add_argument("--online", type=float, nargs="*", default=[], metavar="RATE",
                    help="online latency at these request rates (requests/s)")
    ap.add_argument("--max-model-len", type=int, default=16384 + 128)
    ap.add_argument("--layers", type=int, default=None, help="cut every model to this many layers")
    ap.add_argument("--small", action="store_true", help="tiny mixes (CPU smoke test)")
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument("--max-num-batched-tokens", type=int, default=None,
                    help="both engines' step budget (default: each engine's own; both follow vLLM's per-GPU defaults)")
    ap.add_argument("--max-num-seqs", type=int, default=None, help="both engines' sequences per step (default: own)")
    ap.add_argument("--prefill-kernel", choices=("triton", "mma"), default="triton",
                    help="compilelm's prefill attention: the Triton kernel, or paged_attention's mma.sync one (A/B)")
    ap.add_argument("--kv-cache-dtype", default="auto", choices=("auto", "fp8", "fp8_e4m3"),
                    help="both engines' KV cache: the model's dtype, or fp8 (e4m3, scales 1.0)")
    ap.add_argument("--quantization", "-q", default="none", choices=("none", "fp8"),
                    help="both engines' linears: the model's dtype, or fp8 (dynamic W8A8, each engine's own scales)")
    ap.add_argument("--tensor-parallel-size", "-tp", type=int, default=1, help="both engines' GPUs per model")
    ap.add_argument("--timeout", type=float, default=900)
    ap.add_argument("--out", default=None)
    return ap.parse_args(argv)


def main(argv=None) -> dict:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--worker"]:  # a measuring process: --worker ENGINE MODEL RESULT_JSON <the driver's args>
        started = float(os.environ.get("BENCH_VS_VLLM_LAUNCHED", time.time()))
        engine_name, model, result = argv[1:4]
        row = measure(engine_name, model, parse(argv[4:]), started)
        with open(result, "w") as f:
            json.dump(row, f)
        return row
    args = parse(argv)
    have_vllm = os.path.isdir(os.path.join(args.vllm_site, "vllm"))
    if not have_vllm:
        print(f"no vLLM at {args.vllm_site}: compilelm alone", flush=True)
    sys.argv = [sys.argv[0], *argv]  # what run_one hands its workers
    rows = []
    for model in args.models:
        for engine_name in ("compilelm", "vllm") if have_vllm else ("compilelm",):
            rows.append(run_one(engine_name, model, args))
            print(json.dumps(rows[-1]), flush=True)
    table = ratios(rows)
    print_table(table, ["model", "metric", "compilelm", "vllm", "compilelm_advantage"])
    payload = {"rows": rows, "ratios": table, "vllm": have_vllm, "args": vars(args)}
    print("wrote", write_result("bench_vs_vllm", payload, args.out))
    return payload


if __name__ == "__main__":
    main()
