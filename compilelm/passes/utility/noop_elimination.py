"""Remove reshapes and slices that do nothing, so fusion patterns see the ops they expect.

Model code and weight wrappers leave view chains and whole-tensor slices between the ops a
fusion wants to match; Inductor drops some of them itself, but not chains, nor slices whose end
is the symbolic token count. Cases handled (shapes as Inductor prints them):

1. Reshape chain -> one reshape of the original tensor:

       view_1: "f32[s0, 8, 64]" = aten.view(x, [s0, 8, 64])          view_2 = aten.view(x, [s0, 512])
       view_2: "f32[s0, 512]" = aten.view(view_1, [s0, 512])   ==>

2. Reshape to the shape the tensor already has -> the tensor:

       view: "f32[s0, 512]" = aten.view(x, [s0, 512])   # x: "f32[s0, 512]"   ==>   (uses of view read x)

3. Slice covering the whole dimension -> the tensor:

       slice_1: "f32[s0, 512]" = aten.slice(x, 0, 0, s0)   ==>   (uses of slice_1 read x)
       slice_2: "f32[s0, 512]" = aten.slice(x, 1, 0, 9223372036854775807)
"""

from __future__ import annotations

import torch
from torch.fx.experimental.symbolic_shapes import statically_known_true

from compilelm.passes.base import CompilePass

aten = torch.ops.aten
RESHAPES = (aten.view.default, aten.reshape.default, aten._unsafe_view.default)


class NoOpEliminationPass(CompilePass):
    def run(self, graph: torch.fx.Graph) -> int:
        count = 0
        for node in list(graph.nodes):
            if node.op != "call_function":
                continue
            if node.target in RESHAPES:
                src = node.args[0]
                # (1) collapse the chain: reshape the chain's start directly (a view of a
                # contiguous tensor is always valid, whatever shapes the chain went through).
                while _is_reshape(src) and _known_contiguous(src.args[0]):
                    src = src.args[0]
                    count += 1
                if src is not node.args[0]:
                    node.args = (src, *node.args[1:])
                # (2) reshape to the same shape.
                if _same_shape(src, node):
                    node.replace_all_uses_with(src)
                    graph.erase_node(node)
                    count += 1
            elif node.target == aten.slice.Tensor and _is_full_slice(node):
                node.replace_all_uses_with(node.args[0])
                graph.erase_node(node)
                count += 1
        graph.eliminate_dead_code()
        return count


def _is_reshape(node) -> bool:
    return isinstance(node, torch.fx.Node) and node.op == "call_function" and node.target in RESHAPES


def _val(node):
    return node.meta.get("val") if isinstance(node, torch.fx.Node) else None


def _same_shape(a: torch.fx.Node, b: torch.fx.Node) -> bool:
    va, vb = _val(a), _val(b)
    if not isinstance(va, torch.Tensor) or not isinstance(vb, torch.Tensor) or va.dim() != vb.dim():
        return False
    return all(statically_known_true(x == y) for x, y in zip(va.shape, vb.shape))


def _known_contiguous(node) -> bool:
    val = _val(node)
    if not isinstance(val, torch.Tensor):
        return False
    expected = 1
    for size, stride in reversed(list(zip(val.shape, val.stride()))):
        if not statically_known_true(size == 1) and not statically_known_true(stride == expected):
            return False
        expected = expected * size
    return True


def _is_full_slice(node: torch.fx.Node) -> bool:
    # aten.slice.Tensor(Tensor self, int dim=0, SymInt? start=None, SymInt? end=None, SymInt step=1)
    names = ("self", "dim", "start", "end", "step")
    given = dict(zip(names, node.args), **node.kwargs)
    src, dim, start = given["self"], given.get("dim", 0), given.get("start")
    end, step = given.get("end"), given.get("step", 1)
    val = _val(src)
    if not isinstance(val, torch.Tensor) or step != 1 or start not in (None, 0):
        return False
    if end is None or (isinstance(end, int) and end >= 2**62):  # "to the end" (INT64_MAX)
        return True
    size = val.shape[dim]
    if isinstance(end, torch.fx.Node):
        end = _val(end)
    return end is not None and statically_known_true(end >= size)
