"""SiLU-and-mul + FP8 quant fusion (post-grad, per piece): the MLP's activation output only
feeds down_proj's activation quant, so both become one op that writes fp8 directly.

    before                                                   after
    split = aten.split(x, d, -1)                             f = compilelm.silu_mul_quant_fp8(x, None)
    gate, up = split[0], split[1]                     ==>    q, scale = f[0], f[1]
    act = aten.mul(aten.silu(gate), up)
    q, scale = compilelm.quant_fp8_per_token(act)

Static: `quant_fp8_static(act, scale)` -> `silu_mul_quant_fp8(x, scale)[0]`.
"""

from __future__ import annotations

import torch

from compilelm.ops.activation import silu_and_mul
from compilelm.passes.fusion.fuse_norm_quant import Fp8FusionPass

ops = torch.ops.compilelm


def pattern_silu_mul_quant_per_token(x):
    q, scale = ops.quant_fp8_per_token.default(silu_and_mul(x))
    return q, scale


def replace_silu_mul_quant_per_token(x):
    q, scale = ops.silu_mul_quant_fp8.default(x, None)
    return q, scale


def pattern_silu_mul_quant_static(x, scale):
    return ops.quant_fp8_static.default(silu_and_mul(x), scale)


def replace_silu_mul_quant_static(x, scale):
    return ops.silu_mul_quant_fp8.default(x, scale)[0]


class SiluMulQuantFusionPass(Fp8FusionPass):
    def register(self):
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            x, s = torch.empty(4, 32, dtype=dtype), torch.empty(1)
            self.replace(pattern_silu_mul_quant_per_token, replace_silu_mul_quant_per_token, [x])
            self.replace(pattern_silu_mul_quant_static, replace_silu_mul_quant_static, [x, s])
