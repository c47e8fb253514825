"""`compilelm compile --dump DIR`: everything a person needs to see what the compiler did.

    01_dynamo_graph.py                  the graph Dynamo traced (torch level)
    02_aten_graph.py                    after AOTAutograd: functional aten, whole model
    03_after_whole_graph_passes.py      after the whole-graph passes
    04_split_graph.py, split.md         the split: each piece's inputs/outputs and shapes
    05_stitched_graph.py                the Python function that runs the pieces
    06_dynamo_bytecode_decompiled.py    depyf's decompilation of Dynamo's bytecode for forward
    passes/<graph>/NN.<Pass>.{before,after}.py   every graph before/after every pass
    inductor/<piece>-<size>.py          Inductor's generated code per compiled piece
    report.md, report.html, report.json passes (matches, time, --verify error), pieces (op
                                        counts), compile times, counters, cache key factors
    trace/                              torch's structured trace (TORCH_TRACE) of the compile, for tlparse
"""

from __future__ import annotations

import contextlib
import glob
import json
import logging
import os
import shutil

from compilelm.graphs.inductor import bypass_caches
from compilelm.graphs.kernels import ARTIFACTS, PROVENANCE_PATCHES, kernel_table
from compilelm.graphs.report_html import render as render_html
from compilelm.graphs.report_profile import render_profile
from compilelm.graphs.torch_trace import TLPARSE, capture_artifacts


class Dumper:
    def __init__(self, root: str):
        self.root = os.path.abspath(root)
        os.makedirs(self.root, exist_ok=True)
        self.kernels: dict[str, list[dict]] = {}  # "<piece>-<size>" -> its kernels (kernels.py)

    def path(self, *parts: str) -> str:
        return os.path.join(self.root, *parts)

    def write(self, name: str, text: str) -> None:
        path = self.path(name)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            f.write(text)

    @contextlib.contextmanager
    def inductor_trace(self, name: str):
        """Inductor config patches for one piece's compile that bypass its FX-graph and AOTAutograd
        caches (so every pass really runs) and keep the generated code as inductor/<name>.py."""
        trace_dir = self.path("inductor", name + ".trace")
        patches = {**PROVENANCE_PATCHES, "trace.enabled": True, "trace.debug_dir": trace_dir,
                   "trace.fx_graph": False, "trace.fx_graph_transformed": False,
                   "trace.ir_pre_fusion": False, "trace.ir_post_fusion": False}
        # Inductor warns that a cache-less compile cannot be saved and where the trace went.
        quiet = [logging.getLogger(n) for n in ("torch._inductor.standalone_compile", "torch._inductor.debug")]
        levels = [q.level for q in quiet]
        try:
            for q in quiet:
                q.setLevel(logging.ERROR)
            with bypass_caches() as no_cache, capture_artifacts(ARTIFACTS) as provenance:
                yield {**patches, **no_cache}
            found = sorted(glob.glob(os.path.join(trace_dir, "**", "output_code.py"), recursive=True))
            for i, src in enumerate(found):
                shutil.copy(src, self.path("inductor", f"{name}{'' if i == 0 else f'.{i}'}.py"))
            if not found:
                self.write(f"inductor/{name}.py", "# Inductor wrote no output code\n")
            with open(self.path("inductor", f"{name}.py")) as f:
                self.kernels[name] = kernel_table(f.read(), provenance)
        finally:
            for q, level in zip(quiet, levels):
                q.setLevel(level)
            shutil.rmtree(trace_dir, ignore_errors=True)


def report_data(cm) -> dict:
    """The numbers of one compilation (`CompiledModel`), as plain JSON-able data."""
    passes: dict[tuple[str, str], dict] = {}
    for r in cm.recorder.records:
        stage = "whole_graph" if r.graph == "whole_graph" else "post_grad"
        agg = passes.setdefault((stage, r.name), {"stage": stage, "pass": r.name, "graphs": 0, "matches": 0,
                                                 "seconds": 0.0, "max_error": None, "verify_error": None})
        agg["graphs"] += 1
        agg["matches"] += r.matches
        agg["seconds"] += r.seconds
        if r.max_error is not None:
            agg["max_error"] = max(agg["max_error"] or 0.0, r.max_error)
        agg["verify_error"] = agg["verify_error"] or r.verify_error
    backend = cm.backend
    return {
        "mode": cm.mode,
        "cache": {"dir": cm.cache.dir, "key": cm.cache.key, "enabled": cm.cache.enabled},
        "times_s": {k: round(v, 4) for k, v in cm.times.items()},
        "counters": cm.counters,
        "inductor_counters": cm.inductor_counters,
        "passes": list(passes.values()),
        "pass_runs": [vars(r) for r in cm.recorder.records],
        "pass_uuids": cm.manager.uuids(),
        "pieces": backend.pieces if backend else [],
        "cache_key_factors": cm.factors,
        "load_rewrites": list(cm.load_rewrites),  # the passes' prepare_model: the model changed before tracing
        "depyf_error": cm.depyf_error,
        "verify": verify_summary(cm.recorder.records, cm.config.verify_passes),
        "kernels": cm.dumper.kernels if cm.dumper else {},  # "<piece>-<size>" -> kernels in call order
        "profile": cm.profile,  # compile --profile (graphs/profile.py)
        "tlparse": TLPARSE.format(trace=cm.dumper.path("trace"), out=cm.dumper.path("tlparse")) if cm.dumper else None,
    }


def verify_summary(records, requested: bool) -> dict:
    """What --verify checked: pass runs measured, the largest error, the runs it could not run."""
    errors = [r.max_error for r in records if r.max_error is not None]
    return {"requested": requested, "checked": len(errors), "max_error": max(errors, default=None),
            "failed": [f"{r.graph}: {r.name}: {r.verify_error}" for r in records if r.verify_error]}


def write_report(cm) -> None:
    data = report_data(cm)
    dumper = cm.dumper
    dumper.write("report.json", json.dumps(data, indent=2, default=str))
    sections = _sections(data)
    split_rows = [[p["name"], p["compiled_as"], "<br>".join(p["inputs"]), "<br>".join(p["outputs"])]
                  for p in data["pieces"]]
    dumper.write("split.md", _markdown([("Pieces", ["piece", "compiled as", "inputs", "outputs"], split_rows)]))
    dumper.write("report.md", "# compilelm compile report\n\n" + _markdown(sections))
    dumper.write("report.html", render_html(data, dumper.root, render_profile(data["profile"])))


def _sections(data: dict) -> list[tuple[str, list[str], list[list]]]:
    t = data["times_s"]
    times = [[k, f"{t[k]:.3f}"] for k in ("dynamo", "aot", "whole_graph_passes", "split", "post_grad_passes",
                                          "inductor", "load", "total") if k in t]
    passes = [[p["stage"], p["pass"], p["graphs"], p["matches"], f"{p['seconds'] * 1000:.2f}",
               "" if p["max_error"] is None else f"{p['max_error']:.3g}", p["verify_error"] or ""]
              for p in data["passes"]]
    pieces = [[p["name"], p["compiled_as"], p["key"][:10], len(p["inputs"]), len(p["outputs"]), sum(p["ops"].values()),
               ", ".join(f"{k}×{v}" for k, v in list(p["ops"].items())[:6])] for p in data["pieces"]]
    counters = [[k, v] for k, v in {**data["counters"],
                                    **{f"inductor.{k}": v for k, v in data["inductor_counters"].items()}}.items()]
    factors = [[k, json.dumps(v, sort_keys=True, default=str)] for k, v in data["cache_key_factors"].items()]
    summary = [["mode", data["mode"]], ["cache key", data["cache"]["key"]], ["cache dir", data["cache"]["dir"]],
               ["load-time rewrites", "<br>".join(data["load_rewrites"]) or "none"],
               ["depyf", data["depyf_error"] or "ok"],
               ["torch trace (TORCH_TRACE)", f"trace/: {data['tlparse']}"]]
    profile = [(f"Profile: {s['name']} {s['seqs']}x{s['context']} ({s['step_ms']:.3f} ms profiled, "
                f"{s['measured_ms']:.3f} ms without the profiler)", ["op family", "ms", "share"],
                [[f["family"], f"{f['ms']:.3f}", f"{100 * f['share']:.1f}%"] for f in s["families"]]
                + [["sum", f"{s['sum_ms']:.3f}", ""]]) for s in (data["profile"] or {}).get("steps", [])]
    return [
        ("Summary", ["", ""], summary),
        *profile,
        ("Compile times (s)", ["stage", "seconds"], times),
        ("Passes", ["stage", "pass", "graphs", "matches", "ms", "max error (--verify)", "verify note"], passes),
        ("Pieces", ["piece", "compiled as", "key", "inputs", "outputs", "ops", "top ops"], pieces),
        ("Counters", ["counter", "value"], counters),
        ("Cache key factors", ["factor", "value"], factors),
    ]


def _markdown(sections) -> str:
    out = []
    for title, headers, rows in sections:
        out += [f"## {title}", "", "| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
        out += ["| " + " | ".join(str(c).replace("|", "\\|") for c in row) + " |" for row in rows]
        out.append("")
    return "\n".join(out)
