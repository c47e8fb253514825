"""report.html's Profile section (`compile --profile`): per step, the time per op family as a table
and a bar chart (summing to the step), the unfused elementwise chains worth a pass, the kernels
and the source lines that took the most time."""

from __future__ import annotations

import html

from compilelm.graphs.report_html import section

e = html.escape
GAP_NOTE = {"cuda": "launch gaps: GPU idle within the step (between the graph's kernels, and the replay's launch "
                    "and synchronization; op by op, the host launching each kernel)",
            "cpu": "launch gaps: host time between ops (Python, Inductor's wrapper code)"}


def render_profile(profile: dict | None) -> str:
    if not profile:
        return section("profile", "Profile", "<p>not run (add --profile to --dump)</p>")
    return section("profile", "Profile", f"<p class='sub'>device {e(profile['device'])}; the trace of each step "
                   "opens in Perfetto or chrome://tracing</p>" + "".join(_step(s) for s in profile["steps"]))


def _step(s: dict) -> str:
    sid = f"profile-{s['name']}"
    off = 100 * (s["sum_ms"] / s["step_ms"] - 1) if s["step_ms"] else 0.0
    vs = 100 * (s["step_ms"] / s["measured_ms"] - 1) if s["measured_ms"] else 0.0
    title = f"<h3 id='{sid}'>{e(s['name'])}: {s['seqs']} × {s['new_tokens']} new tokens at context {s['context']}</h3>"
    link = f" · <a href='{e(s['trace'], quote=True)}'>{e(s['trace'])}</a></p>"
    if s.get("cuda_graph") is True:  # kernel times from the profiled replay, the step from unprofiled ones
        head = (f"{title}<p>step <b>{s['measured_ms']:.3f} ms</b>: one CUDA graph replay, median of {s['repeat']} "
                f"without the profiler (op by op: {s['eager_ms']:.3f} ms); its kernels kept the GPU busy "
                f"{s['busy_ms']:.3f} ms of it in the profiled replay; the families below add up to {s['sum_ms']:.3f} "
                f"ms ({100 * (s['sum_ms'] / s['measured_ms'] - 1):+.1f}% of the step){link}")
    else:
        head = (f"{title}<p>profiled step <b>{s['step_ms']:.3f} ms</b>; the families below add up to "
                f"{s['sum_ms']:.3f} ms ({off:+.1f}%); the step without the profiler: {s['measured_ms']:.3f} ms "
                f"(median of {s['repeat']}; the profiled one {vs:+.1f}%){_how(s)}{link}")
    top = max((f["ms"] for f in s["families"]), default=1.0) or 1.0
    rows = "".join(f"<tr><td>{e(f['family'])}</td><td>{f['ms']:.3f}</td><td>{100 * f['share']:.1f}%</td>"
                   f"<td><div class='bar{' gap' if f['family'] == 'launch gaps' else ''}' "
                   f"style='width:{100 * f['ms'] / top:.0f}%'></div></td></tr>" for f in s["families"])
    families = (f"<table class='hist' id='{sid}-families'><tr><th>op family</th><th>ms</th><th>share</th><th></th>"
                f"</tr>{rows}<tr><th>sum</th><th>{s['sum_ms']:.3f}</th><th></th><th></th></tr></table>"
                f"<p class='sub'>{e(GAP_NOTE.get(s['device'], ''))}</p>")
    return head + families + _chains(s, sid) + _pieces(s, sid) + _kernels(s, sid) + _sources(s, sid)


def _how(s: dict) -> str:
    if s.get("cuda_graph") is True:
        return f", replayed as one CUDA graph; op by op it takes {s['eager_ms']:.3f} ms"
    if isinstance(s.get("cuda_graph"), str):
        return f", op by op (CUDA graph {s['cuda_graph']})"
    return ""


def _pieces(s: dict, sid: str) -> str:
    rows = "".join(f"<tr><td>{_piece_link(p['piece'])}</td><td>{p['sites']}</td><td>{p['ms']:.3f}</td></tr>"
                   for p in s["pieces"])
    return (f"<h4 id='{sid}-pieces'>Time per piece, over its call sites</h4><table><tr><th>piece</th><th>sites</th>"
            f"<th>ms</th></tr>{rows}</table>")


def _piece_link(piece: str) -> str:
    return f"<a href='#piece-{e(piece)}'>{e(piece)}</a>" if piece.startswith("submod_") else e(piece)


def _kernel_link(piece: str, call) -> str:
    if not isinstance(call, int):
        return e(piece)
    return f"<a href='#kernel-{e(piece)}-dyn-{call}'>{e(piece)} #{call}</a>"


def _chains(s: dict, sid: str) -> str:
    if not s["chains"]:
        return f"<p id='{sid}-chains'>No unfused elementwise chains.</p>"
    items = []
    for c in s["chains"]:
        calls = ", ".join(_kernel_link(c["piece"], i) for i in c["calls"])
        what = " → ".join(f"{e(n)} <span class='sub'>({e(f)})</span>" for n, f in zip(c["names"], c["families"]))
        around = f"after {e(c['before'] or 'the piece start')}, before {e(c['after'] or 'the piece end')}"
        items.append(f"<li><b>{c['ms']:.3f} ms</b>, {c['launches']} launch(es) per call: {what} · {around} · "
                     f"{calls}<div class='src'>{'<br>'.join(e(x) for x in c['source'][:3])}</div></li>")
    return (f"<h4 id='{sid}-chains'>Unfused elementwise chains: candidates for the next pass</h4><p class='sub'>"
            "Runs of consecutive elementwise / norm / rope / quant / copy kernels in a piece, each a round trip "
            "through memory; one next to a GEMM could be its epilogue or prologue.</p><ol>" + "".join(items) + "</ol>")


def _kernels(s: dict, sid: str) -> str:
    rows = "".join(
        f"<tr><td>{_kernel_link(k['compiled_as'], k['call'])}</td><td><code>{e(k['name'])}</code>{_launched(k)}</td>"
        f"<td>{e(k['family'])}</td><td>{k['us'] / 1000:.3f}</td><td>{k['count']}</td>"
        f"<td>{e(', '.join(k['nodes'][:5]))}</td><td>{'<br>'.join(e(x) for x in k['source'][:1])}</td></tr>"
        for k in s["kernels"])
    return (f"<h4 id='{sid}-kernels'>Time per kernel call, summed over the call sites</h4><table><tr><th>piece #call"
            "</th><th>kernel / op</th><th>family</th><th>ms</th><th>sites</th><th>FX nodes</th><th>source</th></tr>"
            f"{rows}</table>")


def _launched(k: dict) -> str:
    """The GPU kernels an op launched (cuBLAS, its own Triton kernels), when they are not the call itself."""
    names = [n for n in k["kernels"] if n != k["name"]]
    return f"<br><span class='sub'>{e(', '.join(names[:3]))}</span>" if names else ""


def _sources(s: dict, sid: str) -> str:
    rows = "".join(f"<tr><td>{x['ms']:.3f}</td><td>{e(x['source'])}</td></tr>" for x in s["sources"][:15])
    return (f"<h4 id='{sid}-sources'>Time per source line</h4><table><tr><th>ms</th><th>source</th></tr>{rows}"
            "</table>")
