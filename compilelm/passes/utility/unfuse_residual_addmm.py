"""Give a residual add back to the Triton kernel next to it, instead of cuBLAS's epilogue.

Inductor's own post-grad patterns rewrite `mm(x, w) + residual` into `addmm(residual, x, w)`
when the sum has a user that is not pointwise (here the next residual add and RMSNorm's
reduction). For a bias row that epilogue is free, but with a 2-D residual on CUDA, `addmm_out`
first copies `residual` into the output buffer (a device-to-device copy kernel) and then runs the
GEMM with beta = 1. A decoder layer has two residual adds, so every layer paid two copy kernels
and their launch gaps (docs/perf.md, "unfuse_residual_addmm"). Un-fused, the add joins the
Triton kernel that computes the following RMSNorm (which reads the sum anyway): two kernels fewer
per layer, and the sum rounds as eager PyTorch rounds it (the GEMM's output in the model dtype, then the add).

    addmm: "bf16[s0, 4096]" = aten.addmm(residual, x, w_t)        mm: "bf16[s0, 4096]" = aten.mm(x, w_t)
                                                            ==>   add: "bf16[s0, 4096]" = aten.add(mm, residual)

Only CUDA graphs are touched (a CPU GEMM keeps what Inductor chose), only with beta = alpha = 1,
and only where `residual` has the output's shape (a broadcast bias keeps its epilogue). It runs
first in the post-grad stage, so the fusions after it see the add.
"""

from __future__ import annotations

import torch
from torch.fx.experimental.symbolic_shapes import statically_known_true

from compilelm.passes.base import CompilePass

aten = torch.ops.aten


class UnfuseResidualAddmmPass(CompilePass):
    def applies_to(self, graph: torch.fx.Graph) -> bool:  # (not on CPU graphs)
        return any(_full_residual(n.args[0], n)
                   for n in graph.find_nodes(op="call_function", target=aten.addmm.default))

    def run(self, graph: torch.fx.Graph) -> int:
        count = 0
        for node in graph.find_nodes(op="call_function", target=aten.addmm.default):
            inp, mat1, mat2 = node.args[:3]
            if node.kwargs.get("beta", 1) != 1 or node.kwargs.get("alpha", 1) != 1 or not _full_residual(inp, node):
                continue
            with graph.inserting_before(node):
                mm = graph.call_function(aten.mm.default, (mat1, mat2))
                add = graph.call_function(aten.add.Tensor, (mm, inp))
            mm.meta["val"] = add.meta["val"] = node.meta["val"]  # same shape, dtype and layout
            for key in ("stack_trace", "nn_module_stack", "source_fn_stack"):
                if key in node.meta:
                    mm.meta[key] = add.meta[key] = node.meta[key]
            node.replace_all_uses_with(add)
            graph.erase_node(node)
            count += 1
        return count


def _full_residual(inp, node: torch.fx.Node) -> bool:
    """`inp` is a CUDA tensor of the output's shape (a residual stream, not a bias row)."""
    a, out = (inp.meta.get("val") if isinstance(inp, torch.fx.Node) else None), node.meta.get("val")
    if not isinstance(a, torch.Tensor) or not isinstance(out, torch.Tensor) or a.device.type != "cuda":
        return False
    return a.dim() == out.dim() and all(statically_known_true(x == y) for x, y in zip(a.shape, out.shape))
