"""Route a linear layer's matmul through `compilelm::linear`, which streams the weight once
at decode batch sizes (M <= 2 rows) and hands larger M to cuBLAS.

At M = 1 a linear layer is a read of its weight, and cuBLAS's tile choices leave bandwidth unused
on some shapes. The CUDA kernel (csrc/cuda/skinny_mm.cu) puts one warp on each output column and
streams the weight once (against cuBLAS per layer shape: benchmarks/bench_skinny_mm.py;
docs/perf.md, "Weight streaming at 1-2 rows").

    permute: "bf16[4096, 4096]" = aten.permute(w, [1, 0])
    mm: "bf16[s0, 4096]" = aten.mm(x, permute)           ==>   mm: "bf16[s0, 4096]" = compilelm.linear(x, w)

Only CUDA graphs, only weights (graph inputs or constants, 2-D, rows contiguous), and only where
M may be <= 2: the symbolic-size graph (the op picks the kernel per call) and static sizes 1-2.
Elsewhere Inductor sees the same graph as before.
"""

from __future__ import annotations

import torch
from torch.fx.experimental.symbolic_shapes import statically_known_true

import compilelm.ops  # noqa: F401 (defines compilelm::linear)
from compilelm.passes.base import CompilePass
from compilelm.passes.fusion_pass import FusionPass

aten = torch.ops.aten
MAX_ROWS = 2  # as kMaxRows in csrc/cuda/skinny_mm.cu


class RouteLinearPass(CompilePass):
    def applies_to(self, graph: torch.fx.Graph) -> bool:  # (not on CPU graphs)
        return any(_routable(mm) for mm in graph.find_nodes(op="call_function", target=aten.mm.default))

    def run(self, graph: torch.fx.Graph) -> int:
        count = 0
        for mm in graph.find_nodes(op="call_function", target=aten.mm.default):
            weight = _routable(mm)
            if weight is None:
                continue
            x = mm.args[0]
            with graph.inserting_before(mm):
                fused = graph.call_function(torch.ops.compilelm.linear.default, (x, weight))
            fused.meta = dict(mm.meta)
            mm.replace_all_uses_with(fused)
            graph.erase_node(mm)
            count += 1
        return count


class LinearFusionPass(FusionPass):
    """Base of the fusions into linear (they run after RouteLinearPass): graphs without a
    linear node, e.g. every CPU graph, are not even recorded."""

    def applies_to(self, graph: torch.fx.Graph) -> bool:
        return bool(graph.find_nodes(op="call_function", target=torch.ops.compilelm.linear.default))


def _routable(mm: torch.fx.Node) -> torch.fx.Node | None:
    """The weight of `mm` if it goes to linear, else None."""
    x, w_t = mm.args
    weight = _transposed_weight(w_t)
    return weight if weight is not None and _applies(x, weight) else None


def _transposed_weight(node) -> torch.fx.Node | None:
    """w if `node` is permute(w, [1, 0]) or t(w) of a weight w (a graph input or constant), else None."""
    if not isinstance(node, torch.fx.Node) or node.op != "call_function":
        return None
    if (node.target == aten.permute.default and list(node.args[1]) == [1, 0]) or node.target == aten.t.default:
        w = node.args[0]
        return w if isinstance(w, torch.fx.Node) and w.op in ("placeholder", "get_attr") else None
    return None


def _applies(x, weight) -> bool:
    xv, wv = (n.meta.get("val") if isinstance(n, torch.fx.Node) else None for n in (x, weight))
    if not isinstance(xv, torch.Tensor) or not isinstance(wv, torch.Tensor):
        return False
    if xv.device.type != "cuda" or xv.dim() != 2 or wv.dim() != 2 or xv.dtype != wv.dtype:
        return False
    if not statically_known_true(wv.stride(1) == 1):
        return False
    m = xv.shape[0]
    return not isinstance(m, int) or m <= MAX_ROWS
