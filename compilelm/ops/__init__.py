"""The bottom floor: every `compilelm::` op, and the plain-torch references that layers and pass
patterns call.

Importing this package loads compilelm/_C*.so, which registers the csrc ops (schemas in
csrc/ops.cpp, CPU and CUDA kernels), then every module below, which adds each op's Python wrapper,
fake impl (for tracing), plain-torch reference and, for the fused ops, the CPU implementation (the
torch composition of the unfused ops). Ops that are defined in Python rather than csrc use
`library.define`. Grouped by what they compute:

    norm.py, activation.py, rope.py    references (rms_norm, silu_and_mul, apply_rope) and their ops
    attention.py                       paged attention, the KV-cache write
    unified_attention.py               the per-layer attention ops the graph is split at
    gemm.py, hopper_gemm.py            linear layers (weight streaming, the Hopper GEMM), fused norm/act
    qkv_rope.py, norm_gemm.py          projections with RoPE + cache write, norms between two GEMMs
    quant.py                           FP8 quantization, fused with its producer
    fp8_gemm.py                        FP8 W8A8 GEMM (per-token x per-channel scales), routed by rows
    fp8_block_gemm.py                  block-scaled FP8 GEMM (block-wise FP8 checkpoints)
    sampling.py                        greedy argmax, plain temperature sampling
    collectives.py                     tensor-parallel all-reduce (+ add + RMSNorm), all-gather

Op names list what an op computes in data-flow order (`rms_norm_linear`: the norm, then the
projection); graph ops that write "the next layer's" KV cache follow compilelm/forward_context.py.
"""

import importlib.machinery
from pathlib import Path

import torch


def _load_library() -> None:
    package_dir = Path(__file__).resolve().parent.parent
    # Prefer the build for this interpreter (compilelm/_C.cpython-311-x86_64-linux-gnu.so, ...).
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        path = package_dir / f"_C{suffix}"
        if path.exists():
            torch.ops.load_library(str(path))
            return
    raise ImportError(
        f"compilelm's C++ ops library (compilelm/_C*.so) is not built in {package_dir}. "
        "Build it from the repository root with: pip install --no-build-isolation -e ."
    )


_load_library()

from compilelm.ops import norm, activation, rope  # noqa: E402, I001  (references first: the others use them)
from compilelm.ops import attention, unified_attention  # noqa: E402
from compilelm.ops import gemm, qkv_rope, hopper_gemm, norm_gemm  # noqa: E402
from compilelm.ops import quant, sampling, collectives  # noqa: E402
from compilelm.ops import fp8_block_gemm, fp8_gemm  # noqa: E402
from compilelm.ops.attention import (  # noqa: E402
    paged_attention, paged_attention_ref, reshape_and_cache, reshape_and_cache_ref, rope_paged_attention,
    rope_paged_attention_ref,
)
from compilelm.ops.gemm import (  # noqa: E402
    fused_add_rms_norm_linear, fused_add_rms_norm_linear_ref, rms_norm_linear, rms_norm_linear_ref,
    linear, linear_argmax_out, linear_out, linear_ref,
)
from compilelm.ops.norm import fused_add_rms_norm, fused_add_rms_norm_ref, rms_norm  # noqa: E402
from compilelm.ops.qkv_rope import (  # noqa: E402
    fused_add_rms_norm_qkv_rope_cache, fused_add_rms_norm_qkv_rope_cache_ref, rms_norm_qkv_rope_cache,
    rms_norm_qkv_rope_cache_ref, qkv_rope_cache, qkv_rope_cache_ref,
)
from compilelm.ops.rope import apply_rope, rope_and_cache, rope_and_cache_ref  # noqa: E402
from compilelm.ops.activation import silu_and_mul  # noqa: E402
from compilelm.ops.sampling import argmax_rows, argmax_rows_ref, sample_rows, sample_rows_ref  # noqa: E402

__all__ = [
    "activation",
    "apply_rope",
    "argmax_rows",
    "argmax_rows_ref",
    "sample_rows",
    "sample_rows_ref",
    "attention",
    "collectives",
    "fp8_block_gemm",
    "fp8_gemm",
    "fused_add_rms_norm",
    "fused_add_rms_norm_linear",
    "fused_add_rms_norm_linear_ref",
    "fused_add_rms_norm_qkv_rope_cache",
    "fused_add_rms_norm_qkv_rope_cache_ref",
    "fused_add_rms_norm_ref",
    "gemm",
    "hopper_gemm",
    "linear",
    "linear_argmax_out",
    "linear_out",
    "linear_ref",
    "norm",
    "norm_gemm",
    "paged_attention",
    "paged_attention_ref",
    "qkv_rope",
    "qkv_rope_cache",
    "qkv_rope_cache_ref",
    "quant",
    "reshape_and_cache",
    "reshape_and_cache_ref",
    "rms_norm",
    "rms_norm_linear",
    "rms_norm_linear_ref",
    "rms_norm_qkv_rope_cache",
    "rms_norm_qkv_rope_cache_ref",
    "rope",
    "rope_and_cache",
    "rope_and_cache_ref",
    "rope_paged_attention",
    "rope_paged_attention_ref",
    "sampling",
    "silu_and_mul",
    "unified_attention",
]
