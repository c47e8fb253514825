"""Where one profiled step's time went, read from the torch profiler's trace (Chrome trace JSON,
CPU or CUDA): per call, per piece, per FX node / source line, per op family, and the unfused
chains of elementwise kernels worth a pass.

A *call* is one thing a piece's generated code (or the stitched graph, between pieces) runs: an
op event not inside another op (Inductor's wrapper ranges, `## Call CompiledFxGraph ##`, and
compilelm's own annotations don't count as ops), or a bare kernel launch. Inductor wraps each
Triton launch in a range named after the kernel, so a Triton kernel is a call of its own name.
On CUDA a call's time is the GPU time of the kernels it launched (found through the launches'
correlation ids) and the launch gaps are the step's wall time the GPU was idle; on CPU a call's
time is its own wall time and the gaps are host time outside every call. Either way the
families plus the gaps add up to the step's time unless kernels overlap.

Calls inside a piece are matched, in order and by name, to that piece's kernel table
(kernels.py), which says which FX nodes and source lines each came from.
"""

from __future__ import annotations

import re

from compilelm.graphs.op_family import FUSIBLE, family

STEP = "compilelm.step"
PIECE = "compilelm.piece:"  # + "<call site>:<compiled as>"
LM_HEAD = "compilelm.lm_head"
_TRANSPARENT = re.compile(r"^(## |AOTDispatcher|compilelm\.|Torch-Compiled Region|CompiledFunction)")
_HOST = ("cpu_op", "user_annotation", "cuda_runtime", "cuda_driver")
_DEVICE = ("kernel", "gpu_memcpy", "gpu_memset")


def attribute(trace: dict, kernel_tables: dict[str, list[dict]]) -> dict:
    """`kernel_tables`: compiled piece name -> its kernels (kernels.kernel_table)."""
    events = [e for e in trace["traceEvents"] if e.get("ph") == "X" and "dur" in e]
    # the host's range (on a GPU the profiler also draws a "gpu_user_annotation" of the same name)
    step = max((e for e in events if e["name"] == STEP and e.get("cat") == "user_annotation"), key=lambda e: e["dur"])
    t0, t1 = step["ts"], step["ts"] + step["dur"]
    host = sorted((e for e in events if e.get("cat") in _HOST and t0 <= e["ts"] < t1 and e is not step
                   and (e.get("tid") == step["tid"] or e["cat"] in ("cuda_runtime", "cuda_driver"))),
                  key=lambda e: (e["ts"], -e["dur"]))
    device = [e for e in events if e.get("cat") in _DEVICE]
    launched: dict = {}
    for d in device:
        launched.setdefault((d.get("args") or {}).get("correlation"), []).append(d)
    calls = _calls(host, launched)
    unattributed = 0.0
    if device:  # every kernel that ran in the step counts; one no call launched is said so
        ran = [k for k in device if k["ts"] < t1 and k["ts"] + k["dur"] > t0]
        busy = [(max(k["ts"], t0), min(k["ts"] + k["dur"], t1)) for k in ran]
        own = _exclusive(ran, t0, t1)
        for c in calls:
            c["us"] = sum(own.get(id(k), 0.0) for k in c["kernels"])
        mine = {id(k) for c in calls for k in c["kernels"]}
        unattributed = sum(us for k, us in zip(ran, own.values()) if id(k) not in mine)
    else:
        busy = [(c["ts"], c["end"]) for c in calls]
    gaps = (t1 - t0) - _union(busy)
    _match(calls, kernel_tables)
    return {"device": "cuda" if device else "cpu", "step_us": t1 - t0, "gaps_us": gaps, "calls": calls,
            "unattributed_us": unattributed}


def replay(eager: dict, trace: dict, step_us: float | None = None) -> dict:
    """`eager` (attribute's result for a step run op by op) with its kernel times taken from
    `trace`, the profile of the same step replayed as one CUDA graph: the replayed kernels are
    aligned with the eager ones in launch order by name (difflib), each inheriting its eager call's
    piece, FX nodes and family; a replayed kernel that aligns with none is a call of its own,
    placed by name. `step_us`: the step's time measured without the profiler (whose per-kernel
    records stretch a replay's gaps, not its kernels), else the profiled replay's; the launch gaps
    are that time less the GPU's busy time."""
    import difflib

    events = [e for e in trace["traceEvents"] if e.get("ph") == "X" and "dur" in e]
    step = max((e for e in events if e["name"] == STEP and e.get("cat") == "user_annotation"), key=lambda e: e["dur"])
    t0, t1 = step["ts"], step["ts"] + step["dur"]
    ran = sorted((e for e in events if e.get("cat") in _DEVICE and e["ts"] < t1 and e["ts"] + e["dur"] > t0),
                 key=lambda e: e["ts"])
    before = sorted(((k["ts"], k["name"], c) for c in eager["calls"] for k in c["kernels"]), key=lambda x: x[0])
    calls = [{**c, "kernels": []} for c in eager["calls"]]
    index = {id(c): i for i, c in enumerate(eager["calls"])}
    matcher = difflib.SequenceMatcher(None, [n for _, n, _ in before], [k["name"] for k in ran], autojunk=False)
    for tag, a0, a1, b0, b1 in matcher.get_opcodes():
        if tag == "equal":
            for (_, _, c), k in zip(before[a0:a1], ran[b0:b1]):
                calls[index[id(c)]]["kernels"].append(k)
            continue
        for k in ran[b0:b1]:
            calls.append({"name": k["name"], "ts": k["ts"], "end": k["ts"] + k["dur"], "kernels": [k], "piece": None,
                          "piece_start": None, "site": None, "compiled_as": "(in the graph, not in the eager run)",
                          "call": None, "nodes": [], "source": [], "family": family([k["name"]], [])})
    calls = [c for c in calls if c["kernels"]]
    own = _exclusive(ran, t0, t1)
    for c in calls:
        c["us"] = sum(own[id(k)] for k in c["kernels"])
    step = step_us if step_us is not None else t1 - t0
    busy = sum(own.values())
    return {"device": "cuda", "step_us": step, "gaps_us": max(0.0, step - busy), "calls": calls,
            "unattributed_us": 0.0, "profiled_us": t1 - t0, "busy_us": busy}


def _calls(host: list[dict], launched: dict) -> list[dict]:
    calls, open_calls, pieces = [], [], []
    for e in host:
        end = e["ts"] + e["dur"]
        while open_calls and open_calls[-1]["end"] <= e["ts"]:
            open_calls.pop()
        pieces = [p for p in pieces if p[1] > e["ts"]]
        if e["name"].startswith((PIECE, LM_HEAD)):
            pieces.append((e["name"], end, e["ts"]))
            continue
        corr = (e.get("args") or {}).get("correlation")
        if open_calls:  # inside a call: its launches are the call's kernels
            open_calls[-1]["kernels"] += launched.get(corr, []) if e["cat"] in ("cuda_runtime", "cuda_driver") else []
            continue
        if _TRANSPARENT.match(e["name"]) or (e["cat"] in ("cuda_runtime", "cuda_driver") and corr not in launched):
            continue
        kernels = list(launched.get(corr, [])) if e["cat"] != "cpu_op" else []
        name = kernels[0]["name"] if e["cat"] != "cpu_op" and kernels else e["name"]
        piece = pieces[-1] if pieces else None
        call = {"name": name, "ts": e["ts"], "end": end, "kernels": kernels, "piece": piece[0] if piece else None,
                "piece_start": piece[2] if piece else None}
        calls.append(call)
        open_calls.append(call)
    if launched:  # on a GPU a call is its kernels: one that launched none took no GPU time
        calls = [c for c in calls if c["kernels"]]
    for c in calls:
        c["us"] = sum(k["dur"] for k in c["kernels"]) if launched else c["end"] - c["ts"]
    return calls


def _exclusive(kernels: list[dict], t0: float, t1: float) -> dict[int, float]:
    """id(kernel) -> its GPU time within [t0, t1) not overlapping an earlier-started kernel's
    (with programmatic dependent launch a kernel starts while its predecessor runs and waits for
    it: the overlap is the predecessor's). The values add up to the union of the kernels' spans."""
    own, done = {}, t0
    for k in sorted(kernels, key=lambda k: k["ts"]):
        end = min(k["ts"] + k["dur"], t1)
        own[id(k)] = max(0.0, end - max(k["ts"], done))
        done = max(done, end)
    return {id(k): own[id(k)] for k in kernels}


def _union(spans: list[tuple[float, float]]) -> float:
    total, last = 0.0, float("-inf")
    for a, b in sorted(spans):
        if b > last:
            total += b - max(a, last)
            last = b
    return total


def _norm(name: str) -> str:
    """One spelling for a call and its kernel-table entry: `aten::mm` ~ `extern_kernels.mm`,
    `compilelm::rope_cache` ~ `torch.ops.compilelm.rope_cache.default`, `graph_2_cpp_fused_x` ~
    `cpp_fused_x` (Inductor's CPU kernel-profile names)."""
    name = re.sub(r"^graph_\d+_", "", name).removeprefix("extern_kernels.").removeprefix("torch.ops.")
    name = re.sub(r"\.default$", "", name.replace("::", "."))
    return name.removeprefix("aten.")


def _match(calls: list[dict], kernel_tables: dict[str, list[dict]]) -> None:
    """Each call gets site, compiled_as, its kernel-table entry (call index, nodes, source) and family."""
    instances: dict = {}
    for c in calls:
        instances.setdefault((c["piece"], c["piece_start"]), []).append(c)
    for (piece, _), group in instances.items():
        site, compiled_as = (piece.split(":")[1:3] if piece and piece.startswith(PIECE)
                             else ("lm_head", "lm_head") if piece else (None, None))
        table = kernel_tables.get(compiled_as or "", [])
        j = 0
        for c in group:
            c["site"], c["compiled_as"] = site, compiled_as or "(between pieces)"
            entry = None
            for k in range(j, len(table)):
                if _norm(table[k]["name"]) == _norm(c["name"]):
                    entry, j = table[k], k + 1
                    break
            c["call"] = entry["call"] if entry else None
            c["nodes"] = entry["nodes"] if entry else []
            c["source"] = entry["source"] if entry else []
            ops = [c["name"]] + [k["name"] for k in c["kernels"]] + (table_name(entry) if entry else [])
            c["family"] = family(ops, c["source"])


def table_name(entry: dict) -> list[str]:
    return [entry["name"], *entry["nodes"]]


def summarize(result: dict, top: int = 40) -> dict:
    """Per family (with the gaps), per kernel (summed over call sites), per source line, chains."""
    calls, step = result["calls"], result["step_us"]
    families: dict[str, float] = {}
    for c in calls:
        families[c["family"]] = families.get(c["family"], 0.0) + c["us"]
    families["launch gaps"] = result["gaps_us"]
    if result.get("unattributed_us"):
        families["unattributed"] = result["unattributed_us"]  # kernels whose launch the trace does not show
    kernels: dict = {}
    for c in calls:
        key = (c["compiled_as"], c["call"] if c["call"] is not None else c["name"])
        k = kernels.setdefault(key, {"compiled_as": c["compiled_as"], "call": c["call"], "name": c["name"],
                                     "family": c["family"], "us": 0.0, "count": 0, "nodes": c["nodes"][:8],
                                     "source": c["source"][:2], "kernels": sorted({x["name"] for x in c["kernels"]})})
        k["us"] += c["us"]
        k["count"] += 1
    pieces: dict[str, list] = {}  # compiled piece -> [us, call sites]
    for c in calls:
        p = pieces.setdefault(c["compiled_as"], [0.0, set()])
        p[0] += c["us"]
        p[1].add(c["site"] or c["ts"])  # between pieces: each op call is a site of its own
    sources: dict[str, float] = {}
    for c in calls:
        where = c["source"][0] if c["source"] else f"({c['name']})"
        sources[where] = sources.get(where, 0.0) + c["us"]
    total = sum(families.values())
    return {
        "device": result["device"], "step_ms": step / 1000, "sum_ms": total / 1000,
        **{k.replace("_us", "_ms"): result[k] / 1000 for k in ("profiled_us", "busy_us") if k in result},
        "families": [{"family": f, "ms": us / 1000, "share": us / step if step else 0.0}
                     for f, us in sorted(families.items(), key=lambda kv: -kv[1])],
        "pieces": [{"piece": p, "ms": us / 1000, "sites": len(sites)}
                   for p, (us, sites) in sorted(pieces.items(), key=lambda kv: -kv[1][0])],
        "kernels": sorted(kernels.values(), key=lambda k: -k["us"])[:top],
        "sources": [{"source": s, "ms": us / 1000} for s, us in sorted(sources.items(), key=lambda kv: -kv[1])][:top],
        "chains": unfused_chains(kernels),
    }


def unfused_chains(kernels: dict, top: int = 5) -> list[dict]:
    """Maximal runs of consecutive fusible kernels (elementwise, norm, rope, quant, copies) in a
    piece, in call order, with what comes before and after (a GEMM there means an epilogue or
    prologue to fuse into it): runs of two or more launches, or one next to a GEMM."""
    by_piece: dict[str, dict[int, dict]] = {}
    for (piece, call), k in kernels.items():
        if isinstance(call, int):
            by_piece.setdefault(piece, {})[call] = k
    chains = []
    for piece, table in by_piece.items():
        order = [table[i] for i in sorted(table)]
        run: list[dict] = []
        for i, k in enumerate(order + [None]):
            if k is not None and k["family"] in FUSIBLE:
                run.append(k)
                continue
            if run:
                before = order[i - len(run) - 1] if i - len(run) > 0 else None
                near_gemm = any(x is not None and x["family"] == "GEMM" for x in (before, k))
                if len(run) > 1 or near_gemm:
                    chains.append({"piece": piece, "calls": [x["call"] for x in run], "launches": len(run),
                                   "ms": sum(x["us"] for x in run) / 1000, "families": [x["family"] for x in run],
                                   "names": [x["name"] for x in run],
                                   "before": _describe(before), "after": _describe(k),
                                   "source": [s for x in run for s in x["source"][:1]]})
            run = []
    return sorted(chains, key=lambda c: -c["ms"])[:top]


def _describe(k: dict | None) -> str:
    return "" if k is None else f"{k['family']} ({k['name']})"
