"""linear (csrc/cuda/skinny_mm.cu) against cuBLAS (torch.mm) on the linear layers of
Llama-3.1-8B and SmolLM2-135M (and Qwen3-0.6B's LM head) at M = 1, 2 rows, bf16, on the GPU.
With `--rows 3 16 64`: what linear does above 2 rows, i.e. on an H100 the Triton GEMM of
compilelm/ops/hopper_gemm.py for the large weights (8B's layers, the 0.6B's LM head; cuBLAS for
the 135M's, where both columns time cuBLAS).

    python benchmarks/bench_skinny_mm.py [--out PATH] [--iters 20] [--rows 1 2]

Each timing replays a CUDA graph of calls over enough distinct weight copies that the weights do
not stay in L2 (>= 256 MB per graph), like a decode step reads them. Reported: microseconds per
call, the weight's bytes over that time, as a share of the measured copy bandwidth, and the
speed-up over cuBLAS. For the layers after a norm (qkv, gate_up), also the residual add + RMSNorm
before them: the norm kernel then linear (two kernels, as the graph runs without
RMSNormLinearFusionPass) against fused_add_rms_norm_linear (one). Table + JSON (default
benchmarks/results/bench_skinny_mm.json). No asserts.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..")))

from benchmarks.bench_attention import copy_bandwidth, time_graph  # noqa: E402
from benchmarks.common import print_table, write_result  # noqa: E402
from compilelm.ops import fused_add_rms_norm, fused_add_rms_norm_linear, linear  # noqa: E402

SHAPES = {  # name: (N, K) of the weight
    "8b.qkv": (6144, 4096), "8b.o_proj": (4096, 4096), "8b.gate_up": (28672, 4096), "8b.down": (4096, 14336),
    "8b.lm_head": (128256, 4096),
    "135m.qkv": (960, 576), "135m.o_proj": (576, 576), "135m.gate_up": (3072, 576), "135m.down": (576, 1536),
    "135m.lm_head": (49152, 576),
    "0.6b.lm_head": (151936, 1024),  # Qwen3-0.6B: its only layer the Triton GEMM takes above 2 rows
}
WORKING_SET = 256 * 2**20  # bytes of distinct weights per timed graph


def bench(name: str, n: int, k: int, m: int, iters: int, copy_gbps: float) -> dict:
    nbytes = n * k * 2
    copies = max(2, min(256, -(-WORKING_SET // nbytes)))
    weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    err = (linear(x, weights[0]).float() - torch.mm(x, weights[0].t()).float()).abs().max().item()
    cublas = time_graph(lambda i: torch.mm(x, weights[i % copies].t()), copies, iters)
    ours = time_graph(lambda i: linear(x, weights[i % copies]), copies, iters)
    row = {"layer": name, "N": n, "K": k, "M": m, "weight_MB": nbytes / 1e6,
           "cublas_us": cublas * 1e6, "skinny_us": ours * 1e6, "speedup": cublas / ours,
           "cublas_pct_copy_bw": 100 * nbytes / cublas / 1e9 / copy_gbps,
           "skinny_pct_copy_bw": 100 * nbytes / ours / 1e9 / copy_gbps, "max_abs_diff": err}
    if name.endswith((".qkv", ".gate_up")):  # a norm feeds them
        r, g = torch.randn_like(x), torch.rand(k, device="cuda", dtype=torch.bfloat16) + 0.5
        apart = time_graph(lambda i: linear(fused_add_rms_norm(x, r, g, 1e-5)[0], weights[i % copies]), copies, iters)
        fused = time_graph(lambda i: fused_add_rms_norm_linear(x, r, g, 1e-5, weights[i % copies]), copies, iters)
        row.update(norm_then_skinny_us=apart * 1e6, fused_norm_skinny_us=fused * 1e6, norm_fusion_speedup=apart / fused)
    weights = None  # (the closures above hold the cell: this frees the copies)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2])
    args = ap.parse_args()
    copy = copy_bandwidth(args.iters)
    rows = [bench(name, n, k, m, args.iters, copy["copy_GBps"]) for name, (n, k) in SHAPES.items() for m in args.rows]
    print(f"copy bandwidth (read + write): {copy['copy_GBps']:.0f} GB/s")
    print_table(rows, ["layer", "M", "weight_MB", "cublas_us", "skinny_us", "speedup", "cublas_pct_copy_bw",
                       "skinny_pct_copy_bw", "max_abs_diff", "norm_then_skinny_us", "fused_norm_skinny_us",
                       "norm_fusion_speedup"])
    path = write_result("bench_skinny_mm", {"copy": copy, "rows": rows}, args.out)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
