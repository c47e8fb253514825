"""Block-scaled FP8 GEMM (compilelm/ops/fp8_block_gemm.py): the op on CPU (the reference) against
an independent dequantize-per-block computation, the per-token-group activation quant, and the
Triton kernel run by Triton's CPU interpreter against the reference (ragged M, N and K, bias,
several tile shapes). As in test_prefill_attention.py, the interpreted tests run in a child
pytest started with TRITON_INTERPRET=1 (Triton decides at import)."""


import pytest
import torch

import compilelm.ops  # noqa: F401  (registers the ops)
from compilelm.ops.fp8_block_gemm import fp8_block_linear_ref
from compilelm.ops.quant import quant_fp8_per_token_group_ref
from tests.triton_interpreter import INTERPRETED, run_interpreted

FP8 = torch.float8_e4m3fn


def _problem(m, n, k, bn, bk, seed=0, bias=False):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) * torch.logspace(-1, 1, k)  # groups of different ranges
    q, xs = quant_fp8_per_token_group_ref(x, bk)
    w = (torch.randn(n, k, generator=g) * 100).clamp(-448, 448).to(FP8)
    ws = torch.rand(-(-n // bn), -(-k // bk), generator=g) * 0.01 + 1e-3
    b = torch.randn(n, generator=g) if bias else None
    return x, q, xs, w, ws, b


def _by_blocks(q, xs, w, ws, bn, bk, b):
    """sum over K blocks of (q_blk @ w_blk^T) * x_scale * w_scale: the block formula, loop by loop."""
    m, k = q.shape
    n = w.shape[0]
    out = torch.zeros(m, n, dtype=torch.float64)
    for kb in range(-(-k // bk)):
        ks = slice(kb * bk, (kb + 1) * bk)
        part = q[:, ks].double() @ w[:, ks].double().t()
        wsc = ws[:, kb].double().repeat_interleave(bn)[:n]
        out += part * xs[:, kb:kb + 1].double() * wsc[None, :]
    return out if b is None else out + b.double()


if not INTERPRETED:
    def test_group_quant_scales_each_group():
        x, q, xs, *_ = _problem(5, 8, 384, 128, 128)
        assert q.dtype == FP8 and xs.shape == (5, 3)
        got_q, got_s = torch.ops.compilelm.quant_fp8_per_token_group(x, 128)
        assert torch.equal(got_q.view(torch.uint8), q.view(torch.uint8)) and torch.equal(got_s, xs)
        back = q.float() * xs.repeat_interleave(128, 1)
        rel = (back - x).abs().reshape(5, 3, 128).amax(-1) / x.abs().reshape(5, 3, 128).amax(-1)
        assert rel.max() < 2 ** -4  # every group keeps fp8's relative precision, whatever its range
        with pytest.raises(ValueError, match="multiple"):
            torch.ops.compilelm.quant_fp8_per_token_group(x[:, :200], 128)

    @pytest.mark.parametrize("m,n,k,bn,bk,bias", [(7, 256, 384, 128, 128, False), (3, 200, 256, 128, 128, True),
                                                  (9, 96, 64, 32, 32, False)])
    def test_op_matches_the_block_formula(m, n, k, bn, bk, bias):
        _, q, xs, w, ws, b = _problem(m, n, k, bn, bk, bias=bias)
        got = torch.ops.compilelm.fp8_block_linear(q, xs, w, ws, [bn, bk], b, torch.float32)
        want = _by_blocks(q, xs, w, ws, bn, bk, b)
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
        assert torch.ops.compilelm.fp8_block_linear(q, xs, w, ws, [bn, bk], b, torch.bfloat16).dtype == torch.bfloat16

    def test_kernel_under_the_triton_interpreter():
        pytest.importorskip("triton", minversion="3.7")
        run_interpreted(__file__)
else:
    @pytest.mark.parametrize("m,n,k,bn,bk,bias,config", [
        (5, 256, 256, 128, 128, False, (16, 64, 4, 1)),  # decode-like rows
        (37, 200, 384, 128, 128, True, (16, 128, 4, 1)),  # ragged M and N, bias
        (20, 96, 64, 32, 32, False, (16, 32, 4, 1)),  # other block sizes
        (33, 130, 320, 128, 128, False, (32, 64, 4, 1)),  # ragged K (a partial last block) and N
    ])
    def test_triton_kernel_matches_reference(m, n, k, bn, bk, bias, config):
        import triton  # noqa: F401

        from compilelm.ops.fp8_block_gemm import fp8_block_gemm_kernel, fp8_block_gemm_triton
        if k % bk:  # activations padded to whole groups by the caller's quant; the kernel masks K
            x = torch.randn(m, k)
            q, xs = quant_fp8_per_token_group_ref(torch.nn.functional.pad(x, (0, bk - k % bk)), bk)
            q = q[:, :k].contiguous()
            g = torch.Generator().manual_seed(1)
            w = (torch.randn(n, k, generator=g) * 100).clamp(-448, 448).to(FP8)
            ws = torch.rand(-(-n // bn), -(-k // bk), generator=g) * 0.01 + 1e-3
            b = None
        else:
            _, q, xs, w, ws, b = _problem(m, n, k, bn, bk, bias=bias)
        got = fp8_block_gemm_triton(q, xs, w, ws, [bn, bk], b, torch.float32, kernel=fp8_block_gemm_kernel,
                                    config=config)
        want = fp8_block_linear_ref(q, xs, w, ws, [bn, bk], b, torch.float32)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * want.abs().max().item())
