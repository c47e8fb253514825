"""FP8 quant into the GEMM's prologue (post-grad, per piece): a per-token activation quant whose
outputs feed only one FP8 linear, and which no producer took in (fuse_norm_quant and
fuse_act_quant run first), becomes one op that quantizes x itself.

In a decoder layer that is o_proj: its input is attention's output, a split point, so there is
no producer to fuse the quant into.

    before                                                   after
    f = compilelm.quant_fp8_per_token(x)
    q, scale = f[0], f[1]                             ==>    out = compilelm.fp8_quant_linear(x, w, w_scale,
    out = compilelm.fp8_linear(q, scale, w, w_scale,                                          bias, dtype)
                               bias, dtype)

On CUDA fp8_quant_linear is one fp8_stream_mm launch with its quant prologue at decode row counts
(compilelm/ops/fp8_gemm.py), else the same two ops; on CPU the two ops, bit for bit.
"""

from __future__ import annotations

import operator

import torch

from compilelm.ops import fp8_gemm  # noqa: F401  (defines compilelm::fp8_quant_linear)
from compilelm.passes.base import CompilePass

ops = torch.ops.compilelm


class QuantLinearFusionPass(CompilePass):
    def applies_to(self, graph: torch.fx.Graph) -> bool:  # (graphs without FP8 linears: skipped)
        return bool(graph.find_nodes(op="call_function", target=ops.fp8_linear.default))

    def run(self, graph: torch.fx.Graph) -> int:
        count = 0
        for linear in graph.find_nodes(op="call_function", target=ops.fp8_linear.default):
            quant = _fusable_quant(linear)
            if quant is None:
                continue
            q, scale = linear.args[:2]
            with graph.inserting_before(linear):
                fused = graph.call_function(ops.fp8_quant_linear.default, (quant.args[0], *linear.args[2:]))
            # the result's meta only: Inductor reads a custom op's `eager_input_vals` as its arguments
            fused.meta = {k: v for k, v in linear.meta.items() if k in ("val", "tensor_meta", "stack_trace")}
            linear.replace_all_uses_with(fused)
            for node in (linear, q, scale, quant):
                graph.erase_node(node)
            count += 1
        return count


def _fusable_quant(linear: torch.fx.Node) -> torch.fx.Node | None:
    """The quant_fp8_per_token node whose (q, scale) are `linear`'s x and x_scale and nothing
    else's, else None."""
    q, scale = linear.args[:2]
    if not all(isinstance(n, torch.fx.Node) and n.target is operator.getitem for n in (q, scale)):
        return None
    quant = q.args[0]
    if (quant is not scale.args[0] or quant.target is not ops.quant_fp8_per_token.default
            or (q.args[1], scale.args[1]) != (0, 1)):
        return None
    if set(quant.users) != {q, scale} or set(q.users) != {linear} or set(scale.users) != {linear}:
        return None
    return quant
