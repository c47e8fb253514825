"""RMSNorm (+ residual add) + linear fusion (CUDA, post-grad, per piece): where a decode
linear streams its weight through `compilelm.linear` (RouteLinearPass, M <= 2 rows), the RMSNorm
that feeds it moves into the same kernel. A decoder layer's two norms feed one linear each
(qkv_proj, gate_up_proj), so every layer runs two kernels fewer at batch 1-2: each block of the
kernel normalizes the rows into shared memory, then streams its weight rows against them
(csrc/cuda/skinny_mm.cu).

    before                                                  after
    add = aten.add(x, residual)                             f = compilelm.fused_add_rms_norm_linear(
    pow = aten.pow(add, 2); mean = aten.mean(pow, [-1])            x, residual, norm_w, eps, w)
    rsqrt = aten.rsqrt(aten.add(mean, eps))          ==>    y, add = f[0], f[1]
    norm = aten.mul(norm_w, aten.mul(add, rsqrt))
    y = compilelm.linear(norm, w)

and without the residual add (the first layer's input norm) -> `compilelm.rms_norm_linear`.
The bf16/fp16 variants carry the norm's fp32 converts; eps matches any value. Only norms whose
output feeds nothing but the linear match (the matcher's rule for a pattern's inner nodes). For
more rows the ops run the norm kernel and cuBLAS, as the unfused graph would.

Only hidden sizes up to MAX_HIDDEN fuse. Each block of the kernel normalizes the rows before it
streams its weight rows: that wins at SmolLM2-135M's 576 and loses at Llama-3.1-8B's 4096, where
every block first reads and normalizes 8 KB and the separate norm kernel stays (docs/perf.md,
"fuse_norm_linear").
"""

from __future__ import annotations

import torch

from compilelm.ops.norm import rms_norm
from compilelm.passes.utility.route_linear import LinearFusionPass

ops = torch.ops.compilelm
EPS = {"eps": 1e-5}  # traced with this value, matched for any value
MAX_HIDDEN = 2048  # the largest K that fuses (see above)


def pattern_fused_add_rms_norm_linear(x, residual, norm_weight, weight, eps):
    residual = x + residual
    return ops.linear.default(rms_norm(residual, norm_weight, eps), weight), residual


def replace_fused_add_rms_norm_linear(x, residual, norm_weight, weight, eps):
    y, residual = ops.fused_add_rms_norm_linear.default(x, residual, norm_weight, eps, weight)
    return y, residual


def pattern_rms_norm_linear(x, norm_weight, weight, eps):
    return ops.linear.default(rms_norm(x, norm_weight, eps), weight)


def replace_rms_norm_linear(x, norm_weight, weight, eps):
    return ops.rms_norm_linear.default(x, norm_weight, eps, weight)


class RMSNormLinearFusionPass(LinearFusionPass):
    def register(self):
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            x, norm_w, w = (torch.empty(4, 16, dtype=dtype), torch.empty(16, dtype=dtype),
                            torch.empty(8, 16, dtype=dtype))
            # with-residual pattern first: it contains the plain one
            self.replace(pattern_fused_add_rms_norm_linear, replace_fused_add_rms_norm_linear,
                         [x, x.clone(), norm_w, w], extra_check=_applies, scalar_workaround=EPS)
            self.replace(pattern_rms_norm_linear, replace_rms_norm_linear, [x, norm_w, w],
                         extra_check=_applies, scalar_workaround=EPS)


def _applies(match) -> bool:
    """x, the norm weight and the linear weight share one dtype (the CUDA kernel's contract), and
    the hidden size is one where the fused kernel wins."""
    vals = [match.kwargs[k].meta.get("val") for k in ("x", "norm_weight", "weight")]
    if not all(isinstance(v, torch.Tensor) for v in vals) or len({v.dtype for v in vals}) != 1:
        return False
    hidden = vals[1].shape[0]
    return isinstance(hidden, int) and hidden <= MAX_HIDDEN
