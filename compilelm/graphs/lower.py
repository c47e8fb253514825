"""Lower Dynamo's graph to one functional aten graph of the whole model, tracing each distinct
layer once.

AOTAutograd functionalizes and decomposes a graph op by op under symbolic shapes. On a whole
model that is the slowest step of a cold start, more than Inductor takes (docs/perf.md, "Compile
and warm start"). But the layers are one program run on different weights. So Dynamo's graph is split at the splitting
ops first (graphs/split.py), each *distinct* piece (by `piece_key`: typically the first, a middle
and the last) goes through AOTAutograd once, and the whole-model aten graph is assembled by
copying a piece's aten graph in at each of its call sites, with the splitting ops in between:

    Dynamo graph --split--> 31 pieces (3 distinct) --AOTAutograd x3--> --copy x31--> aten graph

The result is the graph whole-model AOTAutograd gives (the same ops in the same order), ready
for the whole-graph passes (fusions that cross the split) and the split that follows them.

A piece whose trace is not a plain function of its inputs (it mutates an input, or carries
effect tokens), or a model output that aliases an input, cannot be copied in that way:
`lower_to_aten` returns None and the backend runs AOTAutograd on the whole graph instead.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
from torch._dynamo.backends.common import aot_autograd
from torch._functorch.aot_autograd import make_boxed_func
from torch._inductor.decomposition import select_decomp_table
from torch._ops import OpOverloadPacket

from compilelm.graphs.inductor import piece_key
from compilelm.graphs.split import Piece, _val, split_graph


@dataclass
class AtenPiece:
    gm: torch.fx.GraphModule  # the piece after AOTAutograd: functional aten ops
    non_alias: list[bool]  # per output of the piece: a fresh tensor (not a view of an input or another output)


def trace_piece(piece: Piece) -> AtenPiece | None:
    """AOTAutograd (inference, Inductor's decompositions) on one piece; None if the traced
    graph is not a plain function of the piece's inputs."""
    traced: dict = {}

    def capture(gm: torch.fx.GraphModule, example_inputs):
        meta = torch._guards.TracingContext.get().fw_metadata
        mutates = meta.tokens or any(i.mutates_data or i.mutates_metadata for i in meta.input_info)
        if not mutates:  # graph outputs: the piece's outputs, then intermediate bases (unused)
            traced["piece"] = AtenPiece(gm, [o.output_type.name == "non_alias" for o in meta.output_info])
        return make_boxed_func(gm)  # never called

    aot_autograd(fw_compiler=capture, decompositions=select_decomp_table())(piece.gm, piece.inputs)
    return traced.get("piece")


def lower_to_aten(gm: torch.fx.GraphModule, splitting_ops: tuple[str, ...]) -> torch.fx.GraphModule | None:
    """Dynamo's graph (parameters as inputs) -> the whole-model functional aten graph, or None
    (see the module docstring)."""
    top, pieces = split_graph(gm, splitting_ops)
    distinct: dict[str, AtenPiece] = {}
    at_site: dict[str, AtenPiece] = {}
    for piece in pieces:
        key = piece_key(piece)
        if key not in distinct:
            traced = trace_piece(piece)
            if traced is None:
                return None
            distinct[key] = traced
        at_site[piece.name] = distinct[key]

    root, graph = torch.nn.Module(), torch.fx.Graph()
    env: dict[torch.fx.Node, object] = {}
    constants: dict[tuple[int, str], str] = {}
    for node in top.graph.nodes:
        if node.op == "placeholder":
            env[node] = graph.placeholder(node.target)
            env[node].meta = {**node.meta, "val": _val(node)}
        elif node.op == "call_module":
            env[node] = _copy_in(graph, root, constants, at_site[node.target].gm, [env[a] for a in node.args])
        elif node.op == "output":
            if not _fresh_outputs(node, at_site):
                return None
            graph.output(torch.fx.map_arg(node.args[0], lambda a: env[a]))
        elif node.target is operator.getitem and node.args[0].op == "call_module":
            env[node] = env[node.args[0]][node.args[1]]
        else:  # a splitting op, or a getitem of its results
            copied = graph.node_copy(node, lambda a: env[a])
            if isinstance(copied.target, OpOverloadPacket):  # Dynamo calls torch.ops.ns.op(...)
                if copied.target.overloads() != ["default"]:
                    return None
                copied.target = copied.target.default
            copied.meta = {**node.meta, "val": _val(node)}
            env[node] = copied
    return torch.fx.GraphModule(root, graph)


def _copy_in(graph: torch.fx.Graph, root: torch.nn.Module, constants: dict, piece: torch.fx.GraphModule,
             args: list) -> list:
    """Copies the piece's nodes into `graph` with its placeholders bound to `args`; returns the
    nodes of its outputs. Lifted constants (get_attr) become attributes of `root`, once each."""
    env: dict[torch.fx.Node, torch.fx.Node] = dict(zip(piece.graph.find_nodes(op="placeholder"), args))
    for node in piece.graph.find_nodes(op="get_attr"):
        name = constants.setdefault((id(piece), node.target), f"_lowered_constant_{len(constants)}")
        setattr(root, name, getattr(piece, node.target))
        env[node] = graph.get_attr(name)
        env[node].meta = dict(node.meta)
    return list(graph.graph_copy(piece.graph, env))


def _fresh_outputs(output: torch.fx.Node, at_site: dict[str, AtenPiece]) -> bool:
    """Every model output is a fresh tensor made by a piece or a splitting op (so the stitched
    graph can be called without AOTAutograd's aliasing wrappers)."""
    values = output.args[0] if isinstance(output.args[0], (list, tuple)) else [output.args[0]]
    for value in values:
        if not isinstance(value, torch.fx.Node) or value.op == "placeholder":
            return False
        if value.target is operator.getitem and value.args[0].op == "call_module":
            if not at_site[value.args[0].target].non_alias[value.args[1]]:
                return False
    return True
