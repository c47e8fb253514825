"""Fusion passes: time of one compiled piece with the fusion on vs off (CPU).

Each piece is the part of a decoder layer a fusion rewrites (hidden 576 / intermediate 1536, the
default model's sizes), compiled by Inductor with compilelm's PassManager as the post-grad pass,
once with only the fusion's switch on and once with it off. On CPU the fused ops are composed of
torch ops (no kernels yet), so "fused" measures the rewrite's overhead/benefit against Inductor's
own code generation for the unfused norm; the CUDA kernels are what the fusion is for.

    python -m benchmarks.bench_passes [--tokens 1 16 256] [--iters 50] [--threads 1]
"""

from __future__ import annotations

import argparse
import time

import torch

from benchmarks.common import print_table, write_result
from compilelm.layers.activation import SiluAndMul
from compilelm.layers.layernorm import rms_norm
from compilelm.ops import quant as _quant_ops  # noqa: F401
from compilelm.passes import PassConfig, PassManager

HIDDEN, INTER, EPS = 576, 1536, 1e-5
ops = torch.ops.compilelm
_act = SiluAndMul()


def rms_quant(x, residual, w):
    return ops.quant_fp8_per_token(rms_norm(x, w, EPS))


def add_rms_quant(x, residual, w):
    residual = x + residual
    q, s = ops.quant_fp8_per_token(rms_norm(residual, w, EPS))
    return q, s, residual


def silu_mul_quant(x, residual, w):
    return ops.quant_fp8_per_token(_act(x))


FUSIONS = {  # name -> (piece, PassConfig switch, width of x)
    "rms_norm+quant": (rms_quant, "fuse_norm_quant", HIDDEN),
    "add+rms_norm+quant": (add_rms_quant, "fuse_norm_quant", HIDDEN),
    "silu_mul+quant": (silu_mul_quant, "fuse_act_quant", 2 * INTER),
}


def compile_piece(fn, switch: str | None):
    off = {"fuse_norm_quant": False, "fuse_act_quant": False}
    manager = PassManager(PassConfig(**{**off, **({switch: True} if switch else {})}))
    torch._dynamo.reset()
    compiled = torch.compile(fn, dynamic=False, options={"post_grad_custom_post_pass": manager})
    return compiled, manager


def bench(fn, args, iters: int, repeats: int = 5) -> float:
    """us per call: the best of `repeats` timed runs (robust to other jobs on a shared CPU)."""
    for _ in range(10):
        fn(*args)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(iters):
            fn(*args)
        best = min(best, (time.perf_counter() - start) / iters * 1e6)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 256])
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1: stable on a shared CPU)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    rows = []
    with torch.no_grad():
        for name, (fn, switch, width) in FUSIONS.items():
            for n in args.tokens:
                x, res, w = torch.randn(n, width), torch.randn(n, HIDDEN), torch.rand(HIDDEN) + 0.5
                unfused, _ = compile_piece(fn, None)
                t_unfused = bench(unfused, (x, res, w), args.iters)
                fused, manager = compile_piece(fn, switch)
                t_fused = bench(fused, (x, res, w), args.iters)
                matches = sum(p.matches for p in manager.post_grad if "Quant" in p.name)
                rows.append({"fusion": name, "tokens": n, "matches": matches, "eager_us": bench(fn, (x, res, w), args.iters),
                             "unfused_us": t_unfused, "fused_us": t_fused, "speedup": t_unfused / t_fused})
    print_table(rows, ["fusion", "tokens", "matches", "eager_us", "unfused_us", "fused_us", "speedup"])
    print("wrote", write_result("bench_passes", {"device": "cpu", "threads": torch.get_num_threads(),
                                                 "rows": rows}, args.out))


if __name__ == "__main__":
    main()
