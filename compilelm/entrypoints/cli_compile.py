"""`compilelm compile [MODEL] [--dump DIR] [--verify]`: compile a model without serving it.

The model is loaded exactly as the engine loads it, so the compile-cache key is the one `serve`
and `LLM(...)` will compute: running this pre-warms the cache. `--dump DIR` writes what the
compiler did (graphs before/after every pass, the split, Inductor's code, depyf's decompiled
bytecode, report.md/report.html); `--verify` runs every pass's graph before and after it on
random inputs and reports the largest difference. With `--tensor-parallel-size N` every rank
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
    compilation = dataclasses.replace(compilation, dump_dir=args.dump, verify_passes=args.verify)
    source = resolve_model(config.model, config.revision, config.download_dir)
    # --dtype auto settled as the engine settles it: the same cache key
    config = dataclasses.replace(config, compilation=compilation,
                                 dtype=resolve_dtype(config.dtype, source, config.torch_device().type))
    load_model_config(source, dict(config.model_overrides)).verify_tensor_parallel(config.tensor_parallel_size)
    # The model is loaded exactly as the engine loads it (one Worker per rank), so the cache keys match.
    executor = Executor(config)
    try:
        data = executor.collective_rpc("compile_model")  # rank 0's report; ranks > 0 dump into DIR/rank<r>
    finally:
        executor.shutdown()
    _print_summary(data[0], args.dump)
    return 0


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
    if dump_dir:
        out.write(f"dump written to {dump_dir} (report.md, report.html)\n")
