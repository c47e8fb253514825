"""Stitch compiled pieces back together as one plain Python function, and bind its inputs.

`graph_code(top)` turns the split graph into source like

    def graph(a0, a1, a2, ...):
        submod_0 = piece_submod_0(a0, a2, a1)
        getitem = submod_0[0]; ...
        attention = op0(getitem, getitem_1, getitem_2, 'model.layers.0.self_attn.attn')
        del getitem, getitem_1, getitem_2
        ...
        return (submod_8,)

— no nn.Module calls, no FX interpreter, and every intermediate freed after its last use. The
source is stored in the compile cache, so a warm start rebuilds the function without Dynamo.

`input_recipe(dynamo_gm)` says where each graph input comes from at run time (a parameter or
buffer of the model by name, a forward argument, or a size of one), read from Dynamo's input
sources. With it, `entry_function` calls the graph directly: Dynamo is not on the serving path.
"""

from __future__ import annotations

import operator
import re

import torch
from torch._ops import OpOverload

GRAPH_FN = "graph"


def graph_code(top: torch.fx.GraphModule) -> tuple[str, list[str]]:
    """Source of `def graph(...)` and the qualified names of the ops it calls (op0, op1, ...)."""
    nodes = list(top.graph.nodes)
    last_use = {}
    for i, node in enumerate(nodes):
        for inp in node.all_input_nodes:
            last_use[inp] = i
    names, ops, args, body = {}, [], [], []

    def fmt(a):
        if isinstance(a, torch.fx.Node):
            return names[a]
        if isinstance(a, (list, tuple)):
            inner = ", ".join(fmt(x) for x in a)
            return f"[{inner}]" if isinstance(a, list) else f"({inner}{',' if len(a) == 1 else ''})"
        if a is None or isinstance(a, (bool, int, float, str)):
            return repr(a)
        raise NotImplementedError(f"cannot emit constant {a!r} of type {type(a).__name__}")

    for i, node in enumerate(nodes):
        names[node] = f"a{len(args)}" if node.op == "placeholder" else node.name
        if node.op == "placeholder":
            args.append(names[node])
            continue
        if node.op == "output":
            body.append(f"return {fmt(node.args[0])}")
            break
        call_args = ", ".join([fmt(a) for a in node.args] + [f"{k}={fmt(v)}" for k, v in node.kwargs.items()])
        if node.op == "call_module":
            body.append(f"{node.name} = piece_{node.target}({call_args})")
        elif node.target is operator.getitem:
            body.append(f"{node.name} = {fmt(node.args[0])}[{node.args[1]!r}]")
        elif node.op == "call_function" and isinstance(node.target, OpOverload):
            qualname = f"{node.target._schema.name}.{node.target._overloadname}"
            if qualname not in ops:
                ops.append(qualname)
            body.append(f"{node.name} = op{ops.index(qualname)}({call_args})")
        else:
            raise NotImplementedError(f"cannot emit node {node.format_node()}")
        dead = [names[n] for n in node.all_input_nodes if last_use[n] == i]
        if dead:
            body.append(f"del {', '.join(dict.fromkeys(dead))}")
    src = f"def {GRAPH_FN}({', '.join(args)}):\n" + "".join(f"    {line}\n" for line in body)
    return src, ops


def resolve_op(qualname: str) -> OpOverload:
    """"namespace::name.overload" -> torch.ops.namespace.name.overload"""
    ns, rest = qualname.split("::")
    name, overload = rest.rsplit(".", 1)
    return getattr(getattr(getattr(torch.ops, ns), name), overload)


def build_graph(src: str, ops: list[str], pieces: dict) -> callable:
    namespace = {f"op{i}": resolve_op(q) for i, q in enumerate(ops)}
    namespace.update({f"piece_{name}": fn for name, fn in pieces.items()})
    exec(compile(src, "<compilelm-stitched-graph>", "exec"), namespace)
    return namespace[GRAPH_FN]


# -- inputs ---------------------------------------------------------------------------------

_ARG = re.compile(r"^L\['(\w+)'\]$")
_SIZE = re.compile(r"^L\['(\w+)'\]\.size\(\)\[(\d+)\]$")
_ATTR = re.compile(r"\._(?:modules|parameters|buffers)\['([^']+)'\]|\.(\w+)")


def input_recipe(dynamo_gm: torch.fx.GraphModule, arg_names: list[str]) -> list[list] | None:
    """Per graph input: ["arg", name] | ["size", name, dim] | ["tensor", "layers.0.mlp.weight"].
    None when some input has another origin (a global, a forward-context tensor, ...)."""
    recipe = []
    for node in dynamo_gm.graph.nodes:
        if node.op != "placeholder":
            continue
        grapharg = node.meta.get("grapharg")
        source = getattr(grapharg, "source", None)
        if source is None:
            return None
        name = source.name() if callable(source.name) else source.name
        if m := _ARG.match(name):
            entry = ["arg", m[1]] if m[1] in arg_names else None
        elif m := _SIZE.match(name):
            entry = ["size", m[1], int(m[2])] if m[1] in arg_names else None
        elif name.startswith("L['self']"):
            rest = name[len("L['self']"):]
            parts = [a or b for a, b in _ATTR.findall(rest)]
            entry = ["tensor", ".".join(parts)] if "".join(_ATTR.sub("", rest)) == "" and parts else None
        else:
            entry = None
        if entry is None:
            return None
        recipe.append(entry)
    return recipe


def entry_function(graph_fn, recipe: list[list], arg_names: list[str], model: torch.nn.Module):
    """`forward(*arg_names)` calling `graph_fn` (whose only output is the hidden states) with
    the model's tensors bound once, now.

    Tensors are looked up by name here, not per call: load weights before compiling (in-place
    updates such as `load_state_dict` stay visible)."""
    namespace = {GRAPH_FN: graph_fn}
    call = []
    for i, entry in enumerate(recipe):
        if entry[0] == "arg":
            call.append(entry[1])
        elif entry[0] == "size":
            call.append(f"{entry[1]}.shape[{entry[2]}]")
        else:
            namespace[f"t{i}"] = _lookup(model, entry[1])
            call.append(f"t{i}")
    src = f"def forward({', '.join(arg_names)}):\n    return {GRAPH_FN}({', '.join(call)})[0]\n"
    exec(compile(src, "<compilelm-entry>", "exec"), namespace)
    return namespace["forward"]


def _lookup(model: torch.nn.Module, name: str) -> torch.Tensor:
    obj = model
    for part in name.split("."):
        obj = getattr(obj, part)
    if not isinstance(obj, torch.Tensor):
        raise TypeError(f"model.{name} is a {type(obj).__name__}, expected a tensor")
    return obj
