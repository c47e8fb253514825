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
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                cwd=os.path.dirname(RESULTS_DIR)).stdout.strip()
    except OSError:
        commit = "unknown"
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    return {"torch": torch.__version__, "gpu": gpu, "cpu": platform.processor() or platform.machine(),
            "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(), "commit": commit,
            "time": time.strftime("%Y-%m-%dT%H:%M:%S")}


def print_table(rows: list[dict], columns: list[str]) -> None:
    widths = {c: max(len(c), *(len(_fmt(r.get(c))) for r in rows)) for c in columns}
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
