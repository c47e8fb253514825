"""Which family of work a kernel or op is (`compile --profile`): GEMM, attention, norm, rope,
quant, elementwise, copies, collectives, other — by its names, first match wins; a fused kernel
whose name says only "add_mul" is refined by the source lines it came from (rope.py, norm.py).
Add a rule here when a new op family appears."""

from __future__ import annotations

import re

FAMILIES = ("GEMM", "attention", "norm", "rope", "quant", "elementwise", "copies", "collectives", "other",
            "launch gaps", "unattributed")
FUSIBLE = ("elementwise", "norm", "rope", "quant", "copies")  # what an unfused chain is made of

_RULES = [
    ("attention", r"attention|flash|paged|sdpa|fmha"),
    ("collectives", r"all_reduce|allreduce|all_gather|nccl|reduce_scatter"),
    ("GEMM", r"(^|[^a-z])(mm|addmm|bmm|matmul|linear|_scaled_mm|gemv)([^a-z]|$)|gemm|cublas|cutlass|xmma|nvjet"
             r"|hopper_mm|wgmma|gate_up_silu_mul|qkv_rope|linear_"),
    ("quant", r"quant|fp8|float8|e4m3"),
    ("rope", r"rope|rotary|cos_sin"),
    ("norm", r"norm|rsqrt"),
    ("copies", r"copy|memcpy|memset|(^|_)cat(_|$)|clone|reshape_and_cache|index_put|scatter|gather|contiguous"
               r"|embedding"),
    ("elementwise", r"fused|silu|gelu|add|mul|triton_|cpp_"),
]
_SOURCE_RULES = [("rope", r"rope|rotary"), ("norm", r"norm"), ("quant", r"quant|fp8")]


def family(names: list[str], sources: list[str] = ()) -> str:
    """`names`: the kernel's name, then the ops around it (innermost first); `sources`: the source
    lines it came from."""
    found = next((fam for name in names for fam, rule in _RULES if re.search(rule, name.lower())), "other")
    if found in ("elementwise", "copies", "other"):
        text = " ".join(sources).lower()
        found = next((fam for fam, rule in _SOURCE_RULES if re.search(rule, text)), found)
    return found
