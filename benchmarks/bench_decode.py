"""Decode step time on one GPU: compilelm vs the memory roofline vs Hugging Face static cache.

A decode step must read every weight once (the embedding table only for the rows it uses) and
each sequence's KV cache once, so bytes / bandwidth is its floor; we give it over the H100's
3.35 TB/s and over the copy bandwidth measured here (a device-to-device copy, read + write).

"Context" is the number of keys a decode step attends per sequence, averaged over the timed
steps (the roofline counts the KV bytes of exactly that many). compilelm: `batch` requests with
random prompts a little shorter than `context` are prefilled and decode untimed until the timed
window will be centred on `context`; then single `engine.step()` calls are timed while every
request decodes (median; each step ends with the sampled ids on the host, so a step's time is
wall time). The rows give the mean context measured from the engine (`step_context`), and the
context of the graph replayed alone after the window (`graph_context`, half a window more).
Hugging Face: the same preset built with random weights, `generate` with a static cache
(auto-compiled with torch.compile where `--hf-compile-batches` says, else `disable_compile`),
timed as t(N_long) - t(N_short) per token so prefill cancels out, from prompts of `context`
minus the mean of N_short and N_long.

    python benchmarks/bench_decode.py [--models ...] [--batches 1 64] [--context 1024]

`--pdl both` / `--hopper-gemm both` add A/B rows (one engine each): compilelm's kernels launched
without programmatic dependent launch; linear layers at 3-64 rows on cuBLAS instead of the Triton
GEMM (compilelm/ops/hopper_gemm.py). `--quantization none fp8` adds rows of the model with FP8 W8A8
linears (`quantization="fp8"`); `--fp8-gemm both` adds FP8 rows with every FP8 linear on
torch._scaled_mm instead of compilelm's FP8 kernels (compilelm/ops/fp8_gemm.py: set_fp8_routes).
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.common import print_table, write_result  # noqa: E402

H100_BANDWIDTH = 3.35e12
TARGETS_MS = {("dummy:llama-3.1-8b", 1): 6.0, ("dummy:llama-3.1-8b", 64): 8.8, ("dummy:smollm2-135m", 1): 0.6}
# issue 36, H100, ctx 1000: 1.2x / 1.1x vLLM 0.26's FP8 (4.29 / 7.76 ms/step)
TARGETS_MS_FP8 = {("dummy:llama-3.1-8b", 1): 3.6, ("dummy:llama-3.1-8b", 64): 7.05}


def copy_bandwidth() -> float:
    """Bytes/s of a 1 GiB device-to-device copy, counting bytes read plus bytes written."""
    src = torch.empty(2**29, dtype=torch.int16, device="cuda").random_()
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(20):
        dst.copy_(src)
    end.record()
    torch.cuda.synchronize()
    return 2 * src.numel() * 2 * 20 / (start.elapsed_time(end) / 1e3)


def step_bytes(model_config, model, batch: int, context: int) -> int:
    """Weights read by one decode step (no embedding table unless it is also the LM head) + KV."""
    weights = sum(p.numel() * p.element_size() for n, p in model.named_parameters()
                  if "embed_tokens" not in n or model_config.tie_word_embeddings)
    mc = model_config
    kv_per_token = 2 * mc.num_hidden_layers * mc.num_key_value_heads * mc.head_dim * 2  # bf16
    return weights + batch * context * kv_per_token


def prompts(batch: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (batch, length), generator=g).tolist()


def prefill_steps(batch: int, context: int, step_tokens: int) -> int:
    """Steps that prefill `batch` prompts of up to `context` tokens, in chunks of what a step's
    `step_tokens` leaves after the (at most `batch`) decode rows: the first request decodes in each
    of them after its own prompt, so it runs ahead of the last by up to this many tokens."""
    return -(-batch * context // max(step_tokens - batch, 1))


def prompt_len(batch: int, context: int, steps: int, step_tokens: int) -> int:
    """Prompt length of the timed requests: short enough that the untimed decode before the window
    (at least 3 steps, and the prefill's spread) still ends below the window's first context."""
    return max(1, context - steps // 2 - prefill_steps(batch, context, step_tokens) - 8)


def decode_tokens(batch: int, context: int, steps: int, step_tokens: int) -> int:
    """max_tokens of the timed requests: enough that none finishes before the measurement ends --
    the decode up to the window, the window, and the first requests' lead over the last."""
    return context - prompt_len(batch, context, steps, step_tokens) + steps + prefill_steps(batch, context,
                                                                                            step_tokens) + 8


def step_context(engine) -> float:
    """Keys per sequence that the next decode step attends, averaged over the running requests:
    each one's tokens, including the sampled ones still on the device (the newest is the one that
    step decodes and writes to the cache)."""
    running = engine.scheduler.running
    return sum(r.num_tokens + r.num_output_placeholders for r in running) / max(len(running), 1)


def time_ours(engine, batch: int, context: int, steps: int) -> dict:
    """Median ms of one engine step while `batch` requests decode at a mean `context` keys
    (`ours_ms`; `step_context`: the mean measured), and the mean GPU ms of the decode CUDA graph
    (forward + LM head) replayed alone after the window (`graph_replay_ms` at `graph_context`; the
    rest of a step is host work, the input copies and sampling). Every timed step decodes all
    `batch` requests (checked): the graph replayed alone then reads the inputs of a step of its
    own size."""
    from compilelm import SamplingParams

    step_tokens = engine.scheduler.config.max_num_batched_tokens
    params = SamplingParams(temperature=0.0, max_tokens=decode_tokens(batch, context, steps, step_tokens),
                            ignore_eos=True)
    length = prompt_len(batch, context, steps, step_tokens)
    ids = [engine.add_request(None, p, params) for p in prompts(batch, length, engine.model_config.vocab_size, batch)]
    first = context - (steps - 1) / 2  # the window's first context: its mean is then `context`
    produced = {}
    while len(produced) < batch or min(produced.values()) < 3 or step_context(engine) < first:
        for out in engine.step():  # prefill, then decode (warmed up) up to the window
            produced[out.request_id] = len(out.outputs[0].token_ids)
    times, contexts = [], []
    for _ in range(steps):
        contexts.append(step_context(engine))
        t0 = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t0)
    if engine.scheduler.num_running != batch:
        raise RuntimeError(f"{batch - engine.scheduler.num_running} of {batch} requests stopped decoding "
                           "during the measurement")
    result = dict(ours_ms=statistics.median(times) * 1e3, step_context=statistics.fmean(contexts),
                  graph_replay_ms=None, graph_context=None)
    graphs = engine.model_runner.cuda_graphs
    size = graphs.padded_size(batch) if graphs else None
    if size is not None:  # GPU time of the decode graph alone, on the last step's inputs
        result["graph_context"] = contexts[-1]  # (the last timed step's)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(steps):
            graphs.replay(size)
        end.record()
        torch.cuda.synchronize()
        result["graph_replay_ms"] = start.elapsed_time(end) / steps
    engine.abort_request(ids)
    while engine.has_unfinished_requests():
        engine.step()
    return result


def hf_model(preset: str):
    import transformers

    from compilelm.models.config import DUMMY_PRESETS

    cfg = dict(DUMMY_PRESETS[preset.split(":", 1)[1]])
    arch = cfg.pop("architectures")[0]
    config = getattr(transformers, arch.replace("ForCausalLM", "Config"))(**cfg)
    with torch.device("cuda"):
        model = getattr(transformers, arch)._from_config(config, dtype=torch.bfloat16)
    return model.eval()


def time_hf(model, batch: int, context: int, compile_: bool, n_short: int = 8, n_long: int = 40) -> float:
    """ms per decode token of `generate` with a static cache (same cache length for every call,
    so a compiled forward is reused)."""
    from transformers import StaticCache

    length = context - (n_short + n_long) // 2  # the timed tokens' mean context is `context`
    ids = torch.tensor(prompts(batch, length, model.config.vocab_size, batch), device="cuda")

    def run(n: int) -> float:
        cache = StaticCache(config=model.config, max_cache_len=length + n_long)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), past_key_values=cache,
                                 max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0,
                                 disable_compile=not compile_)
        torch.cuda.synchronize()
        assert out.shape[1] == length + n
        return time.perf_counter() - t0

    run(n_short)  # warm-up (compiles)
    run(n_short)
    return (run(n_long) - run(n_short)) / (n_long - n_short) * 1e3


def bench_model(name: str, args, bandwidth: float, rows: list, save) -> None:
    import compilelm.ops  # noqa: F401  (loads the kernels: set_programmatic_launch)
    from compilelm import LLM
    from compilelm.ops.fp8_gemm import set_fp8_routes

    max_batch, step_tokens = max(args.batches), 8192
    base = []
    switch = {"on": [True], "off": [False], "both": [False, True]}
    quants = [None if q == "none" else q for q in args.quantization]
    fp8_routes = set_fp8_routes()
    combos = [(q, p, h, f) for q in quants for p in switch[args.pdl] for h in switch[args.hopper_gemm]
              for f in (switch[args.fp8_gemm] if q == "fp8" else [None])]
    for quant, pdl, hopper_gemm, fp8_gemm in combos:
        # kernels launch (and graphs capture) with programmatic dependent launch or without; linear
        # layers at 3-64 rows on the Triton GEMM (sm_90) or on cuBLAS; FP8 linears on compilelm's
        # FP8 kernels or all on torch._scaled_mm
        torch.ops.compilelm.set_programmatic_launch(pdl)
        torch.ops.compilelm.set_hopper_gemm(hopper_gemm)
        set_fp8_routes(*(fp8_routes if fp8_gemm is not False else (0, 0)))
        t0 = time.perf_counter()
        llm = LLM(model=name, dtype="bfloat16", quantization=quant,
                  max_model_len=args.context + decode_tokens(max_batch, args.context, args.steps, step_tokens),
                  max_num_seqs=max_batch, max_num_batched_tokens=step_tokens,
                  compilation_config={"cache_dir": args.cache_dir} if args.cache_dir else None)
        startup = time.perf_counter() - t0
        engine = llm.engine
        graphs = engine.model_runner.cuda_graphs
        graph_mib = graphs.memory_bytes / 2**20 if graphs else None
        for batch in args.batches:
            timing = time_ours(engine, batch, args.context, args.steps)
            ms, graph_ms = timing["ours_ms"], timing["graph_replay_ms"]
            nbytes = step_bytes(engine.model_config, engine.model_runner.model, batch, args.context)
            row = dict(model=name, quantization=quant or "none", fp8_gemm=fp8_gemm, batch=batch,
                       context=args.context, pdl=pdl, hopper_gemm=hopper_gemm, **timing,
                       roofline_ms=nbytes / H100_BANDWIDTH * 1e3, roofline_measured_ms=nbytes / bandwidth * 1e3,
                       target_ms=(TARGETS_MS_FP8 if quant else TARGETS_MS).get((name, batch)), startup_s=startup,
                       graph_mib=graph_mib)
            row["pct_of_measured_roofline"] = 100 * row["roofline_measured_ms"] / ms
            # HF is compared with the default (bf16) rows
            (base if pdl and hopper_gemm and quant is None else rows).append(row)
            print(f"{name} {quant or 'bf16'} batch {batch} pdl {pdl} hopper_gemm {hopper_gemm} fp8_gemm {fp8_gemm}: "
                  f"{ms:.3f} ms/step (graph replay {graph_ms} ms)", flush=True)
        save()
        del llm, engine, graphs
        gc.collect()
        torch.cuda.empty_cache()
    torch.ops.compilelm.set_programmatic_launch(True)
    torch.ops.compilelm.set_hopper_gemm(True)
    set_fp8_routes(*fp8_routes)
    rows.extend(base)
    save()
    if not args.no_hf:
        model = hf_model(name)
        for row in base:
            compile_ = row["batch"] in args.hf_compile_batches
            key = "hf_static_compile_ms" if compile_ else "hf_static_eager_ms"
            try:
                row[key] = time_hf(model, row["batch"], args.context, compile_)
                row["speedup_vs_hf"] = row[key] / row["ours_ms"]
                row["hf_mode"] = "static+compile" if compile_ else "static eager"
            except Exception as e:  # report, keep our numbers
                row["hf_error"] = f"{type(e).__name__}: {e}"[:300]
            print(f"HF {name} batch {row['batch']}: {row.get(key)} ms/token", flush=True)
            save()
        del model
        gc.collect()
        torch.cuda.empty_cache()


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["dummy:smollm2-135m", "dummy:llama-3.1-8b"])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 64])
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--hf-compile-batches", type=int, nargs="*", default=[1, 64])
    ap.add_argument("--no-hf", action="store_true")
    ap.add_argument("--cache-dir", default=None, help="compile cache (default: compilelm's)")
    ap.add_argument("--pdl", choices=["on", "off", "both"], default="on",
                    help="programmatic dependent launch of compilelm's kernels (both: an A/B, one engine each)")
    ap.add_argument("--hopper-gemm", choices=["on", "off", "both"], default="on",
                    help="linear layers at 3-64 rows on compilelm's Triton GEMM (sm_90) or on cuBLAS (both: an A/B)")
    ap.add_argument("--quantization", nargs="+", choices=["none", "fp8"], default=["none"],
                    help="one engine per value: the bf16 model and / or its FP8 W8A8 linears")
    ap.add_argument("--fp8-gemm", choices=["on", "off", "both"], default="on",
                    help="FP8 rows: FP8 linears on compilelm's FP8 kernels (on) or all on torch._scaled_mm (off)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench_decode needs a CUDA GPU")
    bandwidth = copy_bandwidth()
    rows: list[dict] = []
    payload = dict(copy_bandwidth_tb_s=bandwidth / 1e12, h100_bandwidth_tb_s=H100_BANDWIDTH / 1e12,
                   args=vars(args), rows=rows)
    save = lambda: write_result("bench_decode", payload, args.out)  # noqa: E731 (partial results survive)
    for name in args.models:
        try:
            bench_model(name, args, bandwidth, rows, save)
        except Exception as e:
            rows.append(dict(model=name, error=f"{type(e).__name__}: {e}"[:500]))
            print(f"{name}: FAILED {rows[-1]['error']}", flush=True)
    path = save()
    print(f"copy bandwidth {bandwidth / 1e12:.2f} TB/s (read + write)")
    print_table(rows, ["model", "quantization", "fp8_gemm", "batch", "pdl", "hopper_gemm", "ours_ms",
                       "graph_replay_ms", "roofline_ms", "roofline_measured_ms", "pct_of_measured_roofline",
                       "target_ms", "hf_mode", "hf_static_compile_ms", "hf_static_eager_ms", "speedup_vs_hf"])
    print(f"wrote {path}")
    return payload


if __name__ == "__main__":
    main()
