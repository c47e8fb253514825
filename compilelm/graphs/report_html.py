"""`report.html`: one self-contained page over a `compile --dump` directory (inline CSS and a few
lines of JS, nothing fetched): the pipeline as a picture whose stages link to their files, every
pass with its matches, time, --verify error and a folded side-by-side diff of each graph it
changed, every unique piece with its call sites, op histogram and Inductor kernels (code inline,
linked to the file), load-time rewrites, the cache key factors, and the profile when there is one.

Anchors (stable, for links and tests): #pipeline, #passes, #pass-<stage>-<Pass>, #pieces,
#piece-<piece>, #kernel-<piece>-<size>-<call>, #rewrites, #verify, #cache-key, #profile, #files.
"""

from __future__ import annotations

import html
import json
import os

from compilelm.graphs.kernels import kernel_code
from compilelm.graphs.report_diff import diff_stats, folded_diff
from compilelm.graphs.report_style import SCRIPT, STYLE

e = html.escape


def render(data: dict, root: str, profile_html: str = "") -> str:
    body = [_pipeline(data), _passes(data, root), _pieces(data, root), _rewrites(data), _verify(data),
            profile_html, _times(data), _cache_key(data), _files(root)]
    title = "compilelm compile report"
    head = (f"<p class='sub' id='summary'>mode <b>{e(data['mode'])}</b> · cache key "
            f"<code>{e(data['cache']['key'])}</code> · torch trace for tlparse: "
            f"<code>{e(data.get('tlparse') or '')}</code></p>")
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>{title}</title><style>{STYLE}</style>"
            f"</head><body><h1>{title}</h1>{head}{''.join(body)}<script>{SCRIPT}</script></body></html>\n")


def section(sid: str, title: str, inner: str) -> str:
    return f"<section id='{sid}'><h2>{e(title)}</h2>{inner}</section>"


def _link(href: str, text: str) -> str:
    return f"<a href='{e(href, quote=True)}'>{e(text)}</a>"


def _stage(sid: str, title: str, file: str | None, stats: str, links: list[str]) -> str:
    head = _link(file, title) if file else e(title)
    return (f"<div class='stage' id='stage-{sid}'><div class='st'>{head}</div><div class='ss'>{e(stats)}</div>"
            f"{''.join(f'<div class=sl>{x}</div>' for x in links)}</div>")


def _pipeline(data: dict) -> str:
    t, c = data["times_s"], data["counters"]
    ms = lambda k: f"{t.get(k, 0.0):.2f} s"  # noqa: E731
    passes = lambda stage: [_link(f"#pass-{stage}-{p['pass']}", f"{p['pass']} ({p['matches']})")  # noqa: E731
                            for p in data["passes"] if p["stage"] == stage]
    unique = _unique_pieces(data)
    kernels = sum(len(k) for k in data.get("kernels", {}).values())
    stages = [
        _stage("dynamo", "Dynamo graph", "01_dynamo_graph.py", f"torch-level, traced once · {ms('dynamo')}",
               [_link("06_dynamo_bytecode_decompiled.py", "bytecode (depyf)")]),
        _stage("aten", "aten graph", "02_aten_graph.py", f"AOTAutograd, functional aten · {ms('aot')}", []),
        _stage("whole-graph", "whole-graph passes", "03_after_whole_graph_passes.py",
               f"{ms('whole_graph_passes')}", passes("whole_graph")),
        _stage("split", "split", "04_split_graph.py", f"{c.get('pieces', 0)} pieces at the splitting ops · "
               f"{ms('split')}", [_link("split.md", "split.md")]),
        _stage("pieces", "pieces + post-grad passes", None, f"{len(unique)} unique · {ms('post_grad_passes')}",
               [_link(f"#piece-{p}", f"{p} ×{len(sites)}") for p, sites in unique.items()] + passes("post_grad")),
        _stage("inductor", "Inductor", "inductor/", f"{kernels} kernel calls · {ms('inductor')}",
               [_link(f"#kernels-{p}", f"kernels of {p}") for p in unique]),
        _stage("stitched", "stitched graph", "05_stitched_graph.py", f"total {ms('total')}",
               [_link("#profile", "profile")] if data.get("profile") else []),
    ]
    arrow = "<div class='arrow'>→</div>"
    return section("pipeline", "Pipeline", f"<div class='pipeline'>{arrow.join(stages)}</div>")


def _unique_pieces(data: dict) -> dict[str, list[str]]:
    unique: dict[str, list[str]] = {}
    for p in data["pieces"]:
        unique.setdefault(p["compiled_as"], []).append(p["name"])
    return unique


def _passes(data: dict, root: str) -> str:
    rows, details = [], []
    for p in data["passes"]:
        pid = f"pass-{p['stage']}-{p['pass']}"
        err = "" if p["max_error"] is None else f"{p['max_error']:.3g}"
        rows.append(f"<tr><td>{e(p['stage'])}</td><td>{_link('#' + pid, p['pass'])}</td><td>{p['graphs']}</td>"
                    f"<td>{p['matches']}</td><td>{p['seconds'] * 1000:.2f}</td><td>{err}</td>"
                    f"<td>{e(p['verify_error'] or '')}</td></tr>")
        runs = [r for r in data["pass_runs"] if r["name"] == p["pass"]
                and (r["graph"] == "whole_graph") == (p["stage"] == "whole_graph")]
        parts = [_pass_run(r, root) for r in runs]
        details.append(f"<details id='{pid}'><summary><b>{e(p['pass'])}</b> ({e(p['stage'])}): {p['matches']} "
                       f"matches in {p['graphs']} graphs, {p['seconds'] * 1000:.2f} ms</summary>{''.join(parts)}"
                       "</details>")
    head = ("<tr><th>stage</th><th>pass</th><th>graphs</th><th>matches</th><th>ms</th>"
            "<th>max error (--verify)</th><th>verify note</th></tr>")
    return section("passes", "Passes", f"<table>{head}{''.join(rows)}</table><p class='sub'>Each pass's graph "
                   f"before and after it, folded to what changed:</p>{''.join(details)}")


def _pass_run(r: dict, root: str) -> str:
    stem = f"passes/{r['graph']}/{r['index']:02d}.{r['name']}"
    before, after = _read(root, stem + ".before.py"), _read(root, stem + ".after.py")
    files = f"{_link(stem + '.before.py', 'before')} · {_link(stem + '.after.py', 'after')}"
    err = "" if r.get("max_error") is None else f", --verify max error {r['max_error']:.3g}"
    note = f", <span class='bad'>verify: {e(r['verify_error'])}</span>" if r.get("verify_error") else ""
    head = (f"<div class='run'><b>{e(r['graph'])}</b>: {r['matches']} matches, {r['seconds'] * 1000:.2f} ms"
            f"{err}{note} · {files}")
    if before is None or after is None:
        return head + " (no dump of this graph)</div>"
    table = folded_diff(before, after)
    if not table:
        return head + " · <span class='same'>no change</span></div>"
    removed, added = diff_stats(before, after)
    return f"{head} · <span class='del'>−{removed}</span> <span class='add'>+{added}</span> lines{table}</div>"


def _pieces(data: dict, root: str) -> str:
    out = ["<p class='sub'>Each unique piece is compiled once by Inductor and called at every call site listed "
           "(layers are identical pieces).</p>"]
    by_name = {p["name"]: p for p in data["pieces"]}
    for name, sites in _unique_pieces(data).items():
        p = by_name[name]
        top = max(p["ops"].values(), default=1)
        bars = "".join(f"<tr><td>{e(op)}</td><td>{n}</td><td><div class='bar' style='width:{100 * n / top:.0f}%'>"
                       "</div></td></tr>" for op, n in p["ops"].items())
        out.append(f"<div class='piece' id='piece-{name}'><h3>{e(name)} <span class='sub'>key {e(p['key'][:10])} · "
                   f"{len(sites)} call site{'s' if len(sites) > 1 else ''}</span></h3>"
                   f"<p><b>call sites:</b> {e(', '.join(sites))}</p>"
                   f"<p><b>inputs:</b> {e(', '.join(p['inputs']))}<br><b>outputs:</b> {e(', '.join(p['outputs']))}</p>"
                   f"<table class='hist'><tr><th>op</th><th>count</th><th></th></tr>{bars}</table>"
                   f"{_kernels(data, root, name)}</div>")
    return section("pieces", "Pieces", "".join(out))


def _kernels(data: dict, root: str, piece: str) -> str:
    out = [f"<h4 id='kernels-{piece}'>Inductor kernels</h4>"]
    for tag_name, kernels in data.get("kernels", {}).items():
        if tag_name.rsplit("-", 1)[0] != piece:
            continue
        file = f"inductor/{tag_name}.py"
        code = _read(root, file) or ""
        rows = []
        for k in kernels:
            kid = f"kernel-{tag_name}-{k['call']}"
            src = "<br>".join(e(s) for s in k["source"][:3])
            where = f"{file}, line {k['def_line'] or k['line']}"
            rows.append(f"<details id='{kid}'><summary>{k['call']}. <code>{e(k['name'])}</code> "
                        f"<span class='sub'>{e(', '.join(k['nodes'][:6]))}</span></summary>"
                        f"<div class='src'>{src}</div><pre>{e(kernel_code(code, k))}</pre>"
                        f"{_link(file, where)}</details>")
        out.append(f"<p>{_link(file, file)}: {len(kernels)} kernel calls in order</p>{''.join(rows)}")
    return "".join(out)


def _rewrites(data: dict) -> str:
    items = "".join(f"<li>{e(r)}</li>" for r in data["load_rewrites"]) or "<li>none</li>"
    return section("rewrites", "Load-time rewrites", "<p class='sub'>What the passes' prepare_model did to the "
                   f"model before tracing (and before loading from the cache).</p><ul>{items}</ul>")


def _verify(data: dict) -> str:
    v = data.get("verify") or {}
    if not v.get("requested"):
        return section("verify", "--verify", "<p>not run (add --verify to check every pass numerically)</p>")
    line = (f"{v['checked']} pass runs checked, largest error {v['max_error']:.3g}" if v["checked"]
            else "NOTHING was checked")
    fails = "".join(f"<li class='bad'>{e(f)}</li>" for f in v["failed"])
    return section("verify", "--verify", f"<p>{e(line)}</p><ul>{fails}</ul>")


def _times(data: dict) -> str:
    rows = "".join(f"<tr><td>{e(k)}</td><td>{v:.3f}</td></tr>" for k, v in data["times_s"].items())
    counters = {**data["counters"], **{f"inductor.{k}": v for k, v in data["inductor_counters"].items()}}
    crow = "".join(f"<tr><td>{e(k)}</td><td>{e(str(v))}</td></tr>" for k, v in counters.items())
    return section("times", "Compile times and counters", f"<div class='two'><table><tr><th>stage</th><th>s</th>"
                   f"</tr>{rows}</table><table><tr><th>counter</th><th>value</th></tr>{crow}</table></div>")


def _cache_key(data: dict) -> str:
    rows = "".join(f"<tr><td>{e(k)}</td><td><pre>{e(json.dumps(v, indent=1, sort_keys=True, default=str))}</pre>"
                   "</td></tr>" for k, v in data["cache_key_factors"].items())
    return section("cache-key", "Cache key factors", f"<p class='sub'>key <code>{e(data['cache']['key'])}</code> "
                   f"in {e(data['cache']['dir'])}</p><table>{rows}</table>")


def _files(root: str) -> str:
    files = []
    for d, subdirs, names in os.walk(root):
        subdirs[:] = sorted(s for s in subdirs if s not in ("trace", "tlparse"))
        files += [os.path.relpath(os.path.join(d, n), root) for n in sorted(names)]
    items = "".join(f"<li>{_link(f, f)}</li>" for f in sorted(files) if not f.startswith("report."))
    trace = _link("trace/", "trace/ (TORCH_TRACE)")
    return section("files", "Files", f"<ul class='files'><li>{trace}</li>{items}</ul>")


def _read(root: str, rel: str) -> str | None:
    try:
        with open(os.path.join(root, rel)) as f:
            return f.read()
    except OSError:
        return None
