"""RMSNorm + FP8 quant fusion (post-grad, per piece): the norm's output only feeds the next
linear's activation quant, so norm and quant become one op that reads x once and writes fp8.

In FP8 mode a decoder layer's qkv_proj / gate_up_proj quantize the normed hidden state
(compilelm/layers/quantization/fp8.py). Per token (static: `quant_fp8_static(norm, scale)` -> q):

    before                                                  after
    add = aten.add(x, residual)                             f = compilelm.fused_add_rms_norm_quant_fp8(
    pow = aten.pow(add, 2); mean = aten.mean(pow, [-1])            x, residual, w, eps, None)
    rsqrt = aten.rsqrt(aten.add(mean, eps))          ==>    q, scale, add = f[0], f[1], f[2]
    norm = aten.mul(w, aten.mul(add, rsqrt))
    q, scale = compilelm.quant_fp8_per_token(norm)

and the same without the residual add (the first layer's input norm) ->
`compilelm.rms_norm_quant_fp8(x, w, eps, None)`. The bf16/fp16 variants carry the norm's
fp32 converts; eps is a wildcard (`scalar_workaround`), so any model's epsilon matches.
"""

from __future__ import annotations

import torch

from compilelm.ops.norm import rms_norm
from compilelm.passes.fusion_pass import FusionPass

ops = torch.ops.compilelm
EPS = {"eps": 1e-5}  # traced with this value, matched for any value
QUANT_OPS = (ops.quant_fp8_per_token.default, ops.quant_fp8_static.default)


def has_fp8_quant(graph: torch.fx.Graph) -> bool:
    return any(n.op == "call_function" and n.target in QUANT_OPS for n in graph.nodes)


class Fp8FusionPass(FusionPass):
    """A fusion into fp8 quant ops: a graph without any (an unquantized model) is skipped, so it
    gets no match record and no dump."""

    def applies_to(self, graph: torch.fx.Graph) -> bool:
        return has_fp8_quant(graph)


def pattern_fused_add_rms_norm_quant_per_token(x, residual, weight, eps):
    residual = x + residual
    q, scale = ops.quant_fp8_per_token.default(rms_norm(residual, weight, eps))
    return q, scale, residual


def replace_fused_add_rms_norm_quant_per_token(x, residual, weight, eps):
    q, scale, residual = ops.fused_add_rms_norm_quant_fp8.default(x, residual, weight, eps, None)
    return q, scale, residual


def pattern_fused_add_rms_norm_quant_static(x, residual, weight, scale, eps):
    residual = x + residual
    return ops.quant_fp8_static.default(rms_norm(residual, weight, eps), scale), residual


def replace_fused_add_rms_norm_quant_static(x, residual, weight, scale, eps):
    q, _, residual = ops.fused_add_rms_norm_quant_fp8.default(x, residual, weight, eps, scale)
    return q, residual


def pattern_rms_norm_quant_per_token(x, weight, eps):
    q, scale = ops.quant_fp8_per_token.default(rms_norm(x, weight, eps))
    return q, scale


def replace_rms_norm_quant_per_token(x, weight, eps):
    q, scale = ops.rms_norm_quant_fp8.default(x, weight, eps, None)
    return q, scale


def pattern_rms_norm_quant_static(x, weight, scale, eps):
    return ops.quant_fp8_static.default(rms_norm(x, weight, eps), scale)


def replace_rms_norm_quant_static(x, weight, scale, eps):
    return ops.rms_norm_quant_fp8.default(x, weight, eps, scale)[0]


class RMSNormQuantFusionPass(Fp8FusionPass):
    def register(self):
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            x, w, s = torch.empty(4, 16, dtype=dtype), torch.empty(16, dtype=dtype), torch.empty(1)
            # with-residual patterns first: they contain the plain ones
            self.replace(pattern_fused_add_rms_norm_quant_per_token, replace_fused_add_rms_norm_quant_per_token,
                         [x, x.clone(), w], scalar_workaround=EPS)
            self.replace(pattern_fused_add_rms_norm_quant_static, replace_fused_add_rms_norm_quant_static,
                         [x, x.clone(), w, s], scalar_workaround=EPS)
            self.replace(pattern_rms_norm_quant_per_token, replace_rms_norm_quant_per_token, [x, w],
                         scalar_workaround=EPS)
            self.replace(pattern_rms_norm_quant_static, replace_rms_norm_quant_static, [x, w, s],
                         scalar_workaround=EPS)
