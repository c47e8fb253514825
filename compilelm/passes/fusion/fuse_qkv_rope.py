"""QKV projection + RoPE + KV-cache write -> one op (CUDA, post-grad, per piece).

With this pass on, `RopeAttentionFusionPass` leaves RoPE and the KV-cache write in the piece
before the attention op, as `compilelm.rope_cache`. Where its q, k and v are the three parts of
a QKV projection (linear, or `RMSNormLinearFusionPass`'s normed ops), the rotation moves
into the projection's kernel: at decode sizes (M <= 2) its blocks compute the rotation pairs of
a head and write the rotated query, and the key and value rows to their cache slots
(csrc/cuda/skinny_mm.cu, kRope); at 3-64 rows on an H100 the Hopper GEMM does the same in its
epilogue (compilelm/ops/hopper_gemm.py, hopper_mm_rope_out). One kernel per layer fewer, and
decode attention, launched next, starts while the projection runs. For more rows the op runs
the projection, then rope_and_cache, as the graph before (docs/perf.md, "fuse_qkv_rope").

    before (one layer, bf16)                                after
    f = compilelm.fused_add_rms_norm_linear(                f = compilelm.fused_add_rms_norm_qkv_rope(
            x, residual, norm_w, eps, w_qkv)                        x, residual, norm_w, eps, w_qkv,
    qkv, residual_out = f[0], f[1]                   ==>            positions, cos_sin_cache, 9)
    split = aten.split_with_sizes(qkv, [576, 192, 192], -1) rotated, residual_out = f[0], f[1]
    rotated = compilelm.rope_cache(split[0], split[1], split[2],
            positions, cos_sin_cache, 64)

the first layer's `rms_norm_linear` -> `compilelm.rms_norm_qkv_rope`, and a plain
`linear(x, w_qkv)` (a model too wide for the norm to fuse: Llama-3.1-8B) ->
`compilelm.qkv_rope(x, w_qkv, positions, cos_sin_cache, num_heads)`. No such op names its layer:
they write the cache of the next attention layer (compilelm/forward_context.py), so every
layer's piece stays the same code, compiled once.

Three graph patterns (Inductor's pattern matcher), one per projection op; the split sizes and the
head dimension are captured (`KeywordArg`), not traced in, since they vary from model to model,
and `_head_split` checks them. The handler rewrites by hand: the fused op has a second output
(the residual) that other nodes use.
"""

from __future__ import annotations

import operator

import torch
from torch._inductor import pattern_matcher as pm
from torch._inductor.pattern_matcher import MULTIPLE, CallFunction, KeywordArg, Match

from compilelm.passes.debug.verify import STAND_INS
from compilelm.passes.fusion import fuse_rope_attention  # noqa: F401  (rope_cache's stand-in, which ours calls)
from compilelm.passes.fusion_pass import FusionPass

ops = torch.ops.compilelm
aten = torch.ops.aten


def _rope_cache_of(qkv: pm.PatternExpr) -> pm.PatternExpr:
    """rope_cache(q, k, v, positions, cos_sin_cache, head_dim) of q, k, v = split_with_sizes(qkv, sizes, dim)."""
    split = CallFunction(aten.split_with_sizes.default, qkv, KeywordArg("sizes"), KeywordArg("dim"), _users=3)
    q, k, v = (CallFunction(operator.getitem, split, i) for i in range(3))
    return CallFunction(ops.rope_cache.default, q, k, v, KeywordArg("positions"), KeywordArg("cos_sin_cache"),
                        KeywordArg("head_dim"))


_x, _w, _norm_w, _eps, _residual = (KeywordArg(n) for n in ("x", "w", "norm_w", "eps", "residual"))
_add_norm_linear = CallFunction(ops.fused_add_rms_norm_linear.default, _x, _residual, _norm_w, _eps, _w,
                                _users=MULTIPLE)
# (projection pattern, the fused op, the projection's arguments in the fused op's order)
PATTERNS = [
    (CallFunction(ops.linear.default, _x, _w), ops.qkv_rope.default, ("x", "w")),
    (CallFunction(ops.rms_norm_linear.default, _x, _norm_w, _eps, _w), ops.rms_norm_qkv_rope.default,
     ("x", "norm_w", "eps", "w")),
    (CallFunction(operator.getitem, _add_norm_linear, 0), ops.fused_add_rms_norm_qkv_rope.default,
     ("x", "residual", "norm_w", "eps", "w")),
]


PROJECTIONS = (ops.linear.default, ops.rms_norm_linear.default, ops.fused_add_rms_norm_linear.default)


class QKVRopeFusionPass(FusionPass):
    def applies_to(self, graph: torch.fx.Graph) -> bool:
        return bool(graph.find_nodes(op="call_function", target=ops.rope_cache.default))

    def register(self) -> None:
        for projection, fused, names in PATTERNS:
            pm.register_graph_pattern(_rope_cache_of(projection), extra_check=_head_split,
                                      pass_dict=self.patterns)(_rewrite(fused, names))


def _head_split(match: Match) -> bool:
    """q | k | v split along the last dim into whole query heads and two equal K / V parts."""
    sizes, dim, head_dim = (match.kwargs[k] for k in ("sizes", "dim", "head_dim"))
    return (isinstance(head_dim, int) and dim in (-1, 1) and len(sizes) == 3 and all(isinstance(n, int) for n in sizes)
            and sizes[0] % head_dim == 0 and sizes[1] == sizes[2])


def _rewrite(fused_op, names: tuple[str, ...]):
    """The handler of one pattern: rope_cache(split(projection)) -> fused_op(projection's args, ...)."""

    def handler(match: Match, **kw) -> None:
        rope_cache = match.output_node()
        graph = rope_cache.graph
        proj = next(n for n in match.nodes if n.target in PROJECTIONS)
        args = (*(kw[n] for n in names), kw["positions"], kw["cos_sin_cache"], kw["sizes"][0] // kw["head_dim"])
        with graph.inserting_after(proj):  # where the projection was: before every user of its residual
            fused = graph.call_function(fused_op, args)
        # only the values: other metadata (Inductor's eager_input_vals) describes the old ops' arguments
        if proj.target is not ops.fused_add_rms_norm_linear.default:
            fused.meta, rotated = {"val": rope_cache.meta["val"]}, fused
        else:  # proj[0] fed the split; proj[1], the residual, now comes from the fused op
            fused.meta = {"val": (rope_cache.meta["val"], proj.meta["val"][1])}
            with graph.inserting_after(fused):
                rotated = graph.call_function(operator.getitem, (fused, 0))
            rotated.meta = {"val": rope_cache.meta["val"]}
            for old in [u for u in proj.users if u.args[1] == 1]:
                with graph.inserting_after(rotated):
                    residual = graph.call_function(operator.getitem, (fused, 1))
                residual.meta = {"val": old.meta["val"]}
                old.replace_all_uses_with(residual)
                graph.erase_node(old)
        rope_cache.replace_all_uses_with(rotated)
        match.erase_nodes()

    return handler


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
