"""SiLU-and-mul + skinny_mm fusion (CUDA, post-grad, per piece): where down_proj streams its
weight through `compilelm.skinny_mm` (SkinnyMMPass, M <= 2 rows), the MLP's activation moves into
the same kernel: each block computes silu(gate) * up of the rows into shared memory, then streams
its weight rows against it (csrc/cuda/skinny_mm.cu). One kernel fewer per layer at batch 1-2, and the activation is no
longer an Inductor kernel between two of ours, so the layer's kernels chain with programmatic
dependent launch end to end.

    before                                                  after
    split = aten.split(x, d, -1)                            y = compilelm.silu_mul_skinny_mm(x, w)
    gate, up = split[0], split[1]                    ==>
    act = aten.mul(aten.silu(gate), up)
    y = compilelm.skinny_mm(act, w)

Only intermediate sizes up to MAX_INTERMEDIATE fuse: every block (4 output columns) recomputes
the K activations, nothing at SmolLM2-135M's 1536, ~15M exps per step at Llama-3.1-8B's 14336
(where RMSNorm's per-block prologue already cost the fused kernel 6%). Only activations that feed
nothing but the linear match. For more rows the op runs the SiLU-and-mul kernel and cuBLAS, as
the unfused graph would.
"""

from __future__ import annotations

import torch

import compilelm.ops  # noqa: F401  (defines the ops the patterns use)
from compilelm.layers.activation import SiluAndMul
from compilelm.passes.skinny_mm import SkinnyMMFusionPass

ops = torch.ops.compilelm
_silu_and_mul = SiluAndMul()  # no parameters: the model's own forward is the pattern
MAX_INTERMEDIATE = 2048  # the largest K (down_proj's input size) that fuses (see above)


def pattern_silu_mul_skinny_mm(x, weight):
    return ops.skinny_mm.default(_silu_and_mul(x), weight)


def replace_silu_mul_skinny_mm(x, weight):
    return ops.silu_mul_skinny_mm.default(x, weight)


class SiluMulSkinnyMMFusionPass(SkinnyMMFusionPass):
    def register(self):
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            x, w = torch.empty(4, 32, dtype=dtype), torch.empty(8, 16, dtype=dtype)
            self.replace(pattern_silu_mul_skinny_mm, replace_silu_mul_skinny_mm, [x, w], extra_check=_applies)


def _applies(match) -> bool:
    """x and the weight share one dtype (the CUDA kernel's contract) and K is one where the fused
    kernel is cheap."""
    x, w = (match.kwargs[k].meta.get("val") for k in ("x", "weight"))
    if not isinstance(x, torch.Tensor) or not isinstance(w, torch.Tensor) or x.dtype != w.dtype:
        return False
    k = w.shape[1]
    return isinstance(k, int) and k <= MAX_INTERMEDIATE
