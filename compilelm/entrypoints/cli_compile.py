"""`compilelm compile [MODEL] [--dump DIR] [--verify]`: compile a model without serving it.

The model is loaded exactly as the engine loads it, so the compile-cache key is the one `serve`
and `LLM(...)` will compute: running this pre-warms the cache. `--dump DIR` writes what the
compiler did (graphs before/after every pass, the split, Inductor's code, depyf's decompiled
bytecode, report.md/report.html); `--verify` runs every pass's graph before and after it on
random inputs and reports the largest difference. Both compile fresh, never from the compile
cache (a warm start runs no pass, so it would check nothing). With `--tensor-parallel-size N` every rank
compiles its shard (rank r > 0 dumps into DIR/rank<r>).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

from compilelm.entrypoints.engine_args import ArgError, add_engine_args, engine_config_from_args


def add_parser(sub) -> None:
    p = sub.add_parser("compile",
                       help="compile a model (pre-warms the compile cache); --dump shows what the compiler did")
    add_engine_args(p)
    p.add_argument("--dump", metavar="DIR", default=None,
                   help="write graphs, Inductor code, decompiled bytecode and report.{md,html} here")
    p.add_argument("--verify", action="store_true",
                   help="check every pass numerically (graph before vs after on random inputs)")
    p.add_argument("--profile", action="store_true",
                   help="with --dump: run a decode and a prefill step under the torch profiler; the report says "
                        "where the time goes per piece, kernel, source line and op family")
    p.add_argument("--profile-decode", default="8x512", metavar="SEQSxCONTEXT",
                   help="the profiled decode step: SEQS sequences at context CONTEXT (default 8x512)")
    p.add_argument("--profile-prefill", default="1x512", metavar="SEQSxTOKENS",
                   help="the profiled prefill step: SEQS sequences of TOKENS new tokens (default 1x512)")
    p.set_defaults(run=run)


def load_model(config):
    """The model and the model part of the cache key, as one rank's Worker builds them (for
    benchmarks that compile a model by hand; tensor_parallel_size 1)."""
    from compilelm.runtime.worker import Worker

    worker = Worker(config)
    return worker.model, config.cache_key_factors(worker.model_config)


def run(args: argparse.Namespace) -> int:
    from compilelm.models.dtype import resolve_dtype
    from compilelm.models.loader import load_model_config, resolve_model
    from compilelm.runtime.executor import Executor

    config = engine_config_from_args(args)
    compilation = config.compilation
    if compilation is None or compilation.level == 0:
        raise ArgError("nothing to compile at -O0 / --enforce-eager")
    profile = _profile_steps(args)
    if profile:  # Inductor's CPU kernels then show in the profiler (CUDA kernels always do)
        from compilelm.graphs.profile import PROFILE_PATCHES
        compilation = dataclasses.replace(compilation, inductor_options=tuple(sorted(
            {**dict(compilation.inductor_options), **PROFILE_PATCHES}.items())))
    compilation = dataclasses.replace(compilation, dump_dir=args.dump, verify_passes=args.verify)
    source = resolve_model(config.model, config.revision, config.download_dir)
    # --dtype auto settled as the engine settles it: the same cache key
    config = dataclasses.replace(config, compilation=compilation,
                                 dtype=resolve_dtype(config.dtype, source, config.torch_device().type))
    load_model_config(source, dict(config.model_overrides)).verify_tensor_parallel(config.tensor_parallel_size)
    # The model is loaded exactly as the engine loads it (one Worker per rank), so the cache keys match.
    executor = Executor(config)
    try:
        data = executor.collective_rpc("compile_model", profile)  # rank 0's report; ranks > 0 dump into DIR/rank<r>
    finally:
        executor.shutdown()
    _print_summary(data[0], args.dump)
    return 0


def _profile_steps(args) -> list | None:
    if not args.profile:
        return None
    if not args.dump:
        raise ArgError("--profile writes its tables into the dump's report: give --dump DIR too")
    from compilelm.graphs.profile import StepSpec
    try:
        return [StepSpec.parse("decode", args.profile_decode), StepSpec.parse("prefill", args.profile_prefill)]
    except ValueError as e:
        raise ArgError(str(e)) from None


def _print_summary(data: dict, dump_dir: str | None) -> None:
    out = sys.stdout
    c, t = data["counters"], data["times_s"]
    out.write(f"compiled ({data['mode']}) in {t['total']:.1f} s; cache key {data['cache']['key']} "
              f"in {data['cache']['dir']}\n")
    out.write(f"pieces: {c['pieces']} ({c['unique_pieces']} unique), Inductor compiles: {c['inductor_compiles']}, "
              f"loaded from cache: {c['artifacts_loaded']}\n")
    out.write("times: " + ", ".join(f"{k} {v:.2f}s" for k, v in t.items()) + "\n")
    for rewrite in data.get("load_rewrites", []):
        out.write(f"  at load: {rewrite}\n")
    for p in data["passes"]:
        err = "" if p["max_error"] is None else f"  max error {p['max_error']:.3g}"
        note = f"  ({p['verify_error']})" if p["verify_error"] else ""
        out.write(f"  {p['stage']:<11} {p['pass']:<24} matches {p['matches']:>4}  "
                  f"{p['seconds'] * 1000:8.2f} ms{err}{note}\n")
    verify = data.get("verify") or {}
    if verify.get("requested"):
        out.write(_verify_line(verify))
    for step in (data.get("profile") or {}).get("steps", []):
        top = ", ".join(f"{f['family']} {f['ms']:.2f}" for f in step["families"][:4])
        how = ("one CUDA graph replay" if step.get("cuda_graph") is True
               else f"{step['step_ms']:.2f} ms profiled, op by op")
        out.write(f"profile {step['name']} {step['seqs']}x{step['context']}: {step['measured_ms']:.2f} ms ({how}); "
                  f"families sum to {step['sum_ms']:.2f} ms; ms by family: {top}\n")
    if dump_dir:
        out.write(f"dump written to {dump_dir} (report.html, report.md, report.json)\n")
        out.write(f"torch trace (TORCH_TRACE) in {dump_dir}/trace: {data['tlparse']}\n")


def _verify_line(v: dict) -> str:
    if not v["checked"]:
        return "--verify: NOTHING was checked: no pass ran on a graph that could be run on random inputs\n"
    failed = f"; {len(v['failed'])} pass runs could not be run (see above)" if v["failed"] else ""
    return f"--verify: {v['checked']} pass runs checked, largest error {v['max_error']:.3g}{failed}\n"
