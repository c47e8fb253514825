"""Block-scaled FP8 GEMM (the matmul of block-wise FP8 checkpoints: Qwen3-*-FP8, DeepSeek):

    out[m, n] = sum_k (q[m, k] * x_scale[m, k // bk]) * (w[n, k] * w_scale[n // bn, k // bk])  (+ bias[n])

    q:       fp8 [M, K]               activations, quantized per 1 x bk group (quant.py)
    x_scale: fp32 [M, K / bk]
    w:       fp8 [N, K]               the checkpoint's weight
    w_scale: fp32 [ceil(N / bn), ceil(K / bk)]   the checkpoint's per-block scales
    out:     out_dtype [M, N]

`compilelm::fp8_block_linear` computes it:
  - CPU: the plain-torch reference (dequantize both operands to fp32, one matmul): CPU has no
    block-scaled FP8 matmul.
  - CUDA, (bn, bk) = (128, 128): `torch._scaled_mm` with BlockWise1x128 x BlockWise128x128 scales
    (cuBLASLt, Hopper only, cuBLASLt >= 12.9), when a probe on the device (first call, outside graph
    capture: `warm_up`) runs and matches the reference; else, and for other block sizes or GPUs:
  - CUDA: `fp8_block_gemm_kernel`, a Triton kernel: one BLOCK_M x BLOCK_N tile a program, K in
    steps of bk, each step an fp8 x fp8 `tl.dot` in fp32 scaled by the step's activation and
    weight scales (Triton lowers it to wgmma on Hopper).
"""

from __future__ import annotations

import torch
from torch import Tensor

from compilelm.ops.library import define

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the reference serves
    triton = None

_scaled_mm_ok: dict[tuple, bool] = {}  # (device index, bn, bk) -> whether the cuBLASLt route works there


def fp8_block_linear_ref(q: Tensor, x_scale: Tensor, weight: Tensor, weight_scale: Tensor,
                         block_size: list[int], bias: Tensor | None, out_dtype: torch.dtype) -> Tensor:
    """Dequantize-then-matmul in fp32 (the contract above)."""
    bn, bk = block_size
    m, k = q.shape
    n = weight.shape[0]
    x = q.float() * x_scale.float().repeat_interleave(bk, dim=1)[:, :k]  # [M, K]
    ws = weight_scale.float().repeat_interleave(bn, dim=0)[:n].repeat_interleave(bk, dim=1)[:, :k]  # [N, K]
    out = x @ (weight.float() * ws).t()
    if bias is not None:
        out = out + bias.float()
    return out.to(out_dtype)


def _fake(q, x_scale, weight, weight_scale, block_size, bias, out_dtype):
    return q.new_empty((q.shape[0], weight.shape[0]), dtype=out_dtype)


@define("fp8_block_linear(Tensor q, Tensor x_scale, Tensor weight, Tensor weight_scale, int[] block_size, "
        "Tensor? bias, ScalarType out_dtype) -> Tensor", _fake)
def fp8_block_linear(q: Tensor, x_scale: Tensor, weight: Tensor, weight_scale: Tensor, block_size: list[int],
                     bias: Tensor | None, out_dtype: torch.dtype) -> Tensor:
    if not q.is_cuda:
        return fp8_block_linear_ref(q, x_scale, weight, weight_scale, block_size, bias, out_dtype)
    if _use_scaled_mm(q.device, block_size):
        return _scaled_mm_block(q, x_scale, weight, weight_scale, bias, out_dtype)
    return fp8_block_gemm_triton(q, x_scale, weight, weight_scale, block_size, bias, out_dtype)


# -- CUDA: torch._scaled_mm's DeepSeek recipe (1x128 activations, 128x128 weights) ------------

def _scaled_mm_block(q, x_scale, weight, weight_scale, bias, out_dtype):
    # scale_a: [M, K/128] outer-dim-major (strides (1, M)); scale_b: [K/128, N/128], the weight's
    # [N/128, K/128] scales transposed (as b = weight.t())
    scale_a = x_scale.t().contiguous().t()
    out = torch._scaled_mm(q, weight.t(), scale_a=scale_a, scale_b=weight_scale.t(), bias=None,
                           out_dtype=out_dtype)
    return out if bias is None else out + bias


def _use_scaled_mm(device: torch.device, block_size) -> bool:
    if tuple(block_size) != (128, 128):
        return False
    key = (device.index, *block_size)
    if key not in _scaled_mm_ok:
        _scaled_mm_ok[key] = _probe_scaled_mm(device)
    return _scaled_mm_ok[key]


def _probe_scaled_mm(device: torch.device) -> bool:
    """Whether torch._scaled_mm takes block scales here and agrees with the reference (torch
    refuses it off Hopper and below cuBLASLt 12.9). Must not run during CUDA graph capture:
    `warm_up` calls it at load."""
    if torch.cuda.is_current_stream_capturing():
        return False
    g = torch.Generator(device=device).manual_seed(0)
    m, n, k = 16, 256, 384
    q = torch.randn(m, k, device=device, generator=g).to(torch.float8_e4m3fn)
    w = torch.randn(n, k, device=device, generator=g).to(torch.float8_e4m3fn)
    xs = torch.rand(m, k // 128, device=device, generator=g) + 0.5
    ws = torch.rand(n // 128, k // 128, device=device, generator=g) + 0.5
    try:
        got = _scaled_mm_block(q, xs, w, ws, None, torch.bfloat16)
    except (RuntimeError, NotImplementedError, ValueError):
        return False
    want = fp8_block_linear_ref(q, xs, w, ws, [128, 128], None, torch.float32)
    return bool(((got.float() - want).abs() <= 0.02 * want.abs().amax() + 1e-3).all())


def warm_up(device: torch.device, block_size) -> None:
    """Settles the CUDA route for this device and block size now (the probe launches kernels,
    which CUDA graph capture would not allow later)."""
    if device.type == "cuda":
        _use_scaled_mm(device, block_size)


def use_scaled_mm(enabled: bool | None) -> None:
    """Forces (True / False) or resets (None: probe again) the cuBLASLt route for every device (tests, A/B)."""
    _scaled_mm_ok.clear()
    if enabled is not None:
        for i in range(max(torch.cuda.device_count(), 1)):
            _scaled_mm_ok[(i, 128, 128)] = enabled


# -- CUDA: the Triton kernel --------------------------------------------------------------------

def fp8_block_gemm_triton(q, x_scale, weight, weight_scale, block_size, bias, out_dtype, kernel=None,
                          config: tuple[int, int, int, int] | None = None):
    """The Triton route of the contract above (`kernel`: the jit function to launch, tests pass
    the interpreter's; config: BLOCK_M, BLOCK_N, warps, stages)."""
    bn, bk = block_size
    m, k = q.shape
    n = weight.shape[0]
    block_m, block_n, warps, stages = config or ((16 if m <= 16 else 64), 128, 4, 3)
    out = torch.empty(m, n, dtype=out_dtype, device=q.device)
    x_scale, weight_scale = x_scale.contiguous(), weight_scale.contiguous()
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    (kernel or fp8_block_gemm_kernel)[grid](
        q, x_scale, weight, weight_scale, bias if bias is not None else out, out, m, n, k,
        q.stride(0), weight.stride(0), out.stride(0), x_scale.stride(0), weight_scale.stride(0),
        BN=bn, BK=bk, HAS_BIAS=bias is not None, BLOCK_M=block_m, BLOCK_N=block_n,
        num_warps=warps, num_stages=stages)
    return out


if triton is not None:
    @triton.jit
    def fp8_block_gemm_kernel(q_ptr, xs_ptr, w_ptr, ws_ptr, bias_ptr, out_ptr, M, N, K,
                              stride_qm, stride_wn, stride_om, stride_xsm, stride_wsn,
                              BN: tl.constexpr, BK: tl.constexpr, HAS_BIAS: tl.constexpr,
                              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, BK)
        mask_m, mask_n = offs_m < M, offs_n < N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for kb in range(0, tl.cdiv(K, BK)):
            kk = kb * BK + offs_k
            a = tl.load(q_ptr + offs_m[:, None] * stride_qm + kk[None, :],
                        mask=mask_m[:, None] & (kk[None, :] < K), other=0.0)  # [BLOCK_M, BK]
            b = tl.load(w_ptr + offs_n[None, :] * stride_wn + kk[:, None],
                        mask=mask_n[None, :] & (kk[:, None] < K), other=0.0)  # [BK, BLOCK_N]
            sa = tl.load(xs_ptr + offs_m * stride_xsm + kb, mask=mask_m, other=0.0)  # [BLOCK_M]
            sb = tl.load(ws_ptr + (offs_n // BN) * stride_wsn + kb, mask=mask_n, other=0.0)  # [BLOCK_N]
            acc += tl.dot(a, b) * sa[:, None] * sb[None, :]
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptr + offs_m[:, None] * stride_om + offs_n[None, :],
                 acc.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])
