"""RoPE + attention fusion: model forward time with `fuse_rope_attention` on vs off (CPU).

The fusion spans the piecewise split (RoPE sits in the piece before the attention op), so the
measured unit is a whole forward of the default model's architecture (SmolLM2-135M shapes, fewer
layers to keep compiling short) compiled piecewise by compilelm, at a few token counts, one
prefill sequence. On CPU the fused op runs RoPE as composed torch ops before attention, so this
measures what moving RoPE out of the Inductor pieces costs or saves; a GPU kernel that rotates
q/k while loading them is what the fusion is for.

    python -m benchmarks.bench_rope_fusion [--layers 4] [--tokens 1 16 256] [--iters 50]
"""

from __future__ import annotations

import argparse
import dataclasses
import tempfile
import time

import torch

from benchmarks.common import print_table, write_result


def build(model_name: str, layers: int):
    from compilelm.entrypoints.cli_compile import load_model
    from compilelm.llm import make_engine_config

    config = make_engine_config(model_name, model_overrides={"num_hidden_layers": layers})
    model, factors = load_model(config)
    return config, model, factors


def compiled_forward(model, factors, base, fused: bool, cache_dir: str):
    from compilelm.graphs import CompiledModel

    passes = dataclasses.replace(base.passes, fuse_rope_attention=fused)
    config = dataclasses.replace(base, passes=passes, cache_dir=cache_dir, use_cache=False)
    compiled = CompiledModel(model, config, factors)
    fn = compiled.compile()
    matches = sum(p.matches for p in compiled.manager.whole_graph if p.name == "RopeAttentionFusionPass")
    return fn, matches


def context(model, n: int, block: int = 16):
    from compilelm.forward_context import AttentionMetadata, ForwardContext

    attn = [m for m in model.modules() if type(m).__name__ == "Attention"]
    blocks = list(range(1, -(-n // block) + 1))
    shape = (len(blocks) + 1, block, attn[0].num_kv_heads, attn[0].head_dim)
    caches = {a.layer_name: (torch.zeros(shape), torch.zeros(shape)) for a in attn}
    meta = AttentionMetadata(torch.arange(block, block + n), torch.tensor([0, n], dtype=torch.int32),
                             torch.tensor([n], dtype=torch.int32), torch.tensor([blocks], dtype=torch.int32), n, n)
    return ForwardContext(meta, caches)


def bench(fn, args, ctx, iters: int) -> float:
    from compilelm.forward_context import set_forward_context

    with torch.no_grad(), set_forward_context(ctx):
        for _ in range(5):
            fn(*args)
        start = time.perf_counter()
        for _ in range(iters):
            fn(*args)
    return (time.perf_counter() - start) / iters * 1e6  # us per forward


def rows(model_name: str = "dummy:smollm2-135m", layers: int = 4, tokens=(1, 16, 256), iters: int = 50) -> list[dict]:
    """One row per token count: unfused vs fused forward time (importable by bench_passes)."""
    config, model, factors = build(model_name, layers)
    with tempfile.TemporaryDirectory() as tmp:
        unfused, _ = compiled_forward(model, factors, config.compilation, False, tmp)
        fused, matches = compiled_forward(model, factors, config.compilation, True, tmp)
        out = []
        for n in tokens:
            ids, pos = torch.randint(0, 1000, (n,)), torch.arange(n)
            t_unfused = bench(unfused, (ids, pos), context(model, n), iters)
            t_fused = bench(fused, (ids, pos), context(model, n), iters)
            out.append({"fusion": "rope+attention", "layers": layers, "tokens": n, "matches": matches,
                        "unfused_us": t_unfused, "fused_us": t_fused, "speedup": t_unfused / t_fused})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="dummy:smollm2-135m")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 256])
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    result = rows(args.model, args.layers, tuple(args.tokens), args.iters)
    print_table(result, ["fusion", "layers", "tokens", "matches", "unfused_us", "fused_us", "speedup"])
    print("wrote", write_result("bench_rope_fusion", {"device": "cpu", "threads": torch.get_num_threads(),
                                                      "model": args.model, "rows": result}, args.out))


if __name__ == "__main__":
    main()
