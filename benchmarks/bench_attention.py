"""Paged decode attention on the GPU: achieved KV bandwidth against the measured copy bandwidth,
and time against F.scaled_dot_product_attention on contiguous KV, across batch x context; the
default decode kernel (tensor cores where the launch fills the GPU) beside the CUDA-core one
(`cuda_cores_us`, torch.ops.compilelm.set_decode_mma(False)) on the same inputs.

    python benchmarks/bench_attention.py [--batches 1 4 16 64 256] [--contexts 512 2048 8192 32768]
                                         [--heads 32 8] [--vllm-site /tmp/vllm_site]
                                         [--layers 28 --cache-gb 2] [--kv-cache-dtype fp8]

Shapes are Llama-3-8B's attention (32 query heads, 8 kv heads, head_size 128; `--heads` for others,
e.g. Qwen3-0.6B's 16 8), bf16, block 16,
one decode row per sequence, every sequence at the full context, called as a full decode graph
calls it (max_query_len=1). Cache layouts (`--layouts`): slot_major = [num_blocks, block_size,
num_kv_heads, head_size] contiguous (a slot's heads side by side; the engine's), head_major =
[num_blocks, num_kv_heads, block_size, head_size] (a block of one head is one contiguous run),
passed as the permuted view (on an H100 the two were within 3% of each other at every point:
docs/perf.md, "Paged attention"). Bandwidth = KV bytes the kernel must read (batch x context x
kv heads x head_size x 2 bytes x K and V) / time. Copy bandwidth = bytes read + written by 1 GiB
device-to-device copies, the faster of cudaMemcpy and an elementwise kernel (both recorded),
measured in the same run. Each point is CUDA-graph replays (how the engine runs decode), median
over --iters replays after warm-up; small shapes rotate over several block tables on disjoint
pages (and SDPA over several KV tensors) so that L2 does not serve them. Target: >= 80% of the copy
bandwidth where batch x context >= 256k tokens. With --vllm-site (a vLLM 0.26.0 site folder, as
scripts/gpu_vs_vllm.sh unpacks it), FlashAttention 3 as vLLM calls it for decode rows
(flash_attn_varlen_func on the same paged cache and block tables) is timed beside it (`fa3_us`).
--layers N times each point a second way, as a decode graph calls it: N calls in one graph, each
over its own layer's K and V tensors of --cache-gb GB (the engine's), pages in id order.
--kv-cache-dtype fp8 stores the caches in float8_e4m3fn (the random values rounded to it, scales
1.0; bandwidth counts their bytes), SDPA reading them widened to bf16; FA3 is not timed on them.

Prints a table and writes JSON (default benchmarks/results/bench_attention.json). No asserts.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..")))

from benchmarks.bench_prefill_attention import load_fa3  # noqa: E402
from benchmarks.common import print_table, write_result  # noqa: E402
from compilelm.ops import paged_attention  # noqa: E402

NUM_HEADS, NUM_KV_HEADS, HEAD_SIZE, BLOCK_SIZE, DTYPE = 32, 8, 128, 16, torch.bfloat16  # defaults (--heads)
TARGET_TOKENS, TARGET_SHARE = 256 * 1024, 0.8
SPEC_GBPS = {"H100 80GB HBM3": 3350, "H200": 4800}  # datasheet HBM bandwidth (H100 SXM5, H200 SXM)


def time_graph(fn, calls: int, iters: int) -> float:
    """Median seconds per call of fn, captured `calls` times in one CUDA graph."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for i in range(calls):
            fn(i)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            fn(i)
    for _ in range(3):
        graph.replay()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / calls)
    return statistics.median(times)


def time_events(fn, iters: int) -> float:
    """Median seconds of fn (a batch of launches), timed eagerly with CUDA events."""
    fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def copy_bandwidth(iters: int) -> dict:
    """Bytes read + written per second by 1 GiB device-to-device copies: cudaMemcpy (copy_) and
    an elementwise kernel (out = src * 1); the faster one is the ceiling the kernel is held to."""
    src = torch.randn(2**29, device="cuda", dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    nbytes = 2 * src.numel() * src.element_size()
    memcpy = nbytes / time_events(lambda: dst.copy_(src), iters)
    kernel = nbytes / time_events(lambda: torch.mul(src, 1, out=dst), iters)
    return {"memcpy_GBps": memcpy / 1e9, "elementwise_GBps": kernel / 1e9, "copy_GBps": max(memcpy, kernel) / 1e9}


def sdpa_backend(q, k, v) -> str:
    try:
        from torch.nn.attention import SDPBackend
        return SDPBackend(torch._fused_sdp_choice(q, k, v, enable_gqa=True)).name
    except Exception:  # private API: the name is informational only
        return "unknown"


def make_cache(shape, layout: str, gen, cache_dtype: torch.dtype = DTYPE) -> torch.Tensor:
    """Random values of `shape` = [num_blocks, block_size, num_kv_heads, head_size] in `layout`,
    stored as cache_dtype."""
    if layout == "slot_major":
        return torch.randn(shape, generator=gen, device="cuda", dtype=DTYPE).to(cache_dtype)
    blocks, block_size, heads, head_size = shape
    return torch.randn((blocks, heads, block_size, head_size), generator=gen, device="cuda",
                       dtype=DTYPE).to(cache_dtype).transpose(1, 2)


def bench_point(batch: int, context: int, l2_bytes: int, iters: int, layout: str,
                heads: tuple[int, int] = (NUM_HEADS, NUM_KV_HEADS), fa3=None, splits=(),
                pages: str = "shuffled", cache_dtype: torch.dtype = DTYPE) -> dict:
    num_heads, num_kv_heads = heads
    blocks_per_seq = context // BLOCK_SIZE
    kv_bytes = 2 * batch * context * num_kv_heads * HEAD_SIZE * cache_dtype.itemsize
    sets = max(1, min(32, math.ceil(4 * l2_bytes / kv_bytes)))  # disjoint working sets
    calls = max(sets, 4)
    gen = torch.Generator(device="cuda").manual_seed(batch * 100003 + context)
    num_blocks = 1 + sets * batch * blocks_per_seq
    cache_shape = (num_blocks, BLOCK_SIZE, num_kv_heads, HEAD_SIZE)
    key_cache = make_cache(cache_shape, layout, gen, cache_dtype)
    value_cache = make_cache(cache_shape, layout, gen, cache_dtype)
    # each set owns its pages, in random order (a long-running cache is not laid out in order), or
    # (pages="in_order") each sequence's pages one run after the other, as a fresh block pool hands them out
    if pages == "in_order":
        ids = torch.arange(1, num_blocks, device="cuda", dtype=torch.int32)
    else:
        ids = 1 + torch.randperm(num_blocks - 1, generator=gen, device="cuda").to(torch.int32)
    tables = ids.view(sets, batch, blocks_per_seq)
    query = torch.randn(sets, batch, num_heads, HEAD_SIZE, generator=gen, device="cuda", dtype=DTYPE)
    cu_seqlens_q = torch.arange(batch + 1, device="cuda", dtype=torch.int32)
    seq_lens = torch.full((batch,), context, device="cuda", dtype=torch.int32)
    scale = HEAD_SIZE**-0.5

    def paged(i):
        s = i % sets
        return paged_attention(query[s], key_cache, value_cache, cu_seqlens_q, seq_lens, tables[s], scale,
                               max_query_len=1)

    paged_s = time_graph(paged, calls, iters)
    # the CUDA-core decode kernel on the same inputs (where the default took the tensor-core one)
    default_out = paged(0).float()
    previous = torch.ops.compilelm.set_decode_mma(False)
    try:
        cuda_cores_s = time_graph(paged, calls, iters)
        cuda_cores_diff = (paged(0).float() - default_out).abs().max().item()
    finally:
        torch.ops.compilelm.set_decode_mma(previous)

    split_us = {}  # forced split-K counts (torch.ops.compilelm.set_decode_splits)
    for n in splits:
        previous = torch.ops.compilelm.set_decode_splits(n)
        try:
            split_us[n] = time_graph(paged, calls, iters) * 1e6
        finally:
            torch.ops.compilelm.set_decode_splits(previous)

    # SDPA on the same keys/values laid out contiguously: [sets, batch, kv_heads, context, head_size]
    def contiguous(cache):
        rows = cache[tables.long()].to(DTYPE)
        return rows.reshape(sets, batch, context, num_kv_heads, HEAD_SIZE).transpose(2, 3).contiguous()

    key, value = contiguous(key_cache), contiguous(value_cache)
    sdpa_query = query.unsqueeze(3)  # [sets, batch, num_heads, 1, head_size]

    def sdpa(i):
        s = i % sets
        return F.scaled_dot_product_attention(sdpa_query[s], key[s], value[s], scale=scale, enable_gqa=True)

    sdpa_s = time_graph(sdpa, calls, iters)
    max_diff = (paged(0).float() - sdpa(0).squeeze(2).float()).abs().max().item()  # same function?

    fa3_point = {}
    if fa3 is not None:  # as vLLM's FlashAttention backend calls it for a batch of decode rows
        def flash(i):
            s = i % sets
            return fa3(query[s], key_cache, value_cache, max_seqlen_q=1, cu_seqlens_q=cu_seqlens_q,
                       max_seqlen_k=context, seqused_k=seq_lens, softmax_scale=scale, causal=True,
                       block_table=tables[s], fa_version=3)

        fa3_s = time_graph(flash, calls, iters)
        fa3_point = {"fa3_us": fa3_s * 1e6, "fa3_GBps": kv_bytes / fa3_s / 1e9, "speedup_vs_fa3": fa3_s / paged_s,
                     "max_abs_diff_vs_fa3": (paged(0).float() - flash(0).float()).abs().max().item()}

    tokens = batch * context
    return {
        "layout": layout, "pages": pages, "batch": batch, "context": context, "tokens": tokens, "kv_MB": kv_bytes / 1e6,
        "working_sets": sets,
        "paged_us": paged_s * 1e6, "paged_GBps": kv_bytes / paged_s / 1e9,
        "cuda_cores_us": cuda_cores_s * 1e6, "cuda_cores_GBps": kv_bytes / cuda_cores_s / 1e9,
        "max_abs_diff_vs_cuda_cores": cuda_cores_diff,
        "sdpa_us": sdpa_s * 1e6, "sdpa_GBps": kv_bytes / sdpa_s / 1e9, "speedup_vs_sdpa": sdpa_s / paged_s,
        "sdpa_backend": sdpa_backend(sdpa_query[0], key[0], value[0]), "max_abs_diff_vs_sdpa": max_diff,
        **fa3_point, **({"splits_us": split_us} if split_us else {}),
    }


def bench_layer_chain(batch: int, context: int, layers: int, cache_gb: float, iters: int,
                      heads: tuple[int, int] = (NUM_HEADS, NUM_KV_HEADS), cache_dtype: torch.dtype = DTYPE) -> dict:
    """The decode graph's view of attention: `layers` calls in one graph, each over its own layer's
    key and value caches of `cache_gb` GB apiece (the engine's per-layer tensors), the sequences'
    pages one run each in id order (a fresh pool's). Against bench_point, whose one cache holds only
    the call's pages: whether many large caches (TLB reach) slow the same kernel."""
    num_heads, num_kv_heads = heads
    blocks_per_seq = context // BLOCK_SIZE
    block_bytes = 2 * BLOCK_SIZE * num_kv_heads * HEAD_SIZE * cache_dtype.itemsize  # K and V
    num_blocks = max(1 + batch * blocks_per_seq, int(cache_gb * 1e9 * 2 / block_bytes))
    shape = (num_blocks, BLOCK_SIZE, num_kv_heads, HEAD_SIZE)
    caches = [(torch.empty(shape, device="cuda", dtype=DTYPE).normal_().to(cache_dtype),
               torch.empty(shape, device="cuda", dtype=DTYPE).normal_().to(cache_dtype)) for _ in range(layers)]
    tables = torch.arange(1, 1 + batch * blocks_per_seq, device="cuda", dtype=torch.int32).view(batch, -1)
    query = torch.randn(batch, num_heads, HEAD_SIZE, device="cuda", dtype=DTYPE)
    cu_seqlens_q = torch.arange(batch + 1, device="cuda", dtype=torch.int32)
    seq_lens = torch.full((batch,), context, device="cuda", dtype=torch.int32)

    def call(i):
        key_cache, value_cache = caches[i % layers]
        return paged_attention(query, key_cache, value_cache, cu_seqlens_q, seq_lens, tables, HEAD_SIZE**-0.5,
                               max_query_len=1)

    seconds = time_graph(call, layers, iters)
    kv_bytes = 2 * batch * context * num_kv_heads * HEAD_SIZE * cache_dtype.itemsize
    caches.clear()  # (the graph keeps its own references until it goes)
    return {"batch": batch, "context": context, "layers": layers, "cache_GB_per_tensor": num_blocks * block_bytes / 2e9,
            "us_per_layer": seconds * 1e6, "GBps": kv_bytes / seconds / 1e9}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16, 64, 256])
    parser.add_argument("--contexts", type=int, nargs="+", default=[512, 2048, 8192, 32768])
    parser.add_argument("--max-tokens", type=int, default=2 * 1024 * 1024, help="skip larger batch x context")
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--layouts", nargs="+", choices=["slot_major", "head_major"],
                        default=["slot_major"])
    parser.add_argument("--heads", type=int, nargs=2, default=[NUM_HEADS, NUM_KV_HEADS], metavar=("Q", "KV"),
                        help="query and kv heads (head_size 128)")
    parser.add_argument("--vllm-site", default=None, help="time vLLM's FlashAttention 3 beside ours")
    parser.add_argument("--pages", choices=["shuffled", "in_order"], default="shuffled",
                        help="each sequence's pages in random order, or one run in id order")
    parser.add_argument("--layers", type=int, default=0,
                        help="also time a chain of this many layers' calls, each over its own caches")
    parser.add_argument("--cache-gb", type=float, default=2.0, help="with --layers: GB per layer's K (and V) tensor")
    parser.add_argument("--splits", type=int, nargs="*", default=[], help="also time these forced split-K counts")
    parser.add_argument("--kv-cache-dtype", choices=["auto", "fp8"], default="auto",
                        help="the caches in bf16 (auto) or float8_e4m3fn")
    parser.add_argument("--out", default=None, help="JSON path (default benchmarks/results/bench_attention.json)")
    args = parser.parse_args()
    cache_dtype = torch.float8_e4m3fn if args.kv_cache_dtype == "fp8" else DTYPE
    fa3 = load_fa3(args.vllm_site) if cache_dtype == DTYPE else None

    copy = copy_bandwidth(args.iters)
    copy_Bps = copy["copy_GBps"] * 1e9
    spec_GBps = next((v for k, v in SPEC_GBPS.items() if k in torch.cuda.get_device_name()), None)
    l2_bytes = torch.cuda.get_device_properties(torch.cuda.current_device()).L2_cache_size
    rows = []
    points = [(layout, batch, context) for layout in args.layouts for batch in args.batches
              for context in args.contexts if batch * context <= args.max_tokens]
    for layout, batch, context in points:
        row = bench_point(batch, context, l2_bytes, args.iters, layout, tuple(args.heads), fa3, args.splits, args.pages,
                          cache_dtype)
        row["pct_of_copy_bw"] = 100 * row["paged_GBps"] * 1e9 / copy_Bps
        row["pct_of_spec_bw"] = 100 * row["paged_GBps"] / spec_GBps if spec_GBps else None
        rows.append(row)
        if row.get("splits_us"):
            print(f"b{batch} c{context} forced splits (us):", {n: round(us, 1) for n, us in row["splits_us"].items()},
                  f"default {row['paged_us']:.1f}")
        torch.cuda.empty_cache()

    chains = []
    if args.layers:
        for _, batch, context in points:
            chains.append(bench_layer_chain(batch, context, args.layers, args.cache_gb, args.iters, tuple(args.heads),
                                            cache_dtype))
            print(f"b{batch} c{context}: {args.layers} layers over {chains[-1]['cache_GB_per_tensor']:.1f} GB caches, "
                  f"{chains[-1]['us_per_layer']:.1f} us a layer ({chains[-1]['GBps']:.0f} GB/s)")
            torch.cuda.empty_cache()
    print(f"device-to-device copy (read + write): memcpy {copy['memcpy_GBps']:.0f} GB/s, "
          f"elementwise kernel {copy['elementwise_GBps']:.0f} GB/s; spec {spec_GBps} GB/s")
    print_table(rows, ["layout", "batch", "context", "paged_us", "paged_GBps", "pct_of_copy_bw", "pct_of_spec_bw",
                       "cuda_cores_us", *(["fa3_us", "fa3_GBps", "speedup_vs_fa3"] if fa3 else []),
                       "sdpa_us", "sdpa_GBps", "speedup_vs_sdpa", "sdpa_backend",
                       "max_abs_diff_vs_sdpa", "max_abs_diff_vs_cuda_cores"])
    large = [r["pct_of_copy_bw"] for r in rows if r["tokens"] >= TARGET_TOKENS and r["layout"] == args.layouts[0]]
    summary = {
        **copy,
        "spec_GBps": spec_GBps,
        "min_pct_of_copy_bw_at_target_sizes": min(large) if large else None,
        "layout_of_target": args.layouts[0],
        "target": f">= {TARGET_SHARE:.0%} of copy bandwidth at batch x context >= {TARGET_TOKENS}",
        "target_met": bool(large) and min(large) >= 100 * TARGET_SHARE,
    }
    print(summary)
    shapes = dict(num_heads=args.heads[0], num_kv_heads=args.heads[1], head_size=HEAD_SIZE, block_size=BLOCK_SIZE,
                  dtype=str(DTYPE), kv_cache_dtype=str(cache_dtype), iters=args.iters)
    print("wrote", write_result("bench_attention", {"shapes": shapes, "summary": summary, "rows": rows,
                                                       **({"layer_chain": chains} if chains else {})}, args.out))


if __name__ == "__main__":
    main()
