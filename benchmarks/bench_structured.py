"""Structured outputs: what a grammar costs the batch it runs in, and what a new schema costs the
streams already running.

1. Throughput (offline engine): a batch of --num-requests requests, each a prompt of --input-len
   random token ids and exactly --output-len output tokens, greedy; once with no constraint, once
   with 1 request in 8 held to a JSON schema (an array of objects that cannot end within
   --output-len, so every request generates the same tokens). Output tokens/s of both, and their
   ratio (the goal on the GPU: >= 0.90). Each mode runs once to warm up (graphs, the schema's
   compile), then --repeats rounds, each running every batch in turn; a constrained batch's ratio
   is the median over rounds of the two batches' times in the same round (min and max in the
   JSON), its tok/s from its median time. `--mask-fill thread,inline` runs one
   constrained batch per way of filling the masks (the mask thread; the engine thread itself),
   `--torch-threads 16,1` one set of batches per count of torch's intra-op threads;
   `--phases` times the engine's step phases (schedule, inputs, launches, the waits for sampled
   ids and for masks, grammar accepts, output processing) in each batch's last run, us per step,
   and the mask fill itself (on the mask thread: it overlaps the engine's phases).
2. New schema (the HTTP server): --streams streaming requests run; once each has streamed
   --arrive-after tokens, a chat request arrives without a constraint, then the same request
   with a JSON schema never seen before (--schema-fields properties: patterns, enums, nested
   objects). Reported: the running streams' gaps between tokens (ITL) before (median, p99), the
   largest gap from each arrival to that request's first token (its prefill shares a step with
   them), each one's time to first token, and the schema's compile time on its own (what an
   engine thread that compiled it would stall every stream for).

    python benchmarks/bench_structured.py        # GPU: the default model's shape, compiled, 64 requests, 8 streams
    python benchmarks/bench_structured.py --enforce-eager --num-requests 16 --input-len 32 --output-len 32 \\
        --streams 4 --stream-len 64 --arrive-after 16   # CPU size
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import gzip
import json
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
import uuid

import httpx
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.bench_serve import launch  # noqa: E402
from benchmarks.common import print_table, write_result  # noqa: E402

# an array of records that cannot close within any --output-len: every request runs to max_tokens
RECORDS = {"type": "array", "minItems": 100000, "items": {
    "type": "object", "additionalProperties": False, "required": ["id", "name", "kind", "score"],
    "properties": {"id": {"type": "integer"}, "name": {"type": "string", "maxLength": 12},
                   "kind": {"enum": ["alpha", "beta", "gamma"]}, "score": {"type": "number"}}}}


def big_schema(fields: int, salt: str) -> dict:
    """A schema no cache holds (`salt` in its names): strings with patterns, enums, nested objects."""
    props = {}
    for i in range(fields):
        name = f"f{i}_{salt}"
        if i % 3 == 0:
            props[name] = {"type": "string", "pattern": "^[A-Z][a-z]{2,8}-[0-9]{3}$"}
        elif i % 3 == 1:
            props[name] = {"enum": [f"v{j}_{i}" for j in range(20)]}
        else:
            props[name] = {"type": "object", "required": ["x", "y"], "additionalProperties": False,
                           "properties": {"x": {"type": "number"}, "y": {"type": "array", "items": {"type": "integer"},
                                                                        "maxItems": 4}}}
    return {"type": "object", "properties": props, "required": list(props), "additionalProperties": False}


def resolve_model_and_tokenizer(args) -> None:
    """Without --model: the default model where its package is installed, else (the GPU machine has
    none) its shape with random weights, `dummy:smollm2-135m`, and its tokenizer from
    benchmarks/data (the grammars need a real vocabulary; the work does not depend on the weights).
    Another `dummy:` shape without --tokenizer gets that tokenizer too (its ids are below every
    preset's vocabulary; the masks refuse the ids past it)."""
    if args.model is not None and not (args.model.startswith("dummy:") and args.tokenizer is None):
        return
    if args.model is None:
        from compilelm.models.loader import default_model_path
        try:
            default_model_path()
            return
        except FileNotFoundError:
            pass
    src = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "smollm2_tokenizer")
    folder = tempfile.mkdtemp(prefix="smollm2_tokenizer_")
    for name in ("tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(os.path.join(src, name), folder)
    with gzip.open(os.path.join(src, "tokenizer.json.gz"), "rb") as f, \
            open(os.path.join(folder, "tokenizer.json"), "wb") as out:
        shutil.copyfileobj(f, out)
    args.model, args.tokenizer = args.model or "dummy:smollm2-135m", args.tokenizer or folder


def bench_throughput(args) -> list[dict]:
    from compilelm import LLM, SamplingParams
    from compilelm.sampling_params import StructuredOutputsParams

    llm = LLM(args.model, tokenizer=args.tokenizer, enforce_eager=args.enforce_eager,
              max_model_len=args.input_len + args.output_len + 16,
              max_num_seqs=max(args.num_requests, 8), max_num_batched_tokens=max(2048, args.input_len * 8))
    vocab = llm.engine.model_config.vocab_size
    rng = random.Random(0)
    prompts = [[rng.randint(100, min(10000, vocab) - 1) for _ in range(args.input_len)]
               for _ in range(args.num_requests)]
    schema = StructuredOutputsParams(json=RECORDS)

    def params(i: int, constrained: bool):
        return SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True,
                              structured_outputs=schema if constrained and i % 8 == 0 else None)

    fills = args.mask_fill.split(",")
    threads = [int(t) for t in args.torch_threads.split(",")] if args.torch_threads else [torch.get_num_threads()]
    # (torch threads, fill or None: unconstrained); each thread count has its unconstrained batch
    modes = [(t, f) for t in threads for f in [None] + fills]
    times: list[list[float]] = [[] for _ in modes]
    phases: list[dict] = [{} for _ in modes]
    outs_of: list = [None] * len(modes)
    # rounds of every mode in turn (round 0 warms up): a slow spell of the host hits all modes,
    # and each constrained mode's ratio is the median over rounds of its time against the
    # unconstrained batch's of the same round and thread count
    for run in range(args.repeats + 1):
        for m, (t, fill) in enumerate(modes):
            torch.set_num_threads(t)
            set_mask_fill(llm.engine, fill or "thread")
            batch = [params(i, fill is not None) for i in range(args.num_requests)]
            sync()
            with time_phases(llm.engine, phases[m] if run == args.repeats and args.phases else None):
                t0 = time.perf_counter()
                outs_of[m] = llm.generate(prompts, batch, use_tqdm=False)
                sync()
            if run:
                times[m].append(time.perf_counter() - t0)
    torch.set_num_threads(threads[0])
    rows = []
    for m, (t, fill) in enumerate(modes):
        outs = outs_of[m]
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        assert tokens == args.num_requests * args.output_len, tokens
        if fill is not None:  # the grammar held: request 0 writes the array
            assert outs[0].outputs[0].text.lstrip().startswith("["), outs[0].outputs[0].text
        label = "none constrained" if fill is None else "1 in 8 constrained" + (
            f", {fill} fill" if len(fills) > 1 else "")
        if len(threads) > 1:
            label += f", {t} torch threads"
        wall = statistics.median(times[m])
        rows.append({"batch": label, "requests": args.num_requests, "torch_threads": t,
                     "constrained": sum(i % 8 == 0 for i in range(args.num_requests)) if fill else 0,
                     "output_tok_s": tokens / wall, "wall_s": wall, "wall_s_runs": [round(x, 4) for x in times[m]]})
        if fill is not None:
            base = modes.index((t, None))
            ratios = [a / b for a, b in zip(times[base], times[m])]
            rows[-1].update(ratio=statistics.median(ratios), ratio_min=min(ratios), ratio_max=max(ratios))
        if phases[m]:
            steps = phases[m]["step"][1]
            rows[-1]["phases_us_per_step"] = {k: round(1e6 * x / steps, 1) for k, (x, n) in phases[m].items()}
            rows[-1]["phase_calls_per_step"] = {k: round(n / steps, 2) for k, (x, n) in phases[m].items()}
    if args.torch_profile:  # the engine thread's ops and CUDA calls: one more run of each batch
        for row, (t, fill) in zip(rows, modes):
            torch.set_num_threads(t)
            set_mask_fill(llm.engine, fill or "thread")
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU] + (
                    [torch.profiler.ProfilerActivity.CUDA] if torch.cuda.is_available() else [])) as prof:
                llm.generate(prompts, [params(i, fill is not None) for i in range(args.num_requests)], use_tqdm=False)
                sync()
            row["torch_profile"] = prof.key_averages().table(sort_by="self_cpu_time_total",
                                                             row_limit=args.torch_profile).splitlines()
            print(row["batch"], *row["torch_profile"], sep="\n")
    torch.set_num_threads(threads[0])
    set_mask_fill(llm.engine, "thread")
    if args.host_profile:  # where the host's time goes: one more run of each mode under cProfile
        import cProfile
        import io
        import pstats
        for row, constrained in zip(rows, (False, True)):
            prof = cProfile.Profile()
            prof.enable()
            llm.generate(prompts, [params(i, constrained) for i in range(args.num_requests)], use_tqdm=False)
            sync()
            prof.disable()
            text = io.StringIO()
            pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(args.host_profile)
            row["host_profile"] = [line for line in text.getvalue().splitlines() if line.strip()]
    llm.engine.shutdown()
    return rows


def set_mask_fill(engine, fill: str) -> None:
    """`fill`: "thread" or "inline", optionally ":N" for N mask-executor threads (llguidance's
    default without); the engine's backend keeps one executor and mask thread per N."""
    from compilelm.runtime.structured_output import GuidanceBackend
    from compilelm.runtime.structured_output.bitmask import MaskFiller

    mode, _, threads = fill.partition(":")
    if mode not in ("thread", "inline"):
        raise SystemExit(f"--mask-fill: {fill!r} is not thread[:N] or inline[:N]")
    MaskFiller.threaded = mode == "thread"
    want = int(threads) if threads else None
    backend = getattr(engine, "_structured_output", None)
    if want != GuidanceBackend.mask_threads:
        if backend is not None:  # each thread count keeps its executor and mask thread across rounds
            kept = backend.__dict__.setdefault("_bench_executors", {})
            kept[GuidanceBackend.mask_threads] = (backend._executor, backend._filler)
            backend._executor, backend._filler = kept.get(want, (None, None))
        GuidanceBackend.mask_threads = want


@contextlib.contextmanager
def time_phases(engine, totals: dict | None):
    """While open, the engine's step phases add [seconds, calls] to `totals[phase]` (inclusive wall
    time on the engine thread; nested phases overlap); None: nothing is timed."""
    if totals is None:
        yield
        return
    from compilelm.runtime import async_step
    from compilelm.runtime.structured_output.bitmask import MaskFiller

    runner = engine.executor.model_runner

    def timed(fn, label):
        def wrapper(*a, **k):
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                rec = totals.setdefault(label, [0.0, 0])
                rec[0] += time.perf_counter() - t
                rec[1] += 1
        return wrapper

    class TimedFuture:  # the masks' Future: what sampling waits for them
        def __init__(self, future):
            self.future = future

        def result(self):
            return timed(self.future.result, "sample: wait for masks")()

    start = runner.start_masks

    def start_masks(sched):
        masks = start(sched)
        return masks if masks is None else dataclasses.replace(masks, packed=TimedFuture(masks.packed))

    patched = [(engine, "step", "step"), (engine.scheduler, "schedule", "schedule"),
               (runner, "prepare_step", "prepare inputs"), (runner, "run_step", "forward launch"),
               (runner, "sample_async", "sample launch"), (engine, "_accept_grammar_tokens", "grammar accept"),
               (engine, "_process_step", "process outputs")]
    for obj, name, label in patched:
        setattr(obj, name, timed(getattr(obj, name), label))
    runner.start_masks = timed(start_masks, "start masks")
    get = async_step.AsyncStepOutput.get
    async_step.AsyncStepOutput.get = timed(get, "wait for sampled ids")
    fill = MaskFiller._fill_masks  # on the mask thread (or inline): overlaps the phases above
    MaskFiller._fill_masks = timed(fill, "mask fill (llguidance + tags)")
    try:
        yield
    finally:
        async_step.AsyncStepOutput.get = get
        MaskFiller._fill_masks = fill
        for obj, name, _ in patched + [(runner, "start_masks", None)]:
            delattr(obj, name)


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


async def _stream(client: httpx.AsyncClient, body: dict, path: str, times: list[float], started: asyncio.Event,
                  arrive_after: int) -> None:
    async with client.stream("POST", path, json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread())[:300]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                raise RuntimeError(event["error"]["message"])
            choice = event["choices"][0] if event["choices"] else {}
            if choice.get("text") or (choice.get("delta") or {}).get("content"):
                times.append(time.perf_counter())
                if len(times) >= arrive_after:
                    started.set()


async def bench_new_schema(url: str, args) -> dict:
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        model = (await client.get("/v1/models")).json()["data"][0]["id"]
        ask = [{"role": "user", "content": "Fill in the form."}]
        # warm-up: the first chat request compiles the chat template (and runs the first prefill)
        (await client.post("/v1/chat/completions", json={"model": model, "messages": ask, "max_tokens": 2})
         ).raise_for_status()
        rng = random.Random(1)
        streams = [[] for _ in range(args.streams)]
        events = [asyncio.Event() for _ in range(args.streams)]
        tasks = [asyncio.ensure_future(_stream(client, {
            "model": model, "prompt": [rng.randint(100, 10000) for _ in range(32)], "max_tokens": args.stream_len,
            "ignore_eos": True, "temperature": 0.0, "stream": True}, "/v1/completions", times, event,
            args.arrive_after)) for times, event in zip(streams, events)]
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in events)), 600)
        arrivals = {}
        for kind in ("plain", "schema"):  # the same request without, then with a new schema
            body = {"model": model, "messages": ask, "max_tokens": 8, "temperature": 0.0, "stream": True}
            if kind == "schema":
                body["response_format"] = {"type": "json_schema", "json_schema": {
                    "name": "form", "schema": big_schema(args.schema_fields, uuid.uuid4().hex[:8])}}
            new_times: list[float] = []
            arrival = time.perf_counter()
            await _stream(client, body, "/v1/chat/completions", new_times, asyncio.Event(), 1)
            arrivals[kind] = (arrival, new_times[0])
        await asyncio.gather(*tasks)
    gaps = [(a, b) for s in streams for a, b in zip(s, s[1:])]
    row = {"streams": args.streams, "schema_fields": args.schema_fields}
    before = [b - a for a, b in gaps if b <= arrivals["plain"][0]]
    for kind, (arrival, first) in arrivals.items():
        across = [b - a for a, b in gaps if b > arrival and a < first]
        row[f"{kind}_itl_across_arrival_max_ms"] = round(max(across) * 1e3, 2) if across else None
        row[f"{kind}_ttft_ms"] = round((first - arrival) * 1e3, 2)
    row["itl_before_median_ms"] = round(statistics.median(before) * 1e3, 2)
    row["itl_before_p99_ms"] = round(sorted(before)[int(0.99 * (len(before) - 1))] * 1e3, 2)
    from compilelm.models.loader import resolve_model
    from compilelm.models.tokenizer import load_tokenizer
    from compilelm.runtime.structured_output import GuidanceBackend
    from compilelm.sampling_params import StructuredOutputsParams

    tok = load_tokenizer(resolve_model(args.model), args.tokenizer)
    backend = GuidanceBackend(tok, len(tok), [tok.eos_token_id])
    backend.ll_tokenizer()
    t0 = time.perf_counter()
    backend.compile(StructuredOutputsParams(json=big_schema(args.schema_fields, uuid.uuid4().hex[:8])))
    compile_s = time.perf_counter() - t0
    backend.shutdown()
    row["schema_compile_ms"] = round(compile_s * 1e3, 2)
    return row


def main(argv=None) -> dict:
    gpu = torch.cuda.is_available()
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="default: the default model (SmolLM2-135M-Instruct), or its "
                    "shape with random weights and its tokenizer (benchmarks/data) where it is not installed")
    ap.add_argument("--tokenizer", default=None, help="a tokenizer folder (--tokenizer of the engine)")
    ap.add_argument("--num-requests", type=int, default=64 if gpu else 16)
    ap.add_argument("--input-len", type=int, default=128 if gpu else 32)
    ap.add_argument("--output-len", type=int, default=256 if gpu else 32)
    ap.add_argument("--repeats", type=int, default=3 if gpu else 1)
    ap.add_argument("--enforce-eager", action="store_true", help="no compile, no CUDA graphs")
    ap.add_argument("--streams", type=int, default=8 if gpu else 4)
    ap.add_argument("--stream-len", type=int, default=512 if gpu else 64)
    ap.add_argument("--arrive-after", type=int, default=64 if gpu else 16, help="tokens each stream has first")
    ap.add_argument("--schema-fields", type=int, default=300)
    ap.add_argument("--server-args", default=None, help="flags of the launched `compilelm serve` (default: the "
                    "default model, --max-model-len 2048, --enforce-eager with --enforce-eager)")
    ap.add_argument("--host-profile", type=int, default=0, metavar="N",
                    help="also run each throughput mode once under cProfile; its N top functions go in the JSON")
    ap.add_argument("--mask-fill", default="thread", help="where constrained batches fill their masks, comma "
                    "separated for one constrained batch each: thread (the engine's), inline (the engine thread); "
                    "either with :N for N mask-executor threads (default llguidance's)")
    ap.add_argument("--torch-threads", default=None, metavar="T[,T...]",
                    help="torch's intra-op threads in the engine's process, comma separated for one set of "
                         "batches each (default: torch's own)")
    ap.add_argument("--torch-profile", type=int, default=0, metavar="N",
                    help="also run each batch once under torch.profiler; its N top ops by self CPU time in the JSON")
    ap.add_argument("--phases", action="store_true", help="time the engine's step phases in each batch's last run")
    ap.add_argument("--skip-throughput", action="store_true")
    ap.add_argument("--skip-new-schema", action="store_true")
    ap.add_argument("--out", default=None, help="JSON path (default benchmarks/results/bench_structured[_gpu].json)")
    args = ap.parse_args(argv)
    resolve_model_and_tokenizer(args)
    payload: dict = {"args": vars(args)}
    out = args.out or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                   f"bench_structured{'_gpu' if gpu else ''}.json")
    if not args.skip_throughput:
        rows = payload["throughput"] = bench_throughput(args)
        print_table(rows, ["batch", "requests", "constrained", "output_tok_s", "wall_s", "ratio"])
        if args.phases:
            print_table([{"phase": k, **{r["batch"]: r["phases_us_per_step"].get(k, 0) for r in rows}}
                         for k in dict.fromkeys(k for r in rows for k in r["phases_us_per_step"])],
                        ["phase"] + [r["batch"] for r in rows])
        write_result("bench_structured", payload, out)
    if not args.skip_new_schema:
        server_args = args.server_args or " ".join(
            [args.model or "", f"--tokenizer {args.tokenizer}" if args.tokenizer else "", "--max-model-len 2048",
             "--enforce-eager" if args.enforce_eager else ""])
        proc, url = launch(server_args)
        try:
            row = payload["new_schema"] = asyncio.run(bench_new_schema(url, args))
        finally:
            proc.terminate()
            proc.wait(60)
        print_table([row], list(row))
        write_result("bench_structured", payload, out)
    print(f"wrote {out}")
    return payload


if __name__ == "__main__":
    main()
