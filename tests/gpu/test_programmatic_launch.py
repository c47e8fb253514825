"""Programmatic dependent launch (csrc/cuda/launch.cuh): a chain of compilelm kernels, each
reading what the one before wrote (the decode layer's shape: add + norm + linear, linear,
add + norm, norm + linear, and the row norm at M > 2), captured in one CUDA graph with PDL on
and replayed with new inputs, equals the same chain launched eagerly without PDL, bit for bit.
A kernel that read its input before `wait_for_prior_kernels()` would read the previous kernel's
output half-written (the kernels are a few microseconds, so the launches overlap)."""

import pytest
import torch

import compilelm.ops  # noqa: F401  (loads the kernels)

pytestmark = pytest.mark.gpu
ops = torch.ops.compilelm
EPS = 1e-6


def layer_chain(x, residual, weights, norm_weights, layers):
    for i in range(layers):
        w_qkv, w_o = weights[i % 2]
        nw1, nw2 = norm_weights[i % 2]
        h, residual = ops.fused_add_rms_norm_linear(x, residual, nw1, EPS, w_qkv)
        x = ops.linear(h, w_o)
        normed, residual = ops.fused_add_rms_norm(x, residual, nw2, EPS)
        x = ops.rms_norm_linear(normed, nw2, EPS, w_qkv)
        x = ops.linear(x, w_o)
    return x, residual


@pytest.mark.parametrize("rows", [1, 2, 5])
def test_kernel_chain_in_a_graph_with_pdl_equals_eager_without(rows):
    hidden, inner, layers = 576, 1536, 24
    g = torch.Generator().manual_seed(0)

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to("cuda", torch.bfloat16)

    weights = [(rand(inner, hidden, scale=hidden**-0.5), rand(hidden, inner, scale=inner**-0.5)) for _ in range(2)]
    norm_weights = [(rand(hidden).abs() + 0.5, rand(hidden).abs() + 0.5) for _ in range(2)]
    x, residual = rand(rows, hidden), rand(rows, hidden)
    previous = ops.set_programmatic_launch(True)
    try:
        layer_chain(x, residual, weights, norm_weights, layers)  # warm-up outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out, res_out = layer_chain(x, residual, weights, norm_weights, layers)
        ops.set_programmatic_launch(False)
        for step in range(5):
            x.copy_(rand(rows, hidden))
            residual.copy_(rand(rows, hidden))
            graph.replay()
            want, want_res = layer_chain(x, residual, weights, norm_weights, layers)
            torch.cuda.synchronize()
            assert torch.equal(out, want), f"step {step}: {(out.float() - want.float()).abs().max().item()}"
            assert torch.equal(res_out, want_res)
    finally:
        ops.set_programmatic_launch(previous)

