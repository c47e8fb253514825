"""FP8 W8A8 GEMM with per-token (or per-tensor) activation scales and per-channel (or per-tensor)
weight scales, the matmul of compilelm/layers/quantization/fp8.py's Fp8LinearMethod:

    out[m, n] = T(sum_k x[m, k] * w[n, k] * x_scale[m] * w_scale[n] + bias[n])   (fp32 sum, one rounding)

    x:            fp8 e4m3 [M, K]   quantized by the producer (quant.py: RMSNorm+quant, SiLU-mul+quant, ...)
    x_scale:      fp32, M values ([M, 1]) or one ([1]: static)
    weight:       fp8 e4m3 [N, K]
    weight_scale: fp32, N values ([1, N]: per channel) or one
    bias:         [N] or None;  out: [M, N] in out_dtype

`compilelm::fp8_linear` (schema in csrc/ops.cpp) is the layer's op; on CUDA it picks the kernel by
the row count M of each call, so a compiled graph replayed in a CUDA graph per batch size runs the
kernel of that size:
  - M <= 8 on sm_90 (STREAM_TO_TRITON_ROWS), M <= 16 elsewhere: `compilelm::fp8_stream_mm`
    (csrc/cuda/fp8_stream_mm.cu), the weight
    streamed once with 16-byte loads, fp8 mma.sync on tensor cores, scales in the epilogue;
  - M <= TRITON_MAX_ROWS on sm_90: `fp8_mm_triton` below, TMA loads + wgmma (the weight tile as
    the A operand, x's rows the narrow N extent, as compilelm/ops/hopper_gemm.py), scales and bias
    in the epilogue, launched with programmatic dependent launch; where the weight has too few
    rows to fill the SMs, K is split and a second kernel sums the slices in order;
  - else (prefill), and for layouts the kernels do not take: `torch._scaled_mm` (cuBLASLt, rowwise
    scales), where it takes the call (K and N multiples of 16; off sm_90 a bf16 output only: its
    rowwise path there is CUTLASS's); any other call: the reference (dequantized, fp32).
`set_fp8_routes` moves the two thresholds (benchmarks, A/B). On CPU the op is the reference.

`compilelm::fp8_quant_linear(x, weight, weight_scale, bias, out_dtype)` is quant_fp8_per_token(x)
then fp8_linear, for the linears whose input has no producer to fuse the quant into (o_proj, after
attention; passes/fusion/fuse_quant_linear.py puts it in): on CUDA one fp8_stream_mm launch that
quantizes x in its prologue where it takes the rows (M <= 8, M x K <= 48K elements), else the two
ops. On CPU the two ops (bit-identical to the unfused graph).
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.fx.experimental.symbolic_shapes import statically_known_true

from compilelm.ops.quant import FP8_DTYPE, quant_fp8_per_token_ref

try:
    import triton
    import triton.language as tl
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # CPU builds of torch ship without Triton
    triton = None

STREAM_MAX_ROWS = 16  # fp8_stream_mm's limit (kMaxRows in csrc/cuda/fp8_stream_mm.cu)
# Where the Triton kernel runs (sm_90) and takes the rows, it gets them above this many:
# bench_fp8_gemm on an H200, Llama-3.1-8B's four linears, has the stream kernel ahead at 1-8 rows
# on three of them and the Triton kernel 1.1-1.26x ahead of it on all four at 16 (the stream
# kernel's second 8-row mma tile). Elsewhere the stream kernel keeps its 16.
STREAM_TO_TRITON_ROWS = 8
# its quant prologue's (kMaxQuantRows, kMaxQuantBytes): M x K bytes of quantized rows in dynamic shared
# memory beside the kernel's static arrays, past the default 48 KiB a block gets (the launch raises it)
QUANT_MAX_ROWS, QUANT_MAX_ELEMENTS = 8, 48 * 1024
TRITON_MAX_ROWS = 64  # the Triton kernel's BM is at most 64
_routes = {"stream": STREAM_MAX_ROWS, "triton": TRITON_MAX_ROWS}


def set_fp8_routes(stream_max_rows: int | None = None, triton_max_rows: int | None = None) -> tuple[int, int]:
    """fp8_linear on CUDA: rows 1..stream_max_rows to fp8_stream_mm (where the Triton kernel runs
    and takes them, only up to STREAM_TO_TRITON_ROWS), up to triton_max_rows to the Triton kernel,
    the rest to torch._scaled_mm (0 turns a kernel off). None keeps a setting; returns the previous
    (stream, triton). Takes effect for calls (and graph captures) after it."""
    prev = (_routes["stream"], _routes["triton"])
    if stream_max_rows is not None:
        if not 0 <= stream_max_rows <= STREAM_MAX_ROWS:
            raise ValueError(f"stream_max_rows must be in [0, {STREAM_MAX_ROWS}], got {stream_max_rows}")
        _routes["stream"] = stream_max_rows
    if triton_max_rows is not None:
        if not 0 <= triton_max_rows <= TRITON_MAX_ROWS:
            raise ValueError(f"triton_max_rows must be in [0, {TRITON_MAX_ROWS}], got {triton_max_rows}")
        _routes["triton"] = triton_max_rows
    return prev


def fp8_linear(x: Tensor, x_scale: Tensor, weight: Tensor, weight_scale: Tensor, bias: Tensor | None,
               out_dtype: torch.dtype) -> Tensor:
    # x: fp8 [M, K]; weight: fp8 [N, K] -> [M, N] out_dtype
    return torch.ops.compilelm.fp8_linear.default(x, x_scale, weight, weight_scale, bias, out_dtype)


def fp8_linear_ref(x: Tensor, x_scale: Tensor, weight: Tensor, weight_scale: Tensor, bias: Tensor | None,
                   out_dtype: torch.dtype) -> Tensor:
    """The contract: fp8 values times their scales, summed in fp32, one rounding. The operands are
    scaled before the matmul, as torch's CPU `_scaled_mm` and a dequantized W8A8 model compute it,
    so that the CPU path equals them bit for bit (the kernels scale in their epilogues: equal up
    to fp32 rounding, which a later layer's fp8 quantization may turn into a one-code change)."""
    out = (x.float() * x_scale.float().reshape(-1, 1)) @ (weight.float() * weight_scale.float().reshape(-1, 1)).t()
    if bias is not None:
        out = out + bias.float()
    return out.to(out_dtype)


def _check(x, x_scale, weight, weight_scale, bias, out_dtype, op):
    torch._check(x.dim() == 2 and weight.dim() == 2 and x.shape[1] == weight.shape[1]
                 and x.dtype == FP8_DTYPE and weight.dtype == FP8_DTYPE,
                 lambda: f"{op}: x must be fp8 [M, K] and weight fp8 [N, K], got {tuple(x.shape)} {x.dtype} and "
                         f"{tuple(weight.shape)} {weight.dtype}")
    def one_or(numel, rows):  # (statically: no guard on a symbolic row count)
        return statically_known_true(numel == 1) or statically_known_true(numel == rows)

    torch._check(one_or(x_scale.numel(), x.shape[0]) and one_or(weight_scale.numel(), weight.shape[0])
                 and x_scale.dtype == torch.float32 and weight_scale.dtype == torch.float32,
                 lambda: f"{op}: x_scale must hold {x.shape[0]} or 1 and weight_scale {weight.shape[0]} or 1 "
                         f"float32 values, got {tuple(x_scale.shape)} {x_scale.dtype} and "
                         f"{tuple(weight_scale.shape)} {weight_scale.dtype}")
    torch._check(bias is None or bias.shape == (weight.shape[0],),
                 lambda: f"{op}: bias must be [{weight.shape[0]}], got {tuple(bias.shape)}")


def fp8_quant_linear(x: Tensor, weight: Tensor, weight_scale: Tensor, bias: Tensor | None,
                     out_dtype: torch.dtype) -> Tensor:
    # x: [M, K] bf16 / fp16 / fp32; weight: fp8 [N, K] -> [M, N] out_dtype
    return torch.ops.compilelm.fp8_quant_linear.default(x, weight, weight_scale, bias, out_dtype)


def fp8_quant_linear_ref(x: Tensor, weight: Tensor, weight_scale: Tensor, bias: Tensor | None,
                         out_dtype: torch.dtype) -> Tensor:
    q, x_scale = quant_fp8_per_token_ref(x)
    return fp8_linear_ref(q, x_scale, weight, weight_scale, bias, out_dtype)


def _fake(x, x_scale, weight, weight_scale, bias, out_dtype):
    _check(x, x_scale, weight, weight_scale, bias, out_dtype, "fp8_linear")
    return x.new_empty((x.shape[0], weight.shape[0]), dtype=out_dtype)


def _stream_fake(x, x_scale, weight, weight_scale, bias, out_dtype):
    if x_scale is None:
        return _quant_linear_fake(x, weight, weight_scale, bias, out_dtype)
    return _fake(x, x_scale, weight, weight_scale, bias, out_dtype)


def _quant_linear_fake(x, weight, weight_scale, bias, out_dtype):
    torch._check(x.dim() == 2 and weight.dim() == 2 and x.shape[1] == weight.shape[1] and weight.dtype == FP8_DTYPE
                 and x.dtype in (torch.bfloat16, torch.float16, torch.float32),
                 lambda: f"fp8_quant_linear: x must be bf16 / fp16 / fp32 [M, K] and weight fp8 [N, K], got "
                         f"{tuple(x.shape)} {x.dtype} and {tuple(weight.shape)} {weight.dtype}")
    return _fake(x.new_empty(x.shape, dtype=FP8_DTYPE), x.new_empty((x.shape[0], 1), dtype=torch.float32), weight,
                 weight_scale, bias, out_dtype)


torch.library.register_fake("compilelm::fp8_linear", _fake)
torch.library.register_fake("compilelm::fp8_stream_mm", _stream_fake)
torch.library.register_fake("compilelm::fp8_quant_linear", _quant_linear_fake)


@torch.library.register_kernel("compilelm::fp8_linear", "cpu")
def _(x, x_scale, weight, weight_scale, bias, out_dtype):
    return fp8_linear_ref(x, x_scale, weight, weight_scale, bias, out_dtype)


@torch.library.register_kernel("compilelm::fp8_stream_mm", "cpu")
def _(x, x_scale, weight, weight_scale, bias, out_dtype):
    if x_scale is None:
        return fp8_quant_linear_ref(x, weight, weight_scale, bias, out_dtype)
    return fp8_linear_ref(x, x_scale, weight, weight_scale, bias, out_dtype)


@torch.library.register_kernel("compilelm::fp8_quant_linear", "cpu")
def _(x, weight, weight_scale, bias, out_dtype):  # the unfused ops, bit for bit
    q, x_scale = torch.ops.compilelm.quant_fp8_per_token.default(x)
    return torch.ops.compilelm.fp8_linear.default(q, x_scale, weight, weight_scale, bias, out_dtype)


# -- CUDA: the route --------------------------------------------------------------------------

def _rows_16_byte(t: Tensor) -> bool:
    return t.stride(1) == 1 and t.stride(0) * t.element_size() % 16 == 0 and t.data_ptr() % 16 == 0


def _kernels_take(x: Tensor, weight: Tensor, x_scale: Tensor, weight_scale: Tensor) -> bool:
    """Both kernels: K a multiple of 16, 16-byte aligned contiguous rows, contiguous fp32 scales."""
    return (x.shape[1] % 16 == 0 and x.shape[1] > 0 and _rows_16_byte(x) and _rows_16_byte(weight)
            and x_scale.is_contiguous() and weight_scale.is_contiguous()
            and x_scale.dtype == torch.float32 and weight_scale.dtype == torch.float32)


_stream_kernel: dict[int, bool] = {}  # device index -> fp8_stream_mm runs there (sm_89+ and a CUDA build)
_sm90: dict[int, bool] = {}
_sms: dict[int, int] = {}  # device index -> SM count (fp8_tile_config's split)


def _probe(device: torch.device) -> None:
    if device.index not in _stream_kernel:
        cap = torch.cuda.get_device_capability(device)
        _stream_kernel[device.index] = cap >= (8, 9) and torch._C._dispatch_has_kernel_for_dispatch_key(
            "compilelm::fp8_stream_mm", "CUDA")
        _sm90[device.index] = cap[0] == 9
        _sms[device.index] = torch.cuda.get_device_properties(device).multi_processor_count


def _has_stream_kernel(device: torch.device) -> bool:
    _probe(device)
    return _stream_kernel[device.index]


def _is_sm90(device: torch.device) -> bool:
    _probe(device)
    return _sm90[device.index]


def route(m: int, device: torch.device) -> str:
    """The kernel fp8_linear runs for m rows on this device, for inputs the kernels take:
    'stream', 'triton' or 'scaled_mm'."""
    triton_takes = triton is not None and _is_sm90(device) and 1 <= m <= _routes["triton"]
    if _has_stream_kernel(device) and 1 <= m <= _routes["stream"] and not (triton_takes and m > STREAM_TO_TRITON_ROWS):
        return "stream"
    return "triton" if triton_takes else "scaled_mm"


def scaled_mm_takes(x: Tensor, weight: Tensor, out_dtype: torch.dtype) -> bool:
    """Whether torch._scaled_mm with rowwise scales takes this call (its checks): at least one row, K
    and N multiples of 16, and off sm_90 (no cuBLASLt rowwise path there) a bf16 output."""
    return (x.shape[0] > 0 and x.shape[1] % 16 == 0 and weight.shape[0] % 16 == 0
            and (out_dtype == torch.bfloat16 or _is_sm90(x.device)))


def scaled_mm(x, x_scale, weight, weight_scale, bias, out_dtype):
    """torch._scaled_mm with rowwise scales (a per-tensor scale expanded to its row / column). It
    takes a bias only beside a 16-bit output (of that dtype): an fp32 output gets it added after
    (the reference's fp32 sum + bias, one rounding either way)."""
    m, n = x.shape[0], weight.shape[0]
    xs = x_scale.reshape(-1, 1).float()
    ws = weight_scale.reshape(1, -1).float()
    if xs.shape[0] != m:
        xs = xs.expand(m, 1)
    if ws.shape[1] != n:
        ws = ws.expand(1, n)
    in_epilogue = bias is not None and out_dtype != torch.float32
    out = torch._scaled_mm(x, weight.t(), scale_a=xs.contiguous(), scale_b=ws.contiguous(),
                           bias=bias.to(out_dtype) if in_epilogue else None, out_dtype=out_dtype)
    if bias is not None and not in_epilogue:
        out += bias.float()
    return out


@torch.library.register_kernel("compilelm::fp8_linear", "cuda")
def _(x, x_scale, weight, weight_scale, bias, out_dtype):
    kind = route(x.shape[0], x.device)
    if kind != "scaled_mm" and _kernels_take(x, weight, x_scale, weight_scale) \
            and out_dtype in (torch.bfloat16, torch.float16, torch.float32):
        b = None if bias is None else bias.to(out_dtype).contiguous()
        if kind == "stream":
            return torch.ops.compilelm.fp8_stream_mm.default(x, x_scale, weight, weight_scale, b, out_dtype)
        return fp8_mm_triton(x, x_scale, weight, weight_scale, b, out_dtype)
    if scaled_mm_takes(x, weight, out_dtype):
        return scaled_mm(x, x_scale, weight, weight_scale, bias, out_dtype)
    return fp8_linear_ref(x, x_scale, weight, weight_scale, bias, out_dtype)  # (dequantized)


@torch.library.register_kernel("compilelm::fp8_quant_linear", "cuda")
def _(x, weight, weight_scale, bias, out_dtype):
    m, k = x.shape
    if (1 <= m <= min(QUANT_MAX_ROWS, _routes["stream"]) and m * k <= QUANT_MAX_ELEMENTS
            and _has_stream_kernel(x.device) and k % 16 == 0 and _rows_16_byte(x) and _rows_16_byte(weight)
            and weight_scale.is_contiguous() and weight_scale.dtype == torch.float32
            and out_dtype in (torch.bfloat16, torch.float16, torch.float32)):
        b = None if bias is None else bias.to(out_dtype).contiguous()
        return torch.ops.compilelm.fp8_stream_mm.default(x, None, weight, weight_scale, b, out_dtype)
    q, x_scale = torch.ops.compilelm.quant_fp8_per_token.default(x)
    return torch.ops.compilelm.fp8_linear.default(q, x_scale, weight, weight_scale, bias, out_dtype)


# -- CUDA: the Triton kernel for up to 64 rows ------------------------------------------------

def fp8_tile_config(m: int, n: int, k: int, sms: int = 132) -> tuple[int, int, int, int, int]:
    """(BM, BN, BK, stages, split) for m rows of an [n, k] fp8 weight on a GPU of `sms` SMs. BM: m
    rounded up to 16/32/64 (wgmma's N extent); BN: 64 weight rows (one wgmma M), 128 for wide
    weights (gate_up, LM head) so the grid stays a few waves; BK: 128 bytes, one swizzled TMA row;
    as many stages as 160 KB of shared memory hold (at most 8; the rest of the 227 KB is left to
    the epilogue's layout conversion of the fp32 tile). split: K cut into that many slices where
    the grid would fill at most half the SMs (a 4096-row weight: 64 blocks), so every SM streams
    weight; each slice keeps at least 4 K tiles."""
    bm = max(16, 1 << (m - 1).bit_length())
    bn = 128 if n >= 16384 else 64
    bk = 128
    stages = max(2, min(8, (160 * 1024) // ((bn + bm) * bk)))
    blocks = -(-n // bn)
    split = max(1, min(8, sms // blocks, k // (4 * bk))) if 2 * blocks <= sms else 1
    return bm, bn, bk, stages, split


if triton is not None:

    @triton.jit(do_not_specialize=["M"])
    def fp8_mm_kernel(x_desc, w_desc, xs_ptr, ws_ptr, bias_ptr, y_ptr, part_ptr, M, N, K, K_SPLIT, stride_ym,
                      XS_STRIDE: tl.constexpr, WS_STRIDE: tl.constexpr, HAS_BIAS: tl.constexpr, BM: tl.constexpr,
                      BN: tl.constexpr, BK: tl.constexpr, STAGES: tl.constexpr, SPLIT: tl.constexpr,
                      PDL: tl.constexpr):
        # x_desc: fp8 [M, K] in tiles [BM, BK] (rows past M, columns past K read as zeros);
        # w_desc: fp8 [N, K] in tiles [BN, BK]; the block computes out.T's rows pid * BN ... + BN over
        # K slice program_id(1) (K_SPLIT columns, a multiple of BK). SPLIT > 1: the unscaled fp32 sum
        # goes to part_ptr [SPLIT, M, N] for fp8_split_reduce_kernel.
        pid = tl.program_id(0)
        if PDL:
            tl.extra.cuda.gdc_wait()  # x is the previous kernel's output; out may still be read by it
            tl.extra.cuda.gdc_launch_dependents()
        acc = tl.zeros((BN, BM), tl.float32)
        k_lo = tl.program_id(1) * K_SPLIT
        for k in tl.range(k_lo, tl.minimum(K, k_lo + K_SPLIT), BK, num_stages=STAGES):
            # fp32 promotion after every BK products (Hopper's fp8 wgmma accumulates with fewer bits)
            acc = tl.dot(w_desc.load([pid * BN, k]), x_desc.load([0, k]).T, acc, max_num_imprecise_acc=BK)
        rm = tl.arange(0, BM)
        rn = pid * BN + tl.arange(0, BN)
        mask = (rm[None, :] < M) & (rn[:, None] < N)
        if SPLIT > 1:
            tl.store(part_ptr + (tl.program_id(1) * M + rm[None, :]) * N + rn[:, None], acc, mask=mask)
        else:
            xs = tl.load(xs_ptr + rm * XS_STRIDE, mask=rm < M, other=0.0)
            ws = tl.load(ws_ptr + rn * WS_STRIDE, mask=rn < N, other=0.0)
            out = acc * xs[None, :] * ws[:, None]
            if HAS_BIAS:
                out += tl.load(bias_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[:, None]
            tl.store(y_ptr + rm[None, :] * stride_ym + rn[:, None], out.to(y_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def fp8_split_reduce_kernel(part_ptr, xs_ptr, ws_ptr, bias_ptr, y_ptr, M, N, stride_ym,
                                XS_STRIDE: tl.constexpr, WS_STRIDE: tl.constexpr, HAS_BIAS: tl.constexpr,
                                SPLIT: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
        # out[m, n] = T(sum over the SPLIT partials in order * x_scale[m] * w_scale[n] + bias[n])
        if PDL:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        idx = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        valid = idx < M * N
        acc = tl.load(part_ptr + idx, mask=valid, other=0.0)
        for s in tl.static_range(1, SPLIT):
            acc += tl.load(part_ptr + s * M * N + idx, mask=valid, other=0.0)
        m, n = idx // N, idx % N
        out = acc * tl.load(xs_ptr + m * XS_STRIDE, mask=valid, other=0.0) \
            * tl.load(ws_ptr + n * WS_STRIDE, mask=valid, other=0.0)
        if HAS_BIAS:
            out += tl.load(bias_ptr + n, mask=valid, other=0.0).to(tl.float32)
        tl.store(y_ptr + m * stride_ym + n, out.to(y_ptr.dtype.element_ty), mask=valid)


def fp8_mm_triton(x: Tensor, x_scale: Tensor, weight: Tensor, weight_scale: Tensor, bias: Tensor | None,
                  out_dtype: torch.dtype, pdl: bool | None = None, config=None) -> Tensor:
    """The Triton kernel (x: fp8 [1..64, K], 16-byte aligned rows, K a multiple of 16; contiguous
    scales; bias contiguous [N] or None). pdl: None = compilelm's programmatic-launch setting.
    config: fp8_tile_config's tuple (a 4-tuple: no split)."""
    m, k = x.shape
    n = weight.shape[0]
    torch._check(1 <= m <= TRITON_MAX_ROWS, lambda: f"fp8_mm_triton: 1..{TRITON_MAX_ROWS} rows, got {m}")
    out = torch.empty((m, n), dtype=out_dtype, device=x.device)
    if pdl is None:
        pdl = x.is_cuda and torch.ops.compilelm.programmatic_launch()
    if config is None:
        config = fp8_tile_config(m, n, k, _sm_count(x.device))
    bm, bn, bk, stages, split = (*config, 1)[:5]
    k_split = -(-k // (split * bk)) * bk  # columns of a K slice, a multiple of BK
    split = -(-k // k_split)  # (no empty slice)
    x_desc = TensorDescriptor.from_tensor(x, [bm, bk])
    w_desc = TensorDescriptor.from_tensor(weight, [bn, bk])
    part = torch.empty((split, m, n), dtype=torch.float32, device=x.device) if split > 1 else out
    launch = {"launch_pdl": True} if pdl else {}
    scales = dict(XS_STRIDE=0 if x_scale.numel() == 1 else 1, WS_STRIDE=0 if weight_scale.numel() == 1 else 1,
                  HAS_BIAS=bias is not None)
    b = bias if bias is not None else out
    fp8_mm_kernel[(triton.cdiv(n, bn), split)](
        x_desc, w_desc, x_scale, weight_scale, b, out, part, m, n, k, k_split, out.stride(0), **scales,
        BM=bm, BN=bn, BK=bk, STAGES=stages, SPLIT=split, PDL=pdl,
        num_warps=4 * (bn // 64), **launch)  # a warpgroup per 64 weight rows (the promotion doubles the accumulators)
    if split > 1:
        fp8_split_reduce_kernel[(triton.cdiv(m * n, 1024),)](
            part, x_scale, weight_scale, b, out, m, n, out.stride(0), **scales, SPLIT=split, BLOCK=1024, PDL=pdl,
            num_warps=4, **launch)
    return out


def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 132  # (the interpreter: an H100/H200's count, so the tests take the GPU's tiles)
    _probe(device)
    return _sms[device.index]
