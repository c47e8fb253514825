"""The kernels of one compiled piece, in the order its generated `call` runs them, each with the
FX nodes and source lines it came from (`compile --dump`'s report and `--profile`).

The order and the code come from Inductor's output code: generated kernels (`cpp_fused_*`,
`triton_*_fused_*`), extern kernels (`extern_kernels.mm`) and fallback ops (`torch.ops.ns.op`).
The provenance comes from Inductor's kernel-provenance tracking (on for the dump's compiles),
logged as structured-trace artifacts: `"name:N"` (the N-th kernel call) -> post-grad node
names, and -> the stack traces of those nodes (the model's source lines).
"""

from __future__ import annotations

import json
import re

PROVENANCE_PATCHES = {"trace.provenance_tracking_level": 1}
ARTIFACTS = ("inductor_provenance_tracking_node_mappings", "inductor_provenance_tracking_kernel_stack_traces")

_DEF = re.compile(r"^(\w+) = async_compile\.\w+\(")
_CALL = re.compile(r"^\s+(?:\w+ = )?(extern_kernels\.\w+|torch\.ops\.\w+\.\w+(?:\.\w+)?|\w+)(?:\.run)?\(")
_HANDLE = re.compile(r"#\s*\[Provenance debug handles\]\s*(\S+:\d+)\s*$")  # the next call's provenance key
_FRAME = re.compile(r'File "([^"]+)", line (\d+), in (\w+)\n\s*(.*)')


def kernel_table(code: str, artifacts: dict[str, list[str]] | None = None) -> list[dict]:
    """[{"name", "call": i (1-based, the call's place in the piece), "line" (of the call in the
    output code), "def_line" (of a generated kernel's definition) or None, "nodes", "source"}]."""
    lines = code.splitlines()
    defined = {m[1]: i + 1 for i, line in enumerate(lines) if (m := _DEF.match(line))}
    start = next((i for i, line in enumerate(lines) if line.strip().startswith("def call(")), len(lines))
    calls, handle = [], None
    for i in range(start + 1, len(lines)):
        line = lines[i]
        if line and not line.startswith(" "):
            break  # end of call()
        if h := _HANDLE.search(line):
            handle = h[1]
        m = _CALL.match(line)
        if m and (m[1] in defined or m[1].startswith(("extern_kernels.", "torch.ops."))):
            calls.append({"name": m[1], "call": len(calls) + 1, "line": i + 1, "def_line": defined.get(m[1]),
                          "nodes": [], "source": [], "key": handle})
            handle = None
    _attach_provenance(calls, artifacts or {})
    return calls


def kernel_code(code: str, entry: dict) -> str:
    """The source of a generated kernel (its definition), or the lines of an extern call."""
    lines = code.splitlines()
    if entry.get("def_line"):
        i = entry["def_line"] - 1
        j = next((k for k in range(i + 1, len(lines)) if lines[k].startswith("'''")), len(lines) - 1)
        while i > 0 and lines[i - 1].startswith("#"):  # Inductor's comments above it (source nodes)
            i -= 1
        return "\n".join(lines[i:j + 1])
    i = j = entry["line"] - 1
    while i > 0 and lines[i - 1].strip().startswith("#"):  # its comments: source nodes, provenance
        i -= 1
    return "\n".join(lines[i:j + 1])


def _attach_provenance(calls: list[dict], artifacts: dict[str, list[str]]) -> None:
    nodes = _last_json(artifacts.get(ARTIFACTS[0])).get("cppCodeToPost", {})
    traces = _last_json(artifacts.get(ARTIFACTS[1]))
    by_name: dict[str, list[str]] = {}
    for key in sorted(set(nodes) | set(traces), key=lambda k: int(k.rsplit(":", 1)[1])):
        by_name.setdefault(_provenance_name(key.rsplit(":", 1)[0]), []).append(key)
    seen: dict[str, int] = {}
    for c in calls:  # by the handle Inductor wrote above the call, else the n-th call of that name
        name = _provenance_name(c["name"])
        i = seen[name] = seen.get(name, -1) + 1
        keys = by_name.get(name, [])
        key = c.pop("key") or (keys[i] if i < len(keys) else None)
        if key is not None:
            c["nodes"] = list(nodes.get(key, []))
            c["source"] = list(dict.fromkeys(s for t in traces.get(key, []) if (s := innermost_frame(t))))


def _provenance_name(name: str) -> str:
    """Kernel names as provenance spells them: `torch.ops.compilelm.rope_cache.default` and
    `compilelm.rope_cache` (or `..._default`) are one fallback op."""
    name = name.removeprefix("torch.ops.")
    return re.sub(r"[._]default$", "", name)


def _last_json(payloads: list[str] | None) -> dict:
    for p in reversed(payloads or []):
        try:
            value = json.loads(p)
        except ValueError:
            continue
        if isinstance(value, dict):
            return value
    return {}


def innermost_frame(stack_trace: str, frames: int = 2) -> str | None:
    """The last `frames` frames, outer first: `compilelm/models/llama.py:80 qkv = self.qkv_proj(x)
    › compilelm/layers/linear.py:47 return F.linear(x, self.weight, self.bias)`."""
    found = _FRAME.findall(stack_trace or "")
    if not found:
        return None
    return " › ".join(f"{_short(path)}:{line} {text.strip()}" for path, line, _, text in found[-frames:])


def _short(path: str) -> str:
    return "compilelm/" + path.split("/compilelm/", 1)[1] if "/compilelm/" in path else path.rsplit("/", 1)[-1]
