"""The FP8 W8A8 GEMM kernels (compilelm/ops/fp8_gemm.py) on Llama-3.1-8B's linear layers at decode
row counts, against torch._scaled_mm (cuBLASLt, what FP8 linears ran before) and against the bf16
linear (compilelm.linear: weight streaming at 1-2 rows, the Hopper Triton GEMM at 3-64) and
cuBLAS bf16 (torch.mm), on the GPU.

    python benchmarks/bench_fp8_gemm.py [--out PATH] [--iters 20] [--rows 1 2 4 8 16 32 64]

Per (layer, M): microseconds per call of fp8_stream_mm (M <= 16), the Triton FP8 GEMM (M <= 64,
sm_90), _scaled_mm, the routed fp8_linear (the layer's op: the kernel it picks is `route`), bf16
linear and bf16 torch.mm; the fp8 weight's bytes over the routed time as a share of the measured
copy bandwidth; speed-ups of the routed op over _scaled_mm and over bf16 linear; each fp8 path's
largest error against the reference relative to the largest output. Each timing replays a CUDA
graph of calls over enough distinct weight copies that the weights do not stay in L2 (>= 256 MB
per graph), as a decode step reads them. Table + JSON (default benchmarks/results/bench_fp8_gemm.json).
No asserts.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..")))

from benchmarks.bench_attention import copy_bandwidth, time_graph  # noqa: E402
from benchmarks.common import print_table, write_result  # noqa: E402
from compilelm.ops import linear  # noqa: E402
from compilelm.ops.fp8_gemm import fp8_linear_ref, fp8_mm_triton, route, scaled_mm  # noqa: E402

SHAPES = {"qkv": (6144, 4096), "o_proj": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}  # (N, K)
WORKING_SET = 256 * 2**20  # bytes of distinct weights per timed graph
FP8 = torch.float8_e4m3fn


def bench(name: str, n: int, k: int, m: int, iters: int, copy_gbps: float) -> dict:
    dev = torch.device("cuda", torch.cuda.current_device())
    copies = max(2, min(256, -(-WORKING_SET // (n * k))))
    g = torch.Generator(device="cuda").manual_seed(0)
    weights = [(torch.randn(n, k, device="cuda", generator=g) * 64).clamp(-448, 448).to(FP8) for _ in range(copies)]
    ws = torch.rand(1, n, device="cuda", generator=g) * 1e-3 + 1e-4
    x = torch.randn(m, k, device="cuda", generator=g, dtype=torch.bfloat16)
    q, xs = torch.ops.compilelm.quant_fp8_per_token(x)
    want = fp8_linear_ref(q, xs, weights[0], ws, None, torch.float32)
    scale = want.abs().max().item()
    paths = {"scaled_mm": lambda w: scaled_mm(q, xs, w, ws, None, torch.bfloat16),
             "fp8_linear": lambda w: torch.ops.compilelm.fp8_linear(q, xs, w, ws, None, torch.bfloat16)}
    if m <= 16:
        paths["stream"] = lambda w: torch.ops.compilelm.fp8_stream_mm(q, xs, w, ws, None, torch.bfloat16)
    if m <= 64 and torch.cuda.get_device_capability() == (9, 0):
        paths["triton"] = lambda w: fp8_mm_triton(q, xs, w, ws, None, torch.bfloat16)
    row = {"layer": name, "N": n, "K": k, "M": m, "fp8_MB": n * k / 1e6, "route": route(m, dev)}
    for key, fn in paths.items():
        row[f"{key}_err"] = (fn(weights[0]).float() - want).abs().max().item() / scale
        row[f"{key}_us"] = time_graph(lambda i, fn=fn: fn(weights[i % copies]), copies, iters) * 1e6
    weights = None  # (free the fp8 copies before the bf16 ones)
    bf_copies = max(2, min(256, -(-WORKING_SET // (2 * n * k))))
    bf = [torch.randn(n, k, device="cuda", generator=g, dtype=torch.bfloat16) * 0.02 for _ in range(bf_copies)]
    row["bf16_linear_us"] = time_graph(lambda i: linear(x, bf[i % bf_copies]), bf_copies, iters) * 1e6
    row["bf16_mm_us"] = time_graph(lambda i: torch.mm(x, bf[i % bf_copies].t()), bf_copies, iters) * 1e6
    bf = None
    row["pct_copy_bw"] = 100 * n * k / (row["fp8_linear_us"] * 1e-6) / 1e9 / copy_gbps
    row["vs_scaled_mm"] = row["scaled_mm_us"] / row["fp8_linear_us"]
    row["vs_bf16_linear"] = row["bf16_linear_us"] / row["fp8_linear_us"]
    print(f"{name} M={m}: " + ", ".join(f"{k_}={v:.2f}" for k_, v in row.items() if k_.endswith("_us")), flush=True)
    return row


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64])
    ap.add_argument("--layers", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench_fp8_gemm needs a CUDA GPU")
    copy = copy_bandwidth(args.iters)
    rows = []
    payload = {"copy": copy, "rows": rows}
    for name in args.layers:
        for m in args.rows:
            try:
                rows.append(bench(name, *SHAPES[name], m, args.iters, copy["copy_GBps"]))
            except Exception as e:  # report, keep the other rows
                rows.append({"layer": name, "M": m, "error": f"{type(e).__name__}: {e}"[:300]})
                print(f"{name} M={m}: FAILED {rows[-1]['error']}", flush=True)
            torch.cuda.empty_cache()
        write_result("bench_fp8_gemm", payload, args.out)
    path = write_result("bench_fp8_gemm", payload, args.out)
    print(f"copy bandwidth (read + write): {copy['copy_GBps']:.0f} GB/s")
    print_table(rows, ["layer", "M", "route", "stream_us", "triton_us", "scaled_mm_us", "fp8_linear_us",
                       "bf16_linear_us", "bf16_mm_us", "pct_copy_bw", "vs_scaled_mm", "vs_bf16_linear",
                       "stream_err", "triton_err"])
    print(f"wrote {path}")
    return payload


if __name__ == "__main__":
    main()
