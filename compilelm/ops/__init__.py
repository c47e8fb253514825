"""Custom ops from csrc/: loads compilelm/_C*.so, which registers torch.ops.compilelm.* (schemas,
CPU and CUDA kernels), then the Python wrappers, fake impls (for tracing), plain-torch references
and, for the fused ops, the CPU implementations (torch compositions) of each op."""

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

from compilelm.ops.attention import paged_attention, paged_attention_ref  # noqa: E402
from compilelm.ops.cache import reshape_and_cache, reshape_and_cache_ref  # noqa: E402
from compilelm.ops.linear import (  # noqa: E402
    fused_add_rms_norm_skinny_mm, fused_add_rms_norm_skinny_mm_ref, rms_norm_skinny_mm, rms_norm_skinny_mm_ref,
    skinny_mm, skinny_mm_argmax_out, skinny_mm_out, skinny_mm_ref,
)
from compilelm.ops.norm import fused_add_rms_norm, fused_add_rms_norm_ref  # noqa: E402
from compilelm.ops.rope_cache import (  # noqa: E402
    fused_add_rms_norm_skinny_mm_rope, fused_add_rms_norm_skinny_mm_rope_ref, rms_norm_skinny_mm_rope,
    rms_norm_skinny_mm_rope_ref, rope_and_cache, rope_and_cache_ref, rope_paged_attention, rope_paged_attention_ref,
    skinny_mm_rope, skinny_mm_rope_ref,
)
from compilelm.ops.sampling import argmax_rows, argmax_rows_ref  # noqa: E402
from compilelm.ops import quant  # noqa: E402, F401  (registers the fp8 ops' CPU and fake impls)
from compilelm.ops import hopper_gemm  # noqa: E402, F401  (the hopper_mm ops' Triton kernels, CPU and fake impls)
from compilelm.ops import norm_gemm  # noqa: E402, F401  (the norm-between-GEMMs ops: Triton kernels, CPU and fake impls)

__all__ = ["argmax_rows", "argmax_rows_ref", "fused_add_rms_norm", "fused_add_rms_norm_ref", "fused_add_rms_norm_skinny_mm",
           "fused_add_rms_norm_skinny_mm_rope", "fused_add_rms_norm_skinny_mm_rope_ref",
           "fused_add_rms_norm_skinny_mm_ref", "paged_attention", "paged_attention_ref", "reshape_and_cache",
           "reshape_and_cache_ref", "rms_norm_skinny_mm", "rms_norm_skinny_mm_ref",
           "rms_norm_skinny_mm_rope", "rms_norm_skinny_mm_rope_ref", "rope_and_cache",
           "rope_and_cache_ref", "rope_paged_attention", "rope_paged_attention_ref", "skinny_mm", "skinny_mm_argmax_out",
           "skinny_mm_out", "skinny_mm_ref", "skinny_mm_rope", "skinny_mm_rope_ref"]
