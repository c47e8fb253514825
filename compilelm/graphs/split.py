"""Split a whole-model graph at the splitting ops (attention by default): the functional aten
graph before Inductor, and Dynamo's torch-level graph before it is lowered (graphs/lower.py).

Every splitting op gets a submodule of its own (consecutive ones share one; `getitem`s stay with
their producer); everything in between becomes a *piece* that Inductor compiles. For a model of
N attention layers that is N + 1 pieces. `split_module(keep_original_order=True)` keeps the
node order, which matters once ops have side effects (attention writes the KV cache).

The splitting submodules are then inlined back into the top-level graph, so that graph reads as
the program the runtime executes: piece, attention op, piece, attention op, ..., piece.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
from torch._ops import OpOverload, OpOverloadPacket
from torch.fx.passes.split_module import split_module


@dataclass
class Piece:
    name: str  # "submod_<i>", its attribute name in the top-level graph
    gm: torch.fx.GraphModule
    inputs: list  # fake values of the arguments at the call site (tensors, SymInts, constants)
    outputs: list  # fake values of the results


def is_splitting_op(node: torch.fx.Node, splitting_ops: tuple[str, ...]) -> bool:
    if node.op != "call_function":
        return False
    if isinstance(node.target, OpOverloadPacket):  # Dynamo's graph: torch.ops.ns.op(...)
        name, overload = node.target._qualified_op_name, "default"
    elif isinstance(node.target, OpOverload):
        name, overload = node.target._schema.name, node.target._overloadname  # "namespace::op"
    else:
        return False
    return name in splitting_ops or f"{name}.{overload}" in splitting_ops


def split_graph(gm: torch.fx.GraphModule, splitting_ops: tuple[str, ...]) -> tuple[torch.fx.GraphModule, list[Piece]]:
    """Returns the top-level graph (pieces as `call_module`, splitting ops inlined) and the pieces."""
    subgraph: dict[torch.fx.Node, int] = {}
    current, in_split = 0, False
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        if is_splitting_op(node, splitting_ops):
            current += 0 if in_split else 1
            in_split = True
        elif node.target is operator.getitem and is_splitting_op(node.args[0], splitting_ops):
            subgraph[node] = subgraph[node.args[0]]  # stays with its producer
            continue
        elif in_split:
            current, in_split = current + 1, False
        subgraph[node] = current
    split_ids = {subgraph[n] for n in subgraph if is_splitting_op(n, splitting_ops)}

    top = split_module(gm, gm, lambda node: subgraph[node], keep_original_order=True)
    for node in list(top.graph.nodes):
        if node.op == "call_module" and int(node.target.split("_")[-1]) in split_ids:
            _inline(top, node)
    top.graph.lint()
    top.recompile()

    pieces = []
    for node in list(top.graph.nodes):
        if node.op == "call_module":
            sub = getattr(top, node.target)
            out = next(n for n in reversed(sub.graph.nodes) if n.op == "output")
            if not isinstance(out.args[0], (list, tuple)):  # always return a tuple: a compiled
                out.args = ((out.args[0],),)                 # and a loaded artifact then agree
                sub.recompile()
                with top.graph.inserting_after(node):
                    first = top.graph.call_function(operator.getitem, (node, 0))
                node.replace_all_uses_with(first, delete_user_cb=lambda user: user is not first)
            outputs = [_val(a) for a in out.args[0]]
            node.meta["val"] = outputs
            for user in node.users:
                user.meta["val"] = outputs[user.args[1]]
            pieces.append(Piece(node.target, sub, [_val(a) for a in node.args], outputs))
    top.recompile()
    return top, pieces


def _val(a):
    """A node's fake value: "val" in aten graphs, "example_value" in Dynamo's."""
    if not isinstance(a, torch.fx.Node):
        return a
    return a.meta["val"] if "val" in a.meta else a.meta.get("example_value")


def _inline(top: torch.fx.GraphModule, call: torch.fx.Node) -> None:
    """Replace `call` (a call_module) by a copy of the submodule's nodes."""
    sub = getattr(top, call.target)
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    placeholders = [n for n in sub.graph.nodes if n.op == "placeholder"]
    env.update(zip(placeholders, call.args))
    result = None
    with top.graph.inserting_before(call):
        for n in sub.graph.nodes:
            if n.op == "output":
                result = torch.fx.map_arg(n.args[0], lambda a: env[a])
            elif n.op != "placeholder":
                env[n] = top.graph.node_copy(n, lambda a: env[a])
    if isinstance(result, (list, tuple)):
        for user in list(call.users):  # getitem(call, i) -> result[i]
            user.replace_all_uses_with(result[user.args[1]])
            top.graph.erase_node(user)
    else:
        call.replace_all_uses_with(result)
    top.graph.erase_node(call)
    delattr(top, call.target)
