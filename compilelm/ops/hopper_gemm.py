"""hopper_mm_out: `out = x @ weight.T` for 3-64 rows on Hopper (sm_90), the decode GEMM between
skinny_mm's CUDA-core kernel (1-2 rows) and cuBLAS (prefill); with silu_mul, the MLP's gate_up
projection and its SiLU-and-mul in one kernel: `out = silu(x @ gate.T) * (x @ up.T)`, weight =
gate | up ([2I, K]).

At 3-64 rows a linear layer is still a stream over its weight. cuBLAS reaches ~2.2-2.7 TB/s on
Llama-3.1-8B's layers at M = 64 on an H100 (read-only streaming reaches ~3.1): its kernels are
short (15-90 us), and each loses its ramp and tail, where fewer blocks stream than the GPU holds.
This kernel (Triton: TMA loads of x and weight tiles into a `STAGES`-deep shared ring, wgmma with
the weight tile as the A operand, so x's rows are the narrow N extent) launches with programmatic
dependent launch like csrc/cuda/launch.cuh's kernels: it waits for the kernel before it
(`gdc_wait`) before it reads x or writes out, then lets the next kernel launch at once, so its
blocks are resident while the previous kernel drains. Tiles were chosen on an H100 over
BN 32/64/128 x stages 3/4/6 x BM 16/32/64 x split-K 1-8 x both operand orders, at M = 3..64
(benchmarks/results/hopper_gemm_gpu.log): split-K never won; x as the A operand (BM = 64 rows
always) lost up to 50% at M <= 32.

The SiLU-and-mul epilogue: each block streams BN / 2 gate rows and the BN / 2 up rows that pair
with them (two TMA loads from one descriptor, two accumulators: the same bytes per k step as a
plain BN tile), then rounds both products to the output type and applies SiluAndMul's roundings,
T(T(silu(gate)) * up), before one store of [M, BN / 2]. No silu_and_mul kernel after the GEMM, and
the [M, 2I] product is never written. On an H100 (Llama-3.1-8B's gate_up, L2 cold) the fused kernel
takes as long as the plain GEMM: 80.8 us at M = 16, 84.2 us at M = 64, ~2.8-2.9 TB/s; neither 8
warps nor BK 64 nor other stage counts did better (results/hopper_silu_epilogue_sweep_543296e.json).

C++ calls this op (csrc/cuda/skinny_mm.cu: `decode_mm`, and skinny_mm_silu_mul with silu_mul) where its kernel does not take the rows
and the weight is large enough to gain (N * K >= 8M elements, K >= 1024); `compilelm::set_hopper_gemm(False)`
sends those calls to cuBLAS instead. The op's CUDA kernel is registered here only where Triton
with host tensor descriptors is importable; without it the C++ side uses cuBLAS.
"""

import torch

from compilelm.ops.linear import skinny_mm_silu_mul_ref

try:
    import triton
    import triton.language as tl
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # CPU builds of torch ship without Triton
    triton = None


@torch.library.register_kernel("compilelm::hopper_mm_out", "cpu")
def _(x, weight, out, pdl, silu_mul=False):
    if silu_mul:
        out.copy_(skinny_mm_silu_mul_ref(x, weight))
    else:
        torch.mm(x, weight.t(), out=out)


@torch.library.register_fake("compilelm::hopper_mm_out")
def _(x, weight, out, pdl, silu_mul=False):
    return None


def tile_config(m: int, n: int, silu_mul: bool = False) -> tuple[int, int, int, int]:
    """(BM, BN, BK, stages) for m rows of a weight with n rows. BM: m rounded up to 16/32/64 (the
    wgmma N extent: x's tile is the B operand, the weight's the A operand, so a few rows waste
    little). Best or within 1.5% on every Llama-3.1-8B layer shape at m = 3..64 on an H100. The
    ring (stages x (BN + BM) x BK x 2 bytes) stays within the 227 KB of shared memory a block gets.
    silu_mul: BN weight rows = BN / 2 of gate and BN / 2 of up, each half at least a wgmma's 64."""
    bm = max(16, 1 << (m - 1).bit_length())
    if n >= 16384 or silu_mul:  # gate_up, LM head
        return bm, 128, 128, 3 if bm == 64 else 4
    return bm, 64, 128, 4 if n > 4096 else 6


if triton is not None:

    @triton.jit(do_not_specialize=["M"])
    def _hopper_mm_kernel(x_desc, w_desc, y_ptr, M, N, K, stride_ym, BM: tl.constexpr, BN: tl.constexpr,
                          BK: tl.constexpr, STAGES: tl.constexpr, SILU_MUL: tl.constexpr):
        # x_desc: [M, K] in tiles [BM, BK] (rows past M read as zeros); w_desc: [N, K] in tiles [BN, BK]
        # (SILU_MUL: [BN / 2, BK], and N = the output's columns I: gate rows [0, I), up rows [I, 2I))
        pid = tl.program_id(0)
        tl.extra.cuda.gdc_wait()  # x is the previous kernel's output; out may still be read by it
        tl.extra.cuda.gdc_launch_dependents()
        TN: tl.constexpr = BN // 2 if SILU_MUL else BN  # output columns of this block
        acc = tl.zeros((TN, BM), tl.float32)  # out.T tile (SILU_MUL: of the gate product)
        acc_up = tl.zeros((TN if SILU_MUL else 1, BM), tl.float32)
        for k in tl.range(0, K, BK, num_stages=STAGES):
            x = x_desc.load([0, k])  # [BM, BK]
            acc = tl.dot(w_desc.load([pid * TN, k]), x.T, acc)  # w: [TN, BK]
            if SILU_MUL:
                acc_up = tl.dot(w_desc.load([N + pid * TN, k]), x.T, acc_up)
        out = acc.to(y_ptr.dtype.element_ty)
        if SILU_MUL:  # SiluAndMul's roundings of the rounded products: T(T(silu(gate)) * up)
            gate = out.to(tl.float32)
            out = (gate / (1.0 + tl.exp(-gate))).to(y_ptr.dtype.element_ty)
            out = (out.to(tl.float32) * acc_up.to(y_ptr.dtype.element_ty).to(tl.float32)).to(y_ptr.dtype.element_ty)
        rm = tl.arange(0, BM)
        rn = pid * TN + tl.arange(0, TN)
        tl.store(y_ptr + rm[None, :] * stride_ym + rn[:, None], out, mask=(rm[None, :] < M) & (rn[:, None] < N))

    @torch.library.register_kernel("compilelm::hopper_mm_out", "cuda")
    def _(x, weight, out, pdl, silu_mul=False):
        # x: [M <= 64, K]; weight: [N, K]; out: [M, N] (silu_mul: [M, N / 2]; row stride out.stride(0));
        # bf16/fp16, 16-byte aligned rows (the C++ caller checks)
        n, k = weight.shape
        cols = n // 2 if silu_mul else n
        torch._check(1 <= x.shape[0] <= 64 and x.shape[1] == k and out.shape == (x.shape[0], cols)
                     and (not silu_mul or n % 2 == 0)
                     and x.dtype == weight.dtype == out.dtype and x.dtype in (torch.bfloat16, torch.float16),
                     lambda: f"hopper_mm_out: x [1..64, K], weight [N, K] and out [M, N] ([M, N / 2] with silu_mul, "
                             f"N even), one of bf16/fp16, got {tuple(x.shape)} {x.dtype}, {tuple(weight.shape)} "
                             f"{weight.dtype}, {tuple(out.shape)} {out.dtype}")
        bm, bn, bk, stages = tile_config(x.shape[0], n, silu_mul)
        tn = bn // 2 if silu_mul else bn  # output columns of a block: the weight rows of one tile load
        x_desc = TensorDescriptor.from_tensor(x, [bm, bk])
        w_desc = TensorDescriptor.from_tensor(weight, [tn, bk])
        _hopper_mm_kernel[(triton.cdiv(cols, tn),)](x_desc, w_desc, out, x.shape[0], cols, k, out.stride(0), BM=bm,
                                                    BN=bn, BK=bk, STAGES=stages, SILU_MUL=silu_mul, num_warps=4,
                                                    launch_pdl=pdl)
