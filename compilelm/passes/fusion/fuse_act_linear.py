"""SiLU-and-mul + linear fusion (CUDA, post-grad, per piece): the MLP's activation moves into
the linear on one side of it (RouteLinearPass put the linears there), so it is no longer an
Inductor kernel between two of ours and the layer's kernels chain with programmatic dependent
launch end to end.

Into down_proj, for intermediate sizes up to MAX_INTERMEDIATE (SmolLM2-135M's 1536): each block of
the kernel computes silu(gate) * up of the rows into shared memory, then streams its weight rows
against it (csrc/cuda/skinny_mm.cu); one kernel fewer per layer at batch 1-2.

    before                                                  after
    split = aten.split(x, d, -1)                            y = compilelm.silu_mul_linear(x, w)
    gate, up = split[0], split[1]                    ==>
    act = aten.mul(aten.silu(gate), up)
    y = compilelm.linear(act, w)

Every block recomputes the K activations: nothing at 1536, ~15M exps per step at Llama-3.1-8B's
14336, more than a per-block prologue can hide (docs/perf.md, "fuse_act_linear"). Above that size
the activation goes into gate_up_proj instead, as its epilogue: at 3-64 rows on sm_90 the Triton GEMM
(hopper_mm_out) computes a gate tile and its up tile side by side and stores silu(gate) * up, one
kernel fewer per layer and the [M, 2I] product never written; at 1-2 rows and elsewhere the op
runs linear and the SiLU-and-mul kernel.

    before                                                  after
    gate_up = compilelm.linear(x, w)                     act = compilelm.gate_up_silu_mul(x, w)
    split = aten.split(gate_up, d, -1)               ==>
    gate, up = split[0], split[1]
    act = aten.mul(aten.silu(gate), up)

Only activations that feed nothing but the linear (down side) or products that feed nothing but
the activation (gate_up side) match; a gate_up product that RMSNormLinearFusionPass already took
(hidden size <= 2048, e.g. Qwen3-0.6B's) keeps its activation. Elsewhere the ops run what the
unfused graph would. Measurements: docs/perf.md, "fuse_act_linear".
"""

from __future__ import annotations

import torch

from compilelm.ops.activation import silu_and_mul
from compilelm.ops.gemm import MAX_INTERMEDIATE  # the largest K that fuses into down_proj (see above)
from compilelm.passes.utility.route_linear import LinearFusionPass

ops = torch.ops.compilelm


def pattern_silu_mul_linear(x, weight):
    return ops.linear.default(silu_and_mul(x), weight)


def replace_silu_mul_linear(x, weight):
    return ops.silu_mul_linear.default(x, weight)


def pattern_gate_up_silu_mul(x, weight):
    return silu_and_mul(ops.linear.default(x, weight))


def replace_gate_up_silu_mul(x, weight):
    return ops.gate_up_silu_mul.default(x, weight)


class SiluMulLinearFusionPass(LinearFusionPass):
    def register(self):
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            x, w = torch.empty(4, 32, dtype=dtype), torch.empty(8, 16, dtype=dtype)
            self.replace(pattern_silu_mul_linear, replace_silu_mul_linear, [x, w], extra_check=_into_down)
            x, w = torch.empty(4, 16, dtype=dtype), torch.empty(64, 16, dtype=dtype)
            self.replace(pattern_gate_up_silu_mul, replace_gate_up_silu_mul, [x, w], extra_check=_into_gate_up)


def _weight(match) -> torch.Tensor | None:
    """The linear's weight where x and it share one dtype (the CUDA kernels' contract), else None."""
    x, w = (match.kwargs[k].meta.get("val") for k in ("x", "weight"))
    ok = isinstance(x, torch.Tensor) and isinstance(w, torch.Tensor) and x.dtype == w.dtype
    return w if ok else None


def _into_down(match) -> bool:
    """down_proj's weight [N, I]: I small enough for every block to recompute the activations."""
    w = _weight(match)
    return w is not None and isinstance(w.shape[1], int) and w.shape[1] <= MAX_INTERMEDIATE


def _into_gate_up(match) -> bool:
    """gate_up_proj's weight [2I, K]: I too large for down_proj's fusion."""
    w = _weight(match)
    return w is not None and isinstance(w.shape[0], int) and w.shape[0] // 2 > MAX_INTERMEDIATE
