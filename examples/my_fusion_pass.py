"""A custom fusion pass in one file: the walk-through of docs/writing_a_pass.md.

RMSNorm computes `x.pow(2).mean(-1, keepdim=True)`; this pass rewrites that pair of aten ops to
one op, `examples::mean_square` (a stand-in for the kernel a researcher would write). Run it:

    python examples/my_fusion_pass.py          # toy module: matches, op counts, error vs eager

and on a real model (the report lists the pass and its matches: two RMSNorms per layer + final):

    PYTHONPATH=. compilelm compile dummy:smollm2-135m --pass examples.my_fusion_pass:MeanSquareFusionPass \\
        --dump /tmp/dump --verify
"""

from __future__ import annotations

import torch

from compilelm.passes import FusionPass


# 1. The op the pattern becomes: functional (returns a new tensor), with a fake impl for tracing.
@torch.library.custom_op("examples::mean_square", mutates_args=())
def mean_square(x: torch.Tensor) -> torch.Tensor:
    # x: [num_tokens, ..., hidden] -> [num_tokens, ..., 1]
    return (x * x).mean(-1, keepdim=True)


@mean_square.register_fake
def _(x):
    return x.new_empty(*x.shape[:-1], 1)


# 2. What to find and what to put instead: same signature, traced to aten ops.
def pattern_mean_square(x):
    return x.pow(2).mean(-1, keepdim=True)


def replace_mean_square(x):
    return torch.ops.examples.mean_square(x)


# 3. The pass: register the pair (example inputs: only rank, dtype and device matter).
class MeanSquareFusionPass(FusionPass):
    stage = "post_grad"  # or "whole_graph" (before the split, e.g. to span attention)

    def register(self) -> None:
        self.replace(pattern_mean_square, replace_mean_square, [torch.empty(8, 16)])


# 4. Test it on a toy module: match count, op counts before/after, numerics vs eager.
class ToyNorm(torch.nn.Module):
    def __init__(self, hidden: int = 64):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.rand(hidden) + 0.5)

    def forward(self, x):
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


def main() -> None:
    from compilelm.passes.debug.testing import check_pass

    p = MeanSquareFusionPass()
    result = check_pass(ToyNorm(), [torch.randn(5, 64)], [p], matches={p.name: 2},
                        ops_before={"aten.pow.Tensor_Scalar": 2, "aten.mean.dim": 2},
                        ops_after={"aten.pow.Tensor_Scalar": 0, "aten.mean.dim": 0, "examples.mean_square.default": 2})
    print(f"{p.name}: {result.matches[p.name]} matches, max error vs eager {result.max_error:.2e}")
    print(result.graph.code)


if __name__ == "__main__":
    main()
