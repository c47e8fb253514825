"""Prefill attention on the GPU: the Triton prefill kernel (compilelm/ops/prefill_attention.py,
with paged_attention's CUDA kernels on the decode rows) against paged_attention's own mma.sync
prefill kernel and, where vLLM is given (--vllm-site), FlashAttention 3 on the same paged cache.

    python benchmarks/bench_prefill_attention.py [--vllm-site /tmp/vllm_site] [--sweep]

Cases are steps the engine runs: fresh prompts filling an 8192-token budget, one long prompt, a
chunk of a long prompt after its cached context, and a chunk riding with 64 decodes. Shapes are
Qwen3-0.6B's (16 query heads, 8 kv heads) and Llama-3.1-8B's (32 / 8), head size 128, bf16,
block 16, pages shuffled. TFLOP/s counts the causal work (4 x head_size x heads per query-key
pair attended). Each point is the median of --iters CUDA-graph replays after warm-up. Every
kernel's output is compared with paged_attention's (max abs error, printed). --sweep times the
Triton kernel's tile configurations on the first case. Table + JSON (default
benchmarks/results/bench_prefill_attention.json). No asserts.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..")))

from benchmarks.common import print_table, write_result  # noqa: E402
from compilelm.ops import paged_attention  # noqa: E402
from compilelm.ops import prefill_attention as prefill  # noqa: E402

MODELS = {"qwen3-0.6b": (16, 8), "llama-3.1-8b": (32, 8)}
# name -> [(q_len, context before the step)] per sequence
CASES = {
    "4x2048 fresh": [(2048, 0)] * 4,
    "1x8192 fresh": [(8192, 0)],
    "chunk 2048 @ ctx 6144": [(2048, 6144)],
    "16x512 fresh": [(512, 0)] * 16,
    "chunk 256 @ 1000 + 64 decodes": [(256, 1000)] + [(1, 1000)] * 64,
}
HEAD_DIM, PAGE = 128, 16


def make_case(seqs, heads, kv_heads, device, dtype=torch.bfloat16, seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    q_lens = [q for q, _ in seqs]
    seq_lens = [q + c for q, c in seqs]
    blocks = [-(-s // PAGE) for s in seq_lens]
    num_blocks = sum(blocks) + 1
    perm = torch.randperm(num_blocks - 1, generator=g) + 1  # block 0: the null block
    tables = torch.zeros(len(seqs), max(blocks), dtype=torch.int32)
    i = 0
    for r, n in enumerate(blocks):
        tables[r, :n] = perm[i:i + n]
        i += n
    kc = torch.randn(num_blocks, PAGE, kv_heads, HEAD_DIM, generator=g).to(device, dtype)
    vc = torch.randn(num_blocks, PAGE, kv_heads, HEAD_DIM, generator=g).to(device, dtype)
    q = torch.randn(sum(q_lens), heads, HEAD_DIM, generator=g).to(device, dtype)
    cu = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32, device=device)
    return dict(q=q, kc=kc, vc=vc, cu=cu, seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
                tables=tables.to(device), max_q=max(q_lens), max_k=max(seq_lens))


def flops(seqs, heads):
    pairs = sum(q * c + q * (q + 1) // 2 for q, c in seqs)
    return 4 * HEAD_DIM * heads * pairs


def graph_time_ms(fn, iters):
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    for _ in range(3):
        g.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(iters):
        start.record()
        g.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def kernels(c, fa3):
    scale = HEAD_DIM ** -0.5
    args = (c["q"], c["kc"], c["vc"], c["cu"], c["seq_lens"], c["tables"], scale)

    def cuda():
        return paged_attention(*args, max_query_len=c["max_q"])

    def triton(config=None):
        out = paged_attention(*args, max_query_len=c["max_q"], prefill_rows=False)
        prefill.prefill_attention(out, *args, config=config)
        return out

    fns = {"compilelm mma.sync": cuda, "compilelm triton": triton}
    if fa3 is not None:
        def fa():
            return fa3(c["q"], c["kc"], c["vc"], max_seqlen_q=c["max_q"], cu_seqlens_q=c["cu"],
                       max_seqlen_k=c["max_k"], seqused_k=c["seq_lens"], softmax_scale=scale, causal=True,
                       block_table=c["tables"], fa_version=3)
        fns["vLLM FA3"] = fa
    return fns, triton


def load_fa3(site):
    if not site:
        return None
    sys.path.insert(0, site)
    try:
        from vllm.vllm_flash_attn import flash_attn_varlen_func
        return flash_attn_varlen_func
    except Exception as e:  # noqa: BLE001 - report and go on without it
        print(f"FA3 unavailable: {type(e).__name__}: {e}")
        return None


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--vllm-site", default=None)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--out", default=None, help="JSON path (default benchmarks/results/bench_prefill_attention.json)")
    args = ap.parse_args()
    device = torch.device("cuda")
    fa3 = load_fa3(args.vllm_site)
    rows, results = [], []
    for model, (heads, kv_heads) in MODELS.items():
        for case, seqs in CASES.items():
            c = make_case(seqs, heads, kv_heads, device)
            fns, _ = kernels(c, fa3)
            ref = fns["compilelm mma.sync"]().float()
            point = {"model": model, "case": case, "tflop": flops(seqs, heads) / 1e12}
            for name, fn in fns.items():
                err = (fn().float() - ref).abs().max().item()
                ms = graph_time_ms(fn, args.iters)
                point[name] = {"ms": ms, "tflops": point["tflop"] / ms * 1e3, "max_abs_err": err}
            results.append(point)
            rows.append({"model": model, "case": case, "triton err": f"{point['compilelm triton']['max_abs_err']:.1e}",
                         **{f"{n} ms (TFLOP/s)": f"{point[n]['ms']:.3f} ({point[n]['tflops']:.0f})" for n in fns}})
            del c
    sweep = []
    if args.sweep:
        for model, (heads, kv_heads) in MODELS.items():
            c = make_case(CASES["4x2048 fresh"], heads, kv_heads, device)
            _, triton = kernels(c, None)
            for bm in (64, 128):
                for bn in (64, 128):
                    for warps in (4, 8):
                        for stages in (2, 3):
                            cfg = (bm, bn, warps, stages)
                            try:
                                ms = graph_time_ms(lambda cfg=cfg: triton(cfg), args.iters)
                            except Exception as e:  # noqa: BLE001 - out of shared memory etc.
                                sweep.append({"model": model, "config": cfg, "error": str(e).splitlines()[0][:80]})
                                continue
                            sweep.append({"model": model, "config": cfg, "ms": ms})
            best = sorted((s for s in sweep if s["model"] == model and "ms" in s), key=lambda s: s["ms"])[:5]
            print(model, "best configs (BLOCK_M, BLOCK_N, warps, stages):",
                  [(s["config"], round(s["ms"], 3)) for s in best])
    names = ["compilelm mma.sync", "compilelm triton"] + (["vLLM FA3"] if fa3 else [])
    print_table(rows, ["model", "case"] + [f"{n} ms (TFLOP/s)" for n in names] + ["triton err"])
    write_result("bench_prefill_attention", {"points": results, "sweep": sweep,
                                             "configs": {str(k): v for k, v in prefill.CONFIGS.items()}}, args.out)


if __name__ == "__main__":
    main()
