"""QKV projection + RoPE + KV-cache write -> one op (CUDA, post-grad, per piece).

With this pass on, `RopeAttentionFusionPass` leaves RoPE and the KV-cache write in the piece
before the attention op, as `compilelm.rope_cache`. Where its q, k and v are the three parts of
a QKV projection (linear, or `RMSNormLinearFusionPass`'s normed ops), the rotation moves
into the projection's kernel: at decode sizes (M <= 2) its blocks compute the rotation pairs of
a head and write the rotated query, and the key and value rows to their cache slots
(csrc/cuda/skinny_mm.cu, kRope); at 3-64 rows on an H100 the Hopper GEMM does the same in its
epilogue (compilelm/ops/hopper_gemm.py, hopper_mm_rope_out). One kernel per layer fewer, and
decode attention, launched next, starts while the projection runs. For more rows the op runs
the projection, then rope_and_cache, as the graph before. On an H100: SmolLM2-135M batch 1
(context 1024) decode graph 0.591-0.599 -> 0.566-0.571 ms (benchmarks/results/
qkv_rope_fusion_ab_gpu.log). Llama-3.1-8B (benchmarks/results/qkv_rope_hopper_gpu.log, this pass
on vs off, where off puts RoPE into the decode attention kernel): batch 64 9.02-9.03 -> 8.91-9.00
ms a step, batch 1 5.78-5.80 -> 5.86-5.90 ms (the kRope projection then attention is slower than
the plain projection then attention with RoPE inside at one row; the batch-64 target is the one
still missed, so the pass stays on for every width).

    before (one layer, bf16)                               after
    f = compilelm.fused_add_rms_norm_linear(            f = compilelm.fused_add_rms_norm_qkv_rope(
            x, residual, norm_w, eps, w_qkv)                       x, residual, norm_w, eps, w_qkv,
    qkv, residual_out = f[0], f[1]                 ==>             positions, cos_sin_cache, 9)
    split = aten.split_with_sizes(qkv, [576, 192, 192], -1)  rotated, residual_out = f[0], f[1]
    rotated = compilelm.rope_cache(split[0], split[1], split[2],
            positions, cos_sin_cache, 64)

the first layer's `rms_norm_linear` -> `compilelm.rms_norm_qkv_rope`, and a plain
`linear(x, w_qkv)` (a model too wide for the norm to fuse: Llama-3.1-8B) ->
`compilelm.qkv_rope(x, w_qkv, positions, cos_sin_cache, num_heads)`. No such op names its layer:
they write the cache of the next attention layer (ForwardContext.next_kv_cache), so every layer's
piece stays the same code, compiled once. The rewrite is a walk over the rope_cache
nodes rather than a pattern: the split sizes (the head counts) vary from model to model.
"""

from __future__ import annotations

import operator

import torch

from compilelm.passes.fusion import fuse_rope_attention  # noqa: F401  (rope_cache's stand-in, which ours calls)
from compilelm.passes.base import CompilePass
from compilelm.passes.debug.verify import STAND_INS

ops = torch.ops.compilelm
aten = torch.ops.aten
FUSED = {ops.linear.default: ops.qkv_rope.default,  # projection op -> the op with RoPE
         ops.rms_norm_linear.default: ops.rms_norm_qkv_rope.default,
         ops.fused_add_rms_norm_linear.default: ops.fused_add_rms_norm_qkv_rope.default}


class QKVRopeFusionPass(CompilePass):
    def applies_to(self, graph: torch.fx.Graph) -> bool:
        return bool(graph.find_nodes(op="call_function", target=ops.rope_cache.default))

    def run(self, graph: torch.fx.Graph) -> int:
        return sum(_fuse(graph, node) for node in list(graph.find_nodes(op="call_function",
                                                                         target=ops.rope_cache.default)))


def _fuse(graph: torch.fx.Graph, rope_cache: torch.fx.Node) -> int:
    """rope_cache(q, k, v, ...) of split_with_sizes(projection) -> the fused op. 1 if rewritten."""
    q, k, v, positions, cos_sin_cache, head_dim = rope_cache.args
    parts = (q, k, v)
    if not all(isinstance(p, torch.fx.Node) and p.target is operator.getitem and len(p.users) == 1 for p in parts):
        return 0
    split = q.args[0]
    if split.target != aten.split_with_sizes.default or [p.args for p in parts] != [(split, i) for i in range(3)]:
        return 0
    y, sizes, *dim = split.args
    if len(split.users) != 3 or dim not in ([-1], [1]) or len(y.users) != 1 or not isinstance(head_dim, int):
        return 0
    if y.target in FUSED:  # linear, rms_norm_linear: y is the projection
        proj, residual_out = y, None
    elif y.target is operator.getitem and y.args[1] == 0 and y.args[0].target in FUSED:
        proj = y.args[0]  # fused_add_rms_norm_linear: y = proj[0], proj[1] = residual_out
        outs = {u.args[1]: u for u in proj.users}
        if set(outs) - {0, 1}:
            return 0
        residual_out = outs.get(1)
    else:
        return 0
    if sizes[0] % head_dim or sizes[1] != sizes[2]:
        return 0
    target = FUSED[proj.target]
    with graph.inserting_after(proj):  # where the projection was: before every user of its residual
        fused = graph.call_function(target, (*proj.args, positions, cos_sin_cache, sizes[0] // head_dim))
    # only the values: other metadata (Inductor's eager_input_vals) describes the old ops' arguments
    if proj is y:
        fused.meta = {"val": rope_cache.meta["val"]}
        rotated = fused
    else:
        fused.meta = {"val": (rope_cache.meta["val"], proj.meta["val"][1])}
        with graph.inserting_after(fused):
            rotated = graph.call_function(operator.getitem, (fused, 0))
        rotated.meta = {"val": rope_cache.meta["val"]}
        if residual_out is not None:
            with graph.inserting_after(rotated):
                new_residual = graph.call_function(operator.getitem, (fused, 1))
            new_residual.meta = {"val": residual_out.meta["val"]}
            residual_out.replace_all_uses_with(new_residual)
    rope_cache.replace_all_uses_with(rotated)
    for node in (rope_cache, *parts, split, y, *([] if proj is y else [residual_out, proj])):
        if node is not None:
            graph.erase_node(node)
    return 1


def _stand_in(x, *args):
    """The graph before: the projection, then rope_cache's stand-in (fuse_rope_attention.py)."""
    *proj_args, positions, cos_sin_cache, num_heads = args
    if len(proj_args) == 4:
        qkv, residual_out = ops.fused_add_rms_norm_linear(x, *proj_args)
    elif len(proj_args) == 3:
        qkv, residual_out = ops.rms_norm_linear(x, *proj_args), None
    else:
        qkv, residual_out = ops.linear(x, *proj_args), None
    head_dim = cos_sin_cache.shape[1]
    kv = (qkv.shape[1] - num_heads * head_dim) // 2
    q, k, v = qkv.split([num_heads * head_dim, kv, kv], dim=-1)
    rotated = STAND_INS["compilelm::rope_cache"](q, k, v, positions, cos_sin_cache, head_dim)
    return rotated if residual_out is None else (rotated, residual_out)


STAND_INS["compilelm::qkv_rope"] = _stand_in
STAND_INS["compilelm::rms_norm_qkv_rope"] = _stand_in
STAND_INS["compilelm::fused_add_rms_norm_qkv_rope"] = _stand_in
