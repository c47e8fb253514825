"""Fusion passes on vs off: (a) per piece, (b) end to end in the engine (GPU).

(a) Per piece. The norm/activation + FP8-quant fusions: the part of a decoder layer the fusion
rewrites (hidden 576 / intermediate 1536, SmolLM2-135M's sizes) compiled by Inductor with
compilelm's PassManager as the post-grad pass, once with only that fusion on and once with it
off. The RoPE (+ QK-norm) + attention fusions span the piecewise split, so their piece is a whole
compiled forward of a `--piece-layers`-layer model (SmolLM2-135M shapes for RoPE, Qwen3-0.6B's for
QK-norm + RoPE), one prefill sequence of `tokens` tokens. CUDA: median of CUDA-event timings;
CPU: best of 5 wall-clock runs (robust to other jobs on a shared CPU; the fused ops are torch
compositions there, so CPU numbers measure the rewrite, not a kernel).

(b) End to end (default on CUDA): an engine per setting, default -O2 (every pass on) vs the same
with one fusion switched off, each built and measured in a process of its own (`--rounds`
measurements, medians; see run_isolated): decode step time (median `engine.step()`, and the decode
CUDA graph's GPU time alone) at batch 1 and 64 with `--context` tokens of context, and one
`--prefill`-token prompt from add_request to its token on the host (median of 3; that is the
prefill step's GPU time plus one step's host work, since with async scheduling step() returns
before the GPU is done). With few layers (scripts/gpu_bench.sh runs 4) a decode step, and a small
model's prefill, is host-bound and its time moves with the process (+-30-50% between engines of one
run): read the graph columns there. RMSNorm+quant, SiLU+quant and quant+fp8_linear run the model in FP8
mode (`quantization="fp8"`); QK-norm+RoPE
runs Qwen3-0.6B.

    python benchmarks/bench_passes.py                       # CUDA if available: (a) + (b)
    python benchmarks/bench_passes.py --device cpu          # CPU: (a) only, 1 thread
    python benchmarks/bench_passes.py --no-pieces --custom-pass examples.my_fusion_pass:MeanSquareFusionPass
                                                            # (b) for a pass of your own, with vs without it
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import os
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.common import print_table, watch_compiles, write_result  # noqa: E402
from compilelm.layers.activation import SiluAndMul  # noqa: E402
from compilelm.layers.layernorm import rms_norm  # noqa: E402
from compilelm.ops import quant as _quant_ops  # noqa: F401
from compilelm.passes import PassConfig, PassManager  # noqa: E402
from compilelm.passes.config import builtin_passes, parse_pass_spec  # noqa: E402

HIDDEN, INTER, EPS = 576, 1536, 1e-5
ops = torch.ops.compilelm
_act = SiluAndMul()


def rms_quant(x, residual, w):
    return ops.quant_fp8_per_token(rms_norm(x, w, EPS))


def add_rms_quant(x, residual, w):
    residual = x + residual
    q, s = ops.quant_fp8_per_token(rms_norm(residual, w, EPS))
    return q, s, residual


def silu_mul_quant(x, residual, w):
    return ops.quant_fp8_per_token(_act(x))


O_PROJ: dict[str, torch.Tensor] = {}  # the FP8 o_proj of quant_linear's piece, set per device (quant_piece_rows)


def quant_linear(x, residual, w):  # o_proj: its input's quant has no producer to fuse into
    q, s = ops.quant_fp8_per_token(x)
    return ops.fp8_linear(q, s, O_PROJ["weight"], O_PROJ["scale"], None, x.dtype)


FUSIONS = {  # name -> (piece, PassConfig switch, width of x)
    "rms_norm+quant": (rms_quant, "fuse_norm_quant", HIDDEN),
    "add+rms_norm+quant": (add_rms_quant, "fuse_norm_quant", HIDDEN),
    "silu_mul+quant": (silu_mul_quant, "fuse_act_quant", 2 * INTER),
    "quant+fp8_linear (o_proj)": (quant_linear, "fuse_quant_linear", HIDDEN),
}
ATTENTION_FUSIONS = {  # name -> model whose shapes the whole-forward piece has
    "rope+attention": "dummy:smollm2-135m",
    "qk_norm+rope+attention": "dummy:qwen3-0.6b",
}
E2E_CASES = [  # (fusion, model, quantization, switch turned off)
    ("rope+attention", "dummy:smollm2-135m", None, "fuse_rope_attention"),
    ("qk_norm+rope+attention", "dummy:qwen3-0.6b", None, "fuse_rope_attention"),
    ("rms_norm+quant", "dummy:smollm2-135m", "fp8", "fuse_norm_quant"),
    ("silu_mul+quant", "dummy:smollm2-135m", "fp8", "fuse_act_quant"),
    ("quant+fp8_linear (o_proj prologue)", "dummy:smollm2-135m", "fp8", "fuse_quant_linear"),
    ("rms_norm+quant, 8B", "dummy:llama-3.1-8b", "fp8", "fuse_norm_quant"),  # (issue 36's shape)
    ("silu_mul+quant, 8B", "dummy:llama-3.1-8b", "fp8", "fuse_act_quant"),
    ("quant+fp8_linear (o_proj prologue), 8B", "dummy:llama-3.1-8b", "fp8", "fuse_quant_linear"),
    ("residual add out of addmm", "dummy:smollm2-135m", None, "unfuse_residual_addmm"),
    ("route_linear", "dummy:smollm2-135m", None, "route_linear"),  # (switches the linear fusions off with it)
    ("(add+) rms_norm+linear", "dummy:smollm2-135m", None, "fuse_norm_linear"),
    ("silu_mul+linear", "dummy:smollm2-135m", None, "fuse_act_linear"),
    ("gate_up linear+silu_mul, 8B", "dummy:llama-3.1-8b", None, "fuse_act_linear"),  # (the 3-64-row epilogue)
    ("qkv projection+rope+cache write", "dummy:smollm2-135m", None, "fuse_qkv_rope"),
    ("o/down+add+rms_norm+gate_up/qkv, 8B", "dummy:llama-3.1-8b", None, "fuse_norm_gemm"),  # (folds the norms: sm_90)
]


SWITCH_PASS = {switch: path.rpartition(":")[2] for switch, path, _ in builtin_passes()}  # switch -> pass name


def bench(fn, args, iters: int, device: torch.device, repeats: int = 5) -> float:
    """us per call: CUDA, the median of `repeats` CUDA-event timings; CPU, the best wall time."""
    for _ in range(10):
        fn(*args)
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(iters):
                fn(*args)
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) * 1e3 / iters)
        else:
            t0 = time.perf_counter()
            for _ in range(iters):
                fn(*args)
            times.append((time.perf_counter() - t0) / iters * 1e6)
    return statistics.median(times) if device.type == "cuda" else min(times)


def compile_piece(fn, switch: str | None):
    off = {"fuse_norm_quant": False, "fuse_act_quant": False, "fuse_quant_linear": False}
    manager = PassManager(PassConfig(**{**off, **({switch: True} if switch else {})}))
    torch._dynamo.reset()
    compiled = torch.compile(fn, dynamic=False, options={"post_grad_custom_post_pass": manager})
    return compiled, manager


def quant_piece_rows(args, device, dtype) -> list[dict]:
    from compilelm.layers.quantization import quantize_weight_per_channel

    O_PROJ["weight"], O_PROJ["scale"] = quantize_weight_per_channel(torch.randn(HIDDEN, HIDDEN, device=device) * 0.05)
    rows = []
    for name, (fn, switch, width) in FUSIONS.items():
        for n in args.tokens:
            try:
                x, res = (torch.randn(n, width, device=device, dtype=dtype),
                          torch.randn(n, HIDDEN, device=device, dtype=dtype))
                w = torch.rand(HIDDEN, device=device, dtype=dtype) + 0.5
                unfused, _ = compile_piece(fn, None)
                t_unfused = bench(unfused, (x, res, w), args.iters, device)
                fused, manager = compile_piece(fn, switch)
                t_fused = bench(fused, (x, res, w), args.iters, device)
                matches = sum(p.matches for p in manager.post_grad if "Quant" in p.name)
                rows.append({"fusion": name, "tokens": n, "matches": matches,
                             "eager_us": bench(fn, (x, res, w), args.iters, device),
                             "unfused_us": t_unfused, "fused_us": t_fused, "speedup": t_unfused / t_fused})
            except Exception as e:  # e.g. no kernel for this device yet: report, go on
                rows.append({"fusion": name, "tokens": n, "error": f"{type(e).__name__}: {e}"[:300]})
    return rows


def forward_context(model, n: int, device, block: int = 16):
    """One prefill sequence of n tokens over fresh KV pages (block 0 is the null block)."""
    from compilelm.forward_context import AttentionMetadata, ForwardContext

    attn = [m for m in model.modules() if type(m).__name__ == "Attention"]
    blocks = list(range(1, -(-n // block) + 1))
    shape = (len(blocks) + 1, block, attn[0].num_kv_heads, attn[0].head_dim)
    dtype = next(model.parameters()).dtype
    caches = {a.layer_name: (torch.zeros(shape, dtype=dtype, device=device),
                             torch.zeros(shape, dtype=dtype, device=device))
              for a in attn}
    i32 = dict(dtype=torch.int32, device=device)
    meta = AttentionMetadata(torch.arange(block, block + n, device=device), torch.tensor([0, n], **i32),
                             torch.tensor([n], **i32), torch.tensor([blocks], **i32), n, n)
    return ForwardContext(meta, caches)


def attention_piece_rows(args, device) -> list[dict]:
    from compilelm.entrypoints.cli_compile import load_model
    from compilelm.forward_context import set_forward_context
    from compilelm.graphs import CompiledModel
    from compilelm.llm import make_engine_config

    rows = []
    for name, model_name in ATTENTION_FUSIONS.items():
        try:
            config = make_engine_config(model_name, device=device.type,
                                        model_overrides={"num_hidden_layers": args.piece_layers})
            model, factors = load_model(config)
            fns = {}
            with tempfile.TemporaryDirectory() as tmp:
                for fused in (False, True):
                    passes = dataclasses.replace(config.compilation.passes, fuse_rope_attention=fused)
                    cm = CompiledModel(model, dataclasses.replace(config.compilation, passes=passes, cache_dir=tmp,
                                                                  use_cache=False), factors)
                    fns[fused] = (cm.compile(), sum(p.matches for p in cm.manager.whole_graph
                                                    if p.name == "RopeAttentionFusionPass"))
            for n in args.tokens:
                ids, pos = torch.randint(0, 1000, (n,), device=device), torch.arange(n, device=device)
                t = {}
                with torch.no_grad(), set_forward_context(forward_context(model, n, device)):
                    for fused, (fn, _) in fns.items():
                        t[fused] = bench(fn, (ids, pos), args.iters, device)
                rows.append({"fusion": name, "tokens": n, "matches": fns[True][1], "unfused_us": t[False],
                             "fused_us": t[True], "speedup": t[False] / t[True], "layers": args.piece_layers})
            del model, fns
        except Exception as e:
            rows.append({"fusion": name, "error": f"{type(e).__name__}: {e}"[:300]})
    return rows


def build_engine(model: str, quantization: str | None, off: str | None, args, custom: str | None = None):
    """An engine at -O2 with the switch `off` turned off (None: every pass on) and the pass `custom`
    ("package.module:Class") added, and what its start found: seconds and the passes' matches (None
    when a cached compile ran no pass)."""
    from benchmarks.bench_decode import decode_tokens
    from compilelm import LLM

    step_tokens = max(args.prefill, 256)
    decoded = decode_tokens(max(args.batches), args.context, args.steps, step_tokens)  # time_ours's max_tokens
    max_len = max(args.prefill, args.context + decoded) + 16
    blocks = max(args.batches) * -(-(args.context + decoded) // 16) + -(-max_len // 16) + 16
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="compilelm-passes-") as tmp, watch_compiles() as compiled:
        compilation = {"cudagraph_capture_sizes": args.batches, "passes": {off: False} if off else {},
                       "cache_dir": args.cache_dir or tmp,  # a fresh cache: the passes run and count matches
                       "custom_passes": (custom,) if custom else ()}
        llm = LLM(model, dtype="bfloat16" if torch.cuda.is_available() else "auto", quantization=quantization,
                  max_model_len=max_len, max_num_seqs=max(args.batches), max_num_batched_tokens=step_tokens,
                  num_kv_blocks=blocks, enable_prefix_caching=False, compilation_config=compilation,
                  model_overrides={"num_hidden_layers": args.layers} if args.layers else {})
    cold = [cm for cm in compiled if cm.mode != "warm"]  # a warm start loads pieces: no pass runs, no matches
    found: dict[str, int] = {}
    for p in (p for cm in cold for p in cm.manager.passes):  # (a pass may sit in both stages: summed)
        found[p.name] = found.get(p.name, 0) + p.matches
    return llm, {"startup_s": time.perf_counter() - t0, "matches": None if compiled and not cold else found}


def measure(engine, args) -> dict:
    """Decode step ms at each batch (and its graph's GPU ms), and the step that prefills one prompt."""
    from benchmarks.bench_decode import prompts, time_ours
    from compilelm import SamplingParams

    out = {}
    for b in args.batches:
        timing = time_ours(engine, b, args.context, args.steps)
        out[f"decode_b{b}_ms"], out[f"graph_b{b}_ms"] = timing["ours_ms"], timing["graph_replay_ms"]
    params = SamplingParams(max_tokens=1, ignore_eos=True)
    times = []
    for i in range(4):  # the first warms up
        engine.add_request(None, prompts(1, args.prefill, engine.model_config.vocab_size, 1000 + i)[0], params)
        t0 = time.perf_counter()
        while engine.has_unfinished_requests():  # (async scheduling: the first step() only launches the prefill)
            engine.step()
        times.append((time.perf_counter() - t0) * 1e3)  # the prompt's step, to its token on the host
    out[f"prefill_{args.prefill}_ms"] = statistics.median(times[1:])
    return out


def medians(samples: list[dict]) -> dict:
    return {k: (statistics.median(v for s in samples if (v := s[k]) is not None)
                if any(s[k] is not None for s in samples) else None) for k in samples[0]}


def free(llm) -> None:
    llm.engine.shutdown()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def matches(info: dict, pass_name: str) -> int | str:
    return "cached" if info["matches"] is None else info["matches"].get(pass_name, 0)


def measure_engine(model: str, quantization: str | None, off: str | None, args,
                   custom: str | None = None) -> tuple[list[dict], dict]:
    """Build one engine, `--rounds` rounds of measure(), free it: (the rounds, build_engine's info)."""
    llm, info = build_engine(model, quantization, off, args, custom)
    try:
        return [measure(llm.engine, args) for _ in range(args.rounds)], info
    finally:
        free(llm)


def _child(queue, fn, fn_args) -> None:
    try:
        queue.put(("ok", fn(*fn_args)))
    except BaseException as e:  # noqa: BLE001 - reported to the parent, which raises it
        queue.put(("error", f"{type(e).__name__}: {e}"))


def run_isolated(fn, *fn_args):
    """fn(*fn_args) in a fresh (spawned) process; its result, or its exception as a RuntimeError.

    Each engine is measured in a process of its own: on an H100, an all-on engine's decode graph ran
    ~11% slower once two engines had been built in its process, whichever came first, and stayed so
    after the other was freed (SmolLM2-135M, batch 64, context 512: 1.27 -> 1.40 ms, about its
    speed with PDL off; a graph replayed once on another stream does the same; cause not found;
    benchmarks/results/decode_session22_gpu.log). An all-on engine built first and measured beside
    each switched-off one made the passes look like losses there."""
    import multiprocessing
    import queue as queue_mod

    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    proc = ctx.Process(target=_child, args=(results, fn, fn_args))
    proc.start()
    try:
        while True:
            try:
                status, value = results.get(timeout=5)
                break
            except queue_mod.Empty:
                if not proc.is_alive():
                    raise RuntimeError(f"the measuring process exited with code {proc.exitcode}") from None
    finally:
        proc.join()
    if status == "error":
        raise RuntimeError(value)
    return value


def e2e_cases(args) -> list[tuple]:
    """(fusion, model, quantization, pass name, on setting, off setting); a setting is (the switch
    turned off, the custom pass added). Built-in fusions: every pass on vs the case's switch off.
    `--custom-pass`: every built-in pass on, with vs without the custom one."""
    cases = [(fusion, model, quant, SWITCH_PASS[switch], (None, None), (switch, None))
             for fusion, model, quant, switch in E2E_CASES if fusion in args.cases]
    for spec in args.custom_pass:
        name = parse_pass_spec(spec)[0].rpartition(":")[2]  # "pkg.mod:Class[,stage=...]" -> Class
        cases.append((name, args.custom_model, None, name, (None, spec), (None, None)))
    return cases


def e2e_rows(args, rows: list[dict], save=lambda: None) -> list[dict]:
    """Each case: the engines of its two settings, each in a process of its own (run_isolated),
    `--rounds` measurements each (medians); an engine shared by cases (the all-on one of a model
    and quantization) is measured once. Appends to `rows` and calls `save` after each case (a run
    cut short by a timeout keeps the cases it finished)."""
    engines = {}  # (model, quantization, setting) -> (rounds, build_engine's info)

    def engine(model, quant, setting):
        if (model, quant, setting) not in engines:
            off, custom = setting
            engines[model, quant, setting] = run_isolated(measure_engine, model, quant, off, args, custom)
        return engines[model, quant, setting]

    for fusion, model, quant, pass_name, on_setting, off_setting in e2e_cases(args):
        try:
            on_samples, on_info = engine(model, quant, on_setting)
            off_samples, off_info = engine(model, quant, off_setting)
        except Exception as e:
            rows.append({"fusion": fusion, "model": model, "error": f"{type(e).__name__}: {e}"[:300]})
            print(f"{fusion}: FAILED {rows[-1]['error']}", flush=True)
            continue
        on, off = medians(on_samples), medians(off_samples)
        print(f"{fusion} ({model}, quantization={quant}): on {on} | off {off}", flush=True)
        for key in on:
            if on[key] is None and off[key] is None:
                continue
            row = {"fusion": fusion, "model": model.split(":")[-1] + (" fp8" if quant else ""), "measure": key,
                   "on_ms": on[key], "off_ms": off[key], "matches_on": matches(on_info, pass_name),
                   "matches_off": matches(off_info, pass_name), "rounds": args.rounds}
            if on[key] and off[key]:
                row["speedup"] = off[key] / on[key]
            rows.append(row)
        save()
    return rows


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    ap.add_argument("--tokens", type=int, nargs="+", default=None, help="per piece (CPU 1 16 256; CUDA 1 64 2048)")
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--threads", type=int, default=1, help="torch threads on CPU (1: stable on a shared CPU)")
    ap.add_argument("--piece-layers", type=int, default=2, help="layers of the attention-fusion pieces")
    ap.add_argument("--no-pieces", action="store_true")
    ap.add_argument("--e2e", action=argparse.BooleanOptionalAction, default=None, help="default: on for CUDA")
    ap.add_argument("--cases", nargs="*", choices=[c[0] for c in E2E_CASES], default=None,
                    help="end to end: the fusions to switch off one at a time "
                         "(default: all, or none with --custom-pass)")
    ap.add_argument("--custom-pass", action="append", default=[], metavar="PKG.MODULE:CLASS",
                    help="end to end: a pass of your own (as compilation_config's custom_passes), with vs without "
                         "it on top of the built-in ones; repeatable")
    ap.add_argument("--custom-model", default="dummy:smollm2-135m", help="end to end: the model --custom-pass runs")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 64], help="end to end: decode batch sizes")
    ap.add_argument("--context", type=int, default=512, help="end to end: decode context")
    ap.add_argument("--steps", type=int, default=32, help="end to end: timed decode steps")
    ap.add_argument("--prefill", type=int, default=2048, help="end to end: prompt tokens of the prefill step")
    ap.add_argument("--layers", type=int, default=None, help="end to end: override num_hidden_layers (smoke tests)")
    ap.add_argument("--rounds", type=int, default=3, help="end to end: measurements of each engine (medians)")
    ap.add_argument("--cache-dir", default=None, help="end to end: compile cache (default: a fresh one per engine)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if args.cases is None:
        args.cases = [] if args.custom_pass else [c[0] for c in E2E_CASES]
    device = torch.device("cuda" if args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
                          else "cpu")
    if device.type == "cpu":
        torch.set_num_threads(args.threads)
    args.tokens = args.tokens or ([1, 64, 2048] if device.type == "cuda" else [1, 16, 256])
    e2e = device.type == "cuda" if args.e2e is None else args.e2e
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    pieces, end_to_end = [], []
    payload = {"device": device.type, "threads": torch.get_num_threads(), "args": vars(args),
               "rows": pieces, "e2e_rows": end_to_end}
    name = "bench_passes_gpu" if device.type == "cuda" else "bench_passes"
    if not args.no_pieces:
        with torch.no_grad():
            pieces += quant_piece_rows(args, device, dtype)
        pieces += attention_piece_rows(args, device)
        write_result(name, payload, args.out)
    if e2e:
        e2e_rows(args, end_to_end, lambda: write_result(name, payload, args.out))
    path = write_result(name, payload, args.out)
    if pieces:
        print(f"\nper piece ({device.type}, us per call)")
        print_table(pieces, ["fusion", "tokens", "matches", "eager_us", "unfused_us", "fused_us", "speedup"]
                    + (["error"] if any("error" in r for r in pieces) else []))
    if end_to_end:
        print(f"\nend to end ({device.type}): -O2 with the fusion on vs off, ms (speedup = off / on)")
        print_table(end_to_end, ["fusion", "model", "measure", "on_ms", "off_ms", "speedup", "matches_on",
                                 "matches_off"]
                    + (["error"] if any("error" in r for r in end_to_end) else []))
    print("wrote", path)
    return payload


if __name__ == "__main__":
    main()
