"""Tensor-parallel all-reduce + residual add + RMSNorm -> one op (whole-graph stage).

Under tensor parallelism every row-parallel linear (o_proj, down_proj) ends in an all-reduce,
whose result is added to the residual stream and normalized by the next RMSNorm. Three
memory-bound steps on the same [num_tokens, hidden] tensor become one op, which a GPU can run
as a one-shot all-reduce over peer memory with the add and the norm in its epilogue (on CPU it
is the all-reduce followed by the add+norm: the same numbers as the unfused graph).

    before                                                  after
    ar = compilelm.all_reduce(down_proj_out)                f = compilelm.fused_allreduce_add_rms_norm(
    add = aten.add(ar, residual)                     ==>            down_proj_out, residual, w, eps)
    pow = aten.pow(add, 2); mean = aten.mean(pow, [-1])     normed, add = f[0], f[1]
    rsqrt = aten.rsqrt(aten.add(mean, eps))
    normed = aten.mul(w, aten.mul(add, rsqrt))

It matches twice per decoder layer (input_layernorm after the previous layer's MLP,
post_attention_layernorm after o_proj) minus the first layer's input norm (it follows the
embedding, not an add), plus the final norm. A graph without all-reduces (one rank) is skipped.
In FP8 mode it takes the add+norm that RMSNormQuantFusionPass (post-grad, later) would have
fused with the activation quant; the quant then stays a separate op.
"""

from __future__ import annotations

import torch

from compilelm.ops import collectives
from compilelm.ops.norm import rms_norm
from compilelm.passes.fusion_pass import FusionPass

ops = torch.ops.compilelm
EPS = {"eps": 1e-5}  # traced with this value, matched for any value


def pattern_allreduce_add_rms_norm(x, residual, weight, eps):
    residual = ops.all_reduce.default(x) + residual
    return rms_norm(residual, weight, eps), residual


def replace_allreduce_add_rms_norm(x, residual, weight, eps):
    normed, residual = ops.fused_allreduce_add_rms_norm.default(x, residual, weight, eps)
    return normed, residual


class AllReduceRMSNormFusionPass(FusionPass):
    stage = "whole_graph"

    def register(self):
        with collectives.tracing_patterns():  # the examples are traced on one rank: no collective
            for dtype in (torch.float32, torch.bfloat16, torch.float16):
                x, w = torch.empty(4, 16, dtype=dtype), torch.empty(16, dtype=dtype)
                self.replace(pattern_allreduce_add_rms_norm, replace_allreduce_add_rms_norm, [x, x.clone(), w],
                             scalar_workaround=EPS)

    def applies_to(self, graph: torch.fx.Graph) -> bool:
        return bool(graph.find_nodes(op="call_function", target=ops.all_reduce.default))
