"""The RMSNorm between two decode GEMMs, inside them: o_proj -> add -> RMSNorm -> gate_up_proj (+
SiLU-and-mul), and down_proj -> add -> RMSNorm -> the next layer's QKV projection (+ RoPE and the
KV-cache write). At 3-64 rows on sm_90 that is two kernels where the graph ran three:

    producer  h = T(T(x @ w.T) + residual), and each row's sum of squares of h over each block of
              64 columns (partials [N / 64, 64] fp32)
    consumer  hopper_gemm.py's kernel on h against w2, whose accumulators it scales by rms_norm's
              rstd = rsqrt(sum(partials) / N + eps) before rounding

The norm has no weight here: passes.fuse_norm_gemm (prepare_model) folds it into w2 at load, where these
ops will take the layer. Where they don't take the call (1-2 or more than 64 rows, other GPUs,
shapes the kernels don't take, `set_hopper_gemm(False)`) they run what the graph ran before them:
linear, the fused add + RMSNorm kernel, then the second projection.

    linear_add_rms_norm_gate_up_silu_mul(x, w, residual, eps, w2) -> (silu_and_mul(rms_norm(h) @ w2.T), h)
    linear_add_rms_norm_qkv_rope_cache(x, w, residual, eps, w2, positions, cos_sin_cache, key_cache,
                            value_cache, slot_mapping, num_heads) -> (rotated query, h)

Rounding: the reference (the CPU kernels) rounds h * rstd to the input type before the second
GEMM, as the unfused graph; the fast path scales the fp32 product instead and rounds once, so its
outputs differ from the reference in the last bit of some elements. The reference's roundings
would need each h tile normalized in registers before the wgmma, or a grid barrier in the
producer, and both cost more than the fusion saves (docs/perf.md, "fuse_norm_gemm").
"""

import functools

import torch

from compilelm.ops.gemm import gate_up_silu_mul_ref, linear_ref
from compilelm.ops.library import LIB, define
from compilelm.ops.norm import rms_norm
from compilelm.ops.qkv_rope import (
    next_cache_args,
    next_cache_is_fp8,
    qkv_rope_cache_ref,
    qkv_rope_fake,
    rope_into_next_cache,
)

try:
    import triton
    import triton.language as tl
    from triton.tools.tensor_descriptor import TensorDescriptor

    from compilelm.ops.hopper_gemm import PART_ROWS, hopper_mm_out, hopper_mm_rope_out, tile_config
except ImportError:  # CPU builds of torch ship without Triton
    triton = None

ops = torch.ops.compilelm
LIB.define("linear_add_rms_norm_gate_up_silu_mul(Tensor x, Tensor weight, Tensor residual, float eps, Tensor weight2) "
            "-> (Tensor, Tensor)")
LIB.define("linear_add_rms_norm_qkv_rope_cache(Tensor x, Tensor weight, Tensor residual, float eps, Tensor weight2, "
            "Tensor positions, Tensor cos_sin_cache, Tensor(a!) key_cache, Tensor(b!) value_cache, "
            "Tensor slot_mapping, int num_heads) -> (Tensor, Tensor)")
MIN_WEIGHT = 8 << 20  # elements: as the C++ router's, for both weights (hopper_gemm.py)


def _check(x, weight, residual, weight2, op):
    torch._check(x.dim() == 2 and weight.dim() == 2 and weight2.dim() == 2 and x.shape[1] == weight.shape[1]
                 and residual.shape == (x.shape[0], weight.shape[0]) and weight2.shape[1] == weight.shape[0],
                 lambda: f"{op}: x [M, K], weight [N, K], residual [M, N] and weight2 [N2, N], got {tuple(x.shape)}, "
                         f"{tuple(weight.shape)}, {tuple(residual.shape)} and {tuple(weight2.shape)}")


def linear_add_rms_norm_ref(x, weight, residual, eps):
    # -> (rms_norm(h) without a weight, h = x @ weight.T + residual)
    h = linear_ref(x, weight) + residual
    return rms_norm(h, None, eps), h


def linear_add_rms_norm_gate_up_silu_mul_ref(x, weight, residual, eps, weight2):
    _check(x, weight, residual, weight2, "linear_add_rms_norm_gate_up_silu_mul")
    normed, h = linear_add_rms_norm_ref(x, weight, residual, eps)
    return gate_up_silu_mul_ref(normed, weight2), h


def linear_add_rms_norm_qkv_rope_cache_ref(x, weight, residual, eps, weight2, positions, cos_sin_cache,
                                           key_cache, value_cache, slot_mapping, num_heads):
    _check(x, weight, residual, weight2, "linear_add_rms_norm_qkv_rope_cache")
    normed, h = linear_add_rms_norm_ref(x, weight, residual, eps)
    return qkv_rope_cache_ref(normed, weight2, positions, cos_sin_cache, key_cache, value_cache, slot_mapping,
                              num_heads), h


torch.library.register_kernel("compilelm::linear_add_rms_norm_gate_up_silu_mul", "cpu",
                              linear_add_rms_norm_gate_up_silu_mul_ref)
torch.library.register_kernel("compilelm::linear_add_rms_norm_qkv_rope_cache", "cpu",
                              linear_add_rms_norm_qkv_rope_cache_ref)


@torch.library.register_fake("compilelm::linear_add_rms_norm_gate_up_silu_mul")
def _(x, weight, residual, eps, weight2):
    _check(x, weight, residual, weight2, "linear_add_rms_norm_gate_up_silu_mul")
    return x.new_empty((x.shape[0], weight2.shape[0] // 2)), x.new_empty(residual.shape)


@torch.library.register_fake("compilelm::linear_add_rms_norm_qkv_rope_cache")
def _(x, weight, residual, eps, weight2, positions, cos_sin_cache, key_cache, value_cache, slot_mapping, num_heads):
    _check(x, weight, residual, weight2, "linear_add_rms_norm_qkv_rope_cache")
    return x.new_empty((x.shape[0], num_heads, key_cache.shape[3])), x.new_empty(residual.shape)


@functools.cache
def _ones(n: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.ones(n, dtype=dtype, device=device)  # the weightless norm's weight for fused_add_rms_norm


def _unfused(x, weight, residual, eps):
    """The graph's kernels before the fusion: linear, then the add + RMSNorm kernel."""
    return ops.fused_add_rms_norm(ops.linear(x, weight), residual, _ones(weight.shape[0], x.dtype, x.device), eps)


def shapes_fit(weight_shape, weight2_shape) -> bool:
    """Whether the two-kernel path takes these weights ([N, K], [N2, N]): both large enough for the
    Hopper GEMM, N / 64 blocks a power of two (the partials' count), whole 128-row tiles of weight2
    (the SiLU epilogue's gate | up halves)."""
    (n, k), (n2, k2) = weight_shape, weight2_shape
    blocks = n // 64
    return (n % 64 == 0 and blocks & (blocks - 1) == 0 and k % 128 == 0 and n * k >= MIN_WEIGHT
            and n2 * k2 >= MIN_WEIGHT and n2 % 128 == 0)


def takes(x: torch.Tensor, weight: torch.Tensor, weight2: torch.Tensor) -> bool:
    """Whether the two-kernel path runs this call: sm_90 with Triton, 3-64 rows, bf16/fp16,
    contiguous operands, and weights it takes (`shapes_fit`)."""
    return (triton is not None and x.is_cuda and torch.cuda.get_device_capability(x.device) == (9, 0)
            and ops.hopper_gemm() and 3 <= x.shape[0] <= 64 and x.dtype in (torch.bfloat16, torch.float16)
            and x.dtype == weight.dtype == weight2.dtype and x.is_contiguous() and weight.is_contiguous()
            and weight2.is_contiguous() and shapes_fit(weight.shape, weight2.shape))


def _mm_add_sumsq(x, weight, residual):
    """The producer: (h, partials [N / 64, PART_ROWS] fp32)."""
    m, k = x.shape
    n = weight.shape[0]
    bm, bn, bk, stages = tile_config(m, n)  # (BN 64 at these N: one partial per block)
    h = torch.empty((m, n), dtype=x.dtype, device=x.device)
    partials = torch.empty((n // bn, PART_ROWS), dtype=torch.float32, device=x.device)
    _mm_add_sumsq_kernel[(n // bn,)](TensorDescriptor.from_tensor(x, [bm, bk]),
                                     TensorDescriptor.from_tensor(weight, [bn, bk]), residual, h, partials, m, n, k,
                                     residual.stride(0), BM=bm, BN=bn, BK=bk, STAGES=stages, num_warps=4,
                                     launch_pdl=ops.programmatic_launch())
    return h, partials


@torch.library.register_kernel("compilelm::linear_add_rms_norm_gate_up_silu_mul", "cuda")
def _(x, weight, residual, eps, weight2):
    if not takes(x, weight, weight2):
        normed, h = _unfused(x, weight, residual, eps)
        return ops.gate_up_silu_mul(normed, weight2), h
    h, partials = _mm_add_sumsq(x, weight, residual)
    out = torch.empty((x.shape[0], weight2.shape[0] // 2), dtype=x.dtype, device=x.device)
    hopper_mm_out(h, weight2, out, ops.programmatic_launch(), True, norm=(partials, eps))
    return out, h


@torch.library.register_kernel("compilelm::linear_add_rms_norm_qkv_rope_cache", "cuda")
def _(x, weight, residual, eps, weight2, positions, cos_sin_cache, key_cache, value_cache, slot_mapping, num_heads):
    d = key_cache.shape[3]
    if not (takes(x, weight, weight2) and d % 64 == 0 and key_cache.is_contiguous() and value_cache.is_contiguous()):
        normed, h = _unfused(x, weight, residual, eps)
        return ops.qkv_rope_cache(normed, weight2, positions, cos_sin_cache, key_cache, value_cache, slot_mapping,
                                  num_heads), h
    h, partials = _mm_add_sumsq(x, weight, residual)
    q = torch.empty((x.shape[0], num_heads, d), dtype=x.dtype, device=x.device)
    hopper_mm_rope_out(h, weight2, positions, cos_sin_cache, key_cache, value_cache, slot_mapping, q,
                       ops.programmatic_launch(), norm=(partials, eps))
    return q, h


if triton is not None:

    @triton.jit(do_not_specialize=["M"])
    def _mm_add_sumsq_kernel(x_desc, w_desc, res_ptr, h_ptr, part_ptr, M, N, K, stride_m, BM: tl.constexpr,
                             BN: tl.constexpr, BK: tl.constexpr, STAGES: tl.constexpr):
        # hopper_gemm.py's plain kernel, then: h = T(T(x @ w.T) + residual) ([M, N], row stride
        # stride_m), and part[block, row] = the sum of h's squares over the block's BN columns
        pid = tl.program_id(0)
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
        acc = tl.zeros((BN, BM), tl.float32)
        for k in tl.range(0, K, BK, num_stages=STAGES):
            acc = tl.dot(w_desc.load([pid * BN, k]), x_desc.load([0, k]).T, acc)
        rm = tl.arange(0, BM)
        rn = pid * BN + tl.arange(0, BN)
        at = rm[None, :] * stride_m + rn[:, None]
        mask = (rm[None, :] < M) & (rn[:, None] < N)
        residual = tl.load(res_ptr + at, mask=mask, other=0.0)
        h = (acc.to(h_ptr.dtype.element_ty).to(tl.float32) + residual.to(tl.float32)).to(h_ptr.dtype.element_ty)
        tl.store(h_ptr + at, h, mask=mask)
        hf = tl.where(mask, h.to(tl.float32), 0.0)
        tl.store(part_ptr + pid * 64 + rm, tl.sum(hf * hf, axis=0))  # (row stride PART_ROWS = 64)


# -- the graph op of the QKV side: the caches from the forward context ---------------------------

def _linear_add_qkv_rope_fake(x, weight, residual, eps, *args):
    return qkv_rope_fake(x, *args), x.new_empty(residual.shape)


@define("linear_add_rms_norm_qkv_rope(Tensor x, Tensor weight, Tensor residual, float eps, Tensor weight2, "
         "Tensor positions, Tensor cos_sin_cache, int num_heads) -> (Tensor, Tensor)", _linear_add_qkv_rope_fake)
def linear_add_rms_norm_qkv_rope(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor, eps: float,
                             weight2: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor,
                             num_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    # qkv_rope of rms_norm(h) (no weight: folded into weight2), h = x @ weight.T + residual
    # -> (rotated q [num_tokens, num_heads * head_dim], h)
    if next_cache_is_fp8():  # the kernels write model-dtype caches only (compilelm/ops/qkv_rope.py)
        normed, h = _unfused(x, weight, residual, eps)
        return rope_into_next_cache(ops.linear(normed, weight2), positions, cos_sin_cache, num_heads), h
    q, h = torch.ops.compilelm.linear_add_rms_norm_qkv_rope_cache(x, weight, residual, eps, weight2, positions,
                                                                  cos_sin_cache, *next_cache_args(num_heads))
    return q.view(x.shape[0], -1), h
