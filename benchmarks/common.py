"""Shared helpers for benchmarks: machine facts for the JSON, table printing, result files."""

from __future__ import annotations

import contextlib
import json
import os
import platform
import subprocess
import time

RESULTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def environment() -> dict:
    import torch
    repo = os.path.dirname(os.path.dirname(RESULTS_DIR))
    stamp = os.path.join(repo, "COMMIT")  # written next to a `git archive` snapshot (no .git of its own)
    if os.path.exists(stamp):
        with open(stamp) as f:
            commit = f.read().strip()
    else:
        try:
            commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                    cwd=repo).stdout.strip()
        except OSError:
            commit = "unknown"
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    return {"torch": torch.__version__, "gpu": gpu, "cpu": platform.processor() or platform.machine(),
            "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(), "commit": commit,
            "time": time.strftime("%Y-%m-%dT%H:%M:%S")}


def print_table(rows: list[dict], columns: list[str]) -> None:
    widths = {c: max([len(c), *(len(_fmt(r.get(c))) for r in rows)]) for c in columns}
    print("  ".join(c.ljust(widths[c]) for c in columns))
    print("  ".join("-" * widths[c] for c in columns))
    for r in rows:
        print("  ".join(_fmt(r.get(c)).ljust(widths[c]) for c in columns))


def _fmt(v) -> str:
    if v is None:
        return "-"
    return f"{v:.3g}" if isinstance(v, float) else str(v)


def write_result(name: str, payload: dict, out: str | None = None) -> str:
    path = out or os.path.join(RESULTS_DIR, f"{name}.json")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump({"benchmark": name, "env": environment(), **payload}, f, indent=2)
    return path


@contextlib.contextmanager
def watch_compiles():
    """Yields a list that collects each `CompiledModel` compiled inside the block (its stage times,
    counters and pass matches; the engine keeps it to itself)."""
    from compilelm.graphs import CompiledModel

    seen, original = [], CompiledModel.compile

    def compile(self, *args, **kwargs):
        seen.append(self)
        return original(self, *args, **kwargs)

    CompiledModel.compile = compile
    try:
        yield seen
    finally:
        CompiledModel.compile = original


def time_calls(owner, name: str, record: dict, key: str) -> None:
    """Wrap owner.name (a module, class or instance attribute) so that its wall time adds up in
    record[key] (seconds)."""
    fn = getattr(owner, name)

    def wrapper(*args, **kwargs):
        t = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            record[key] = record.get(key, 0.0) + time.perf_counter() - t

    setattr(owner, name, wrapper)


def summary(out_dir: str) -> list[dict]:
    """One compact table over the JSON results in `out_dir` (scripts/gpu_bench.sh prints it last):
    a row per headline number, with its target or reference and whether it was met."""
    def load(name):
        try:
            with open(os.path.join(out_dir, f"{name}.json")) as f:
                return json.load(f)
        except (OSError, ValueError):
            return None

    def status(ok):
        return ok if isinstance(ok, str) else "-" if ok is None else ("met" if ok else "MISSED")

    rows = []
    add = lambda bench, case, value, ref="", ok=None: rows.append(  # noqa: E731
        {"benchmark": bench, "case": case, "value": value, "target/reference": ref, "status": status(ok)})
    if d := load("bench_decode"):
        for r in d["rows"]:
            if "error" in r:
                add("decode", r["model"], "ERROR", r["error"][:60])
                continue
            case = f"{r['model'].split(':')[-1]} b{r['batch']} ctx{r['context']}"
            case += " no PDL" * (r.get("pdl") is False) + " cuBLAS" * (r.get("hopper_gemm") is False)  # A/B rows
            target = r.get("target_ms")
            add("decode", case, f"{r['ours_ms']:.3f} ms/step", f"target {target} ms; roofline {r['roofline_ms']:.3f}"
                if target else f"roofline {r['roofline_ms']:.3f} ms",
                None if target is None else r["ours_ms"] <= target)
            if r.get("speedup_vs_hf"):
                add("decode", case + " vs HF", f"{r['speedup_vs_hf']:.2f}x", f"HF {r.get('hf_mode')}"
                    + ("; target >= 2x" if r["batch"] == 64 else ""),
                    r["speedup_vs_hf"] >= 2 if r["batch"] == 64 else None)
    if d := load("bench_throughput"):
        for r in d["rows"]:
            if r.get("engine") == "compilelm":
                ref = f"{r['speedup_vs_hf']:.2f}x HF generate; " if r.get("speedup_vs_hf") else ""
                value = f"{r['output_tok_s']:.0f} out tok/s" if "output_tok_s" in r else "ERROR " + r["error"][:60]
                add("throughput", f"{r['model'].split(':')[-1]} {r.get('requests')} req", value,
                    ref + "vLLM 8.6-9.5k tok/s Qwen3-0.6B A100")
    if d := load("bench_compile_gpu"):
        for r in d["rows"]:
            if "ready_s" not in r:
                add("compile", f"{r['model'].split(':')[-1]} {r['run']}", "FAILED")
                continue
            value = (f"{r['compile_capture_s']:.1f} s compile+capture, " if "compile_capture_s" in r else "") \
                + f"{r['ready_s']:.1f} s ready"
            ref = f"target {r['target_s']} s" + (f" (ready: {r['ready_met']})" if r.get("ready_met") else "") \
                if r.get("target_s") else ""
            add("compile", f"{r['model'].split(':')[-1]} {r['run']}", value, ref,
                None if not r.get("met") else r["met"] == "met")
    if d := load("bench_passes_gpu"):
        per_fusion: dict = {}
        for r in d.get("rows", []):
            per_fusion.setdefault(("piece", r["fusion"]), []).append(
                f"{r.get('tokens')}:{r['speedup']:.2f}x" if "speedup" in r else "error")
        for r in d.get("e2e_rows", []):
            if "speedup" in r:
                per_fusion.setdefault(("e2e", r["fusion"]), []).append(
                    f"{r['measure'].replace('_ms', '')}:{r['speedup']:.2f}x")
            elif "error" in r:
                per_fusion.setdefault(("e2e", r["fusion"]), []).append("error")
        for (kind, fusion), items in per_fusion.items():
            add("passes " + kind, fusion, " ".join(items), "speedup = off / on (tokens or measure)")
    if d := load("bench_attention"):
        s = d.get("summary", {})
        add("attention", "paged decode, min % of copy bw", f"{s.get('min_pct_of_copy_bw_at_target_sizes', 0):.1f}%",
            s.get("target", ""), s.get("target_met"))
    if d := load("bench_structured_gpu") or load("bench_structured"):
        rows_t = d.get("throughput") or []
        for row in rows_t[1:]:
            add("structured", f"{row['batch']} / none", f"{row['ratio']:.3f}",
                f"{rows_t[0]['output_tok_s']:.0f} -> {row['output_tok_s']:.0f} out tok/s; target >= 0.90",
                row["ratio"] >= 0.90)
        if n := d.get("new_schema"):
            add("structured", "ITL max across a new schema", f"{n['schema_itl_across_arrival_max_ms']} ms",
                f"plain request {n['plain_itl_across_arrival_max_ms']} ms; median {n['itl_before_median_ms']} ms; "
                f"compile {n['schema_compile_ms']} ms")
    try:
        with open(os.path.join(out_dir, "timings.txt")) as f:
            for line in f:
                name, rc, secs = line.split()
                add("elapsed", name, f"{secs} s", f"rc {rc}" + (" (timed out)" if rc in ("124", "137") else ""),
                    "ok" if rc == "0" else "FAILED")
    except OSError:
        pass
    return rows
