"""hopper_mm_out: `out = x @ weight.T` for 3-64 rows on Hopper (sm_90), the decode GEMM between
linear's CUDA-core kernel (1-2 rows) and cuBLAS (prefill); with silu_mul, the MLP's gate_up
projection and its SiLU-and-mul in one kernel: `out = silu(x @ gate.T) * (x @ up.T)`, weight =
gate | up ([2I, K]).

At 3-64 rows a linear layer is still a stream over its weight, and cuBLAS's short kernels each
lose their ramp and tail, where fewer blocks stream than the GPU holds. This kernel (Triton: TMA
loads of x and weight tiles into a `STAGES`-deep shared ring, wgmma with the weight tile as the A
operand, so x's rows are the narrow N extent) launches with programmatic dependent launch like
csrc/cuda/launch.cuh's kernels: it waits for the kernel before it (`gdc_wait`) before it reads x
or writes out, then lets the next kernel launch at once, so its blocks are resident while the
previous kernel drains. No split-K, and the weight as the A operand: the tile sweep behind
`tile_config` is in docs/perf.md, "The Hopper GEMM at 3-64 rows".

The SiLU-and-mul epilogue: each block streams BN / 2 gate rows and the BN / 2 up rows that pair
with them (two TMA loads from one descriptor, two accumulators: the same bytes per k step as a
plain BN tile), then rounds both products to the output type and applies SiluAndMul's roundings,
T(T(silu(gate)) * up), before one store of [M, BN / 2]. No silu_and_mul kernel after the GEMM, and
the [M, 2I] product is never written; the fused kernel streams as fast as the plain one.

The RoPE epilogue (hopper_mm_rope_out): a QKV projection, weight rows q | k | v heads, whose blocks
rotate their own output and write it where rope_and_cache would: the rotated query to q_out, the
rotated key and the value to their cache slots; the [M, N] product is never written. RoPE pairs
dimension j of a head with j + D/2, 64 rows apart, so each block reads its weight through a 3-D
TMA view [2 * heads, D / 2, K] in boxes [2, 32, BK]: the 32 pairs j..j+31 of one head, 64 rows.
Triton gives the reshaped box to wgmma from registers (a load from shared memory per k step) and
still streams as fast as the plain kernel; the epilogue rounds as rope_and_cache's kernel does
(bit-identical).

C++ calls this op (csrc/cuda/skinny_mm.cu: `decode_mm`, and gate_up_silu_mul with silu_mul) where its kernel
does not take the rows
and the weight is large enough to gain (N * K >= 8M elements, K >= 1024); `compilelm::set_hopper_gemm(False)`
sends those calls to cuBLAS instead. The op's CUDA kernel is registered here only where Triton
with host tensor descriptors is importable; without it the C++ side uses cuBLAS.
"""

import torch

from compilelm.ops.gemm import gate_up_silu_mul_ref
from compilelm.ops.qkv_rope import qkv_rope_cache_ref

try:
    import triton
    import triton.language as tl
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # CPU builds of torch ship without Triton
    triton = None


@torch.library.register_kernel("compilelm::hopper_mm_out", "cpu")
def _(x, weight, out, pdl, silu_mul=False):
    if silu_mul:
        out.copy_(gate_up_silu_mul_ref(x, weight))
    else:
        torch.mm(x, weight.t(), out=out)


@torch.library.register_fake("compilelm::hopper_mm_out")
def _(x, weight, out, pdl, silu_mul=False):
    return None


@torch.library.register_kernel("compilelm::hopper_mm_rope_out", "cpu")
def _(x, weight, positions, cos_sin_cache, key_cache, value_cache, slot_mapping, q_out, pdl):
    q_out.copy_(qkv_rope_cache_ref(x, weight, positions, cos_sin_cache, key_cache, value_cache, slot_mapping,
                                   q_out.shape[1]))


@torch.library.register_fake("compilelm::hopper_mm_rope_out")
def _(x, weight, positions, cos_sin_cache, key_cache, value_cache, slot_mapping, q_out, pdl):
    return None


ROPE_PAIRS = 32  # rotation pairs per block of the RoPE epilogue: 64 weight rows
PART_ROWS = 64  # row stride of the norm's partial sums of squares (compilelm/ops/norm_gemm.py): rows at most


def tile_config(m: int, n: int, silu_mul: bool = False) -> tuple[int, int, int, int]:
    """(BM, BN, BK, stages) for m rows of a weight with n rows. BM: m rounded up to 16/32/64 (the
    wgmma N extent: x's tile is the B operand, the weight's the A operand, so a few rows waste
    little); the tiles come from a sweep over Llama-3.1-8B's layer shapes (docs/perf.md, "The
    Hopper GEMM at 3-64 rows"). The ring (stages x (BN + BM) x BK x 2 bytes) stays within the
    227 KB of shared memory a block gets.
    silu_mul: BN weight rows = BN / 2 of gate and BN / 2 of up, each half at least a wgmma's 64."""
    bm = max(16, 1 << (m - 1).bit_length())
    if n >= 16384 or silu_mul:  # gate_up, LM head
        return bm, 128, 128, 3 if bm == 64 else 4
    return bm, 64, 128, 4 if n > 4096 else 6


if triton is not None:

    @triton.jit
    def _norm_partials(part_ptr, NP: tl.constexpr, BM: tl.constexpr):
        # the [NP, PART_ROWS = 64] fp32 sums of squares of norm_gemm.py's producer (columns = rows of x)
        return tl.load(part_ptr + tl.arange(0, NP)[:, None] * 64 + tl.arange(0, BM)[None, :])

    @triton.jit
    def _rstd(partials, K, eps):  # [BM]: rms_norm's 1 / sqrt(mean(h^2) + eps) per row
        return tl.rsqrt(tl.sum(partials, axis=0) / K + eps)

    @triton.jit(do_not_specialize=["M"])
    def _hopper_mm_kernel(x_desc, w_desc, y_ptr, M, N, K, stride_ym, part_ptr, eps, BM: tl.constexpr,
                          BN: tl.constexpr, BK: tl.constexpr, STAGES: tl.constexpr, SILU_MUL: tl.constexpr,
                          NP: tl.constexpr):
        # x_desc: [M, K] in tiles [BM, BK] (rows past M read as zeros); w_desc: [N, K] in tiles [BN, BK]
        # (SILU_MUL: [BN / 2, BK], and N = the output's columns I: gate rows [0, I), up rows [I, 2I)).
        # NP > 0: x is an un-normed h with NP partial sums of squares per row at part_ptr; the
        # accumulators are scaled by rms_norm's rstd (the norm weight is folded into w)
        pid = tl.program_id(0)
        tl.extra.cuda.gdc_wait()  # x is the previous kernel's output; out may still be read by it
        tl.extra.cuda.gdc_launch_dependents()
        if NP > 0:
            partials = _norm_partials(part_ptr, NP, BM)  # (loaded here, used after the loop)
        TN: tl.constexpr = BN // 2 if SILU_MUL else BN  # output columns of this block
        acc = tl.zeros((TN, BM), tl.float32)  # out.T tile (SILU_MUL: of the gate product)
        acc_up = tl.zeros((TN if SILU_MUL else 1, BM), tl.float32)
        for k in tl.range(0, K, BK, num_stages=STAGES):
            x = x_desc.load([0, k])  # [BM, BK]
            acc = tl.dot(w_desc.load([pid * TN, k]), x.T, acc)  # w: [TN, BK]
            if SILU_MUL:
                acc_up = tl.dot(w_desc.load([N + pid * TN, k]), x.T, acc_up)
        if NP > 0:
            rstd = _rstd(partials, K, eps)
            acc = acc * rstd[None, :]
            acc_up = acc_up * rstd[None, :]
        out = acc.to(y_ptr.dtype.element_ty)
        if SILU_MUL:  # SiluAndMul's roundings of the rounded products: T(T(silu(gate)) * up)
            gate = out.to(tl.float32)
            out = (gate / (1.0 + tl.exp(-gate))).to(y_ptr.dtype.element_ty)
            out = (out.to(tl.float32) * acc_up.to(y_ptr.dtype.element_ty).to(tl.float32)).to(y_ptr.dtype.element_ty)
        rm = tl.arange(0, BM)
        rn = pid * TN + tl.arange(0, TN)
        tl.store(y_ptr + rm[None, :] * stride_ym + rn[:, None], out, mask=(rm[None, :] < M) & (rn[:, None] < N))

    def hopper_mm_out(x, weight, out, pdl, silu_mul=False, norm=None):
        # x: [M <= 64, K]; weight: [N, K]; out: [M, N] (silu_mul: [M, N / 2]; row stride out.stride(0));
        # bf16/fp16, 16-byte aligned rows (the C++ caller checks). norm (compilelm/ops/norm_gemm.py):
        # (partials [NP, PART_ROWS] fp32, eps): x is an un-normed h, each row's product scaled by its rstd
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
        _hopper_mm_kernel[(triton.cdiv(cols, tn),)](x_desc, w_desc, out, x.shape[0], cols, k, out.stride(0),
                                                    norm[0] if norm else out, norm[1] if norm else 0.0, BM=bm, BN=bn,
                                                    BK=bk, STAGES=stages, SILU_MUL=silu_mul,
                                                    NP=norm[0].shape[0] if norm else 0, num_warps=4, launch_pdl=pdl)

    @triton.jit(do_not_specialize=["M", "num_slots"])
    def _hopper_mm_rope_kernel(x_desc, w_desc, pos_ptr, cs_ptr, slot_ptr, q_ptr, kc_ptr, vc_ptr, M, K, num_slots,
                               part_ptr, eps, NUM_HEADS: tl.constexpr, NUM_KV: tl.constexpr, D: tl.constexpr,
                               BM: tl.constexpr, BK: tl.constexpr, STAGES: tl.constexpr, P: tl.constexpr,
                               NP: tl.constexpr):
        # x_desc: [M, K] in tiles [BM, BK]; w_desc: the weight as [2 * heads, D / 2, K] in boxes [2, P, BK]
        # (heads = NUM_HEADS + 2 * NUM_KV: q | k | v); block b: head b // (D / 2 / P), pairs j = b % (D / 2 / P)
        pid = tl.program_id(0)
        head = pid // (D // 2 // P)
        first = (pid % (D // 2 // P)) * P
        dim = first + tl.arange(0, P)  # [P]: the first dims of the block's pairs
        rm = tl.arange(0, BM)
        # the step's positions, slots and cos/sin (rounded to x's type, as apply_rope): no kernel's output
        pos = tl.load(pos_ptr + rm, mask=rm < M, other=0)
        slot = tl.load(slot_ptr + rm, mask=rm < M, other=-1)
        cs = cs_ptr + pos[None, :] * D + dim[:, None]  # [P, BM]
        cos = tl.load(cs).to(x_desc.dtype).to(tl.float32)
        sin = tl.load(cs + D // 2).to(x_desc.dtype).to(tl.float32)
        tl.extra.cuda.gdc_wait()  # x is the previous kernel's output
        tl.extra.cuda.gdc_launch_dependents()
        if NP > 0:  # as _hopper_mm_kernel's
            partials = _norm_partials(part_ptr, NP, BM)
        acc = tl.zeros((2 * P, BM), tl.float32)  # rows: dims `dim` of the head, then dims `dim` + D/2
        for k in tl.range(0, K, BK, num_stages=STAGES):
            w = w_desc.load([2 * head, first, k]).reshape(2 * P, BK)  # [2P, BK]
            acc = tl.dot(w, x_desc.load([0, k]).T, acc)
        if NP > 0:
            acc = acc * _rstd(partials, K, eps)[None, :]
        out = acc.to(x_desc.dtype).to(tl.float32)  # the projection's rounding
        lo, hi = tl.split(tl.permute(out.reshape(2, P, BM), (1, 2, 0)))  # [P, BM]: dims j, j + D/2
        if head < NUM_HEADS + NUM_KV:  # q or k: rotated in fp32, rounded once (rope_and_cache's kernel)
            lo, hi = lo * cos - hi * sin, hi * cos + lo * sin
        rows = rm[None, :] < M
        if head < NUM_HEADS:
            dst = q_ptr + rm[None, :] * (NUM_HEADS * D) + head * D + dim[:, None]
        else:  # the key or value row of the token's slot; slots outside [0, num_slots) (-1: padding) skip
            rows = rows & (slot[None, :] >= 0) & (slot[None, :] < num_slots)
            at = (slot[None, :] * NUM_KV + (head - NUM_HEADS) % NUM_KV) * D + dim[:, None]
            if head < NUM_HEADS + NUM_KV:
                dst = kc_ptr + at
            else:
                dst = vc_ptr + at
        tl.store(dst, lo.to(x_desc.dtype), mask=rows)
        tl.store(dst + D // 2, hi.to(x_desc.dtype), mask=rows)

    def hopper_mm_rope_out(x, weight, positions, cos_sin_cache, key_cache, value_cache, slot_mapping, q_out, pdl,
                           norm=None):
        # x: [M <= 64, K]; weight: [(H + 2 KVH) * D, K] (q | k | v heads); key_cache, value_cache: contiguous
        # [blocks, block_size, KVH, D]; q_out: [M, H, D] contiguous; D a multiple of 64 (the C++ caller checks)
        m, k = x.shape
        num_kv, d = key_cache.shape[2], key_cache.shape[3]
        heads = q_out.shape[1] + 2 * num_kv
        torch._check(1 <= m <= 64 and d % (2 * ROPE_PAIRS) == 0 and weight.shape == (heads * d, k)
                     and q_out.shape == (m, heads - 2 * num_kv, d) and q_out.is_contiguous()
                     and key_cache.is_contiguous() and value_cache.is_contiguous()
                     and x.dtype == weight.dtype == q_out.dtype == key_cache.dtype
                     and x.dtype in (torch.bfloat16, torch.float16),
                     lambda: f"hopper_mm_rope_out: x [1..64, K], weight [(H + 2 KVH) * D, K], q_out [M, H, D] and "
                             f"contiguous caches [blocks, block_size, KVH, D] (D a multiple of 64), one of bf16/fp16; "
                             f"got {tuple(x.shape)} {x.dtype}, {tuple(weight.shape)}, {tuple(q_out.shape)}, "
                             f"{tuple(key_cache.shape)} {key_cache.dtype}")
        bm, _, bk, stages = tile_config(m, weight.shape[0])  # (a 64-row box: the ring fits at any N)
        x_desc = TensorDescriptor.from_tensor(x, [bm, bk])
        row = weight.stride(0)
        w_desc = TensorDescriptor(weight, [2 * heads, d // 2, k], [d // 2 * row, row, 1], [2, ROPE_PAIRS, bk])
        num_slots = key_cache.shape[0] * key_cache.shape[1]
        _hopper_mm_rope_kernel[(heads * (d // 2 // ROPE_PAIRS),)](
            x_desc, w_desc, positions, cos_sin_cache, slot_mapping, q_out, key_cache, value_cache, m, k, num_slots,
            norm[0] if norm else q_out, norm[1] if norm else 0.0, NUM_HEADS=heads - 2 * num_kv, NUM_KV=num_kv, D=d,
            BM=bm, BK=bk, STAGES=stages, P=ROPE_PAIRS, NP=norm[0].shape[0] if norm else 0, num_warps=4,
            launch_pdl=pdl)

    # (registered, not decorated: compilelm/ops/norm_gemm.py calls them with its `norm` argument)
    torch.library.register_kernel("compilelm::hopper_mm_out", "cuda", hopper_mm_out)
    torch.library.register_kernel("compilelm::hopper_mm_rope_out", "cuda", hopper_mm_rope_out)
