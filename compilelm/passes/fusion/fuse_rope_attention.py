"""RoPE (+ Qwen3's QK-norm) + attention -> one op that rotates q/k inside attention.

Whole-graph stage: the rotary embedding sits in the piece *before* the attention op and the
attention op is where the graph is split, so the fusion has to see across the split (this is
where vLLM needs a full graph). After the rewrite the fused op is the splitting op and the RoPE
math is gone from the pieces. Before (one layer, fp32, as the aten graph shows it):

    index: "f32[s72, 64]" = aten.index.Tensor(cos_sin_cache, [positions])
    split = aten.split.Tensor(index, 32, -1);  cos = split[0];  sin = split[1]
    split_1 = aten.split.Tensor(view(q, [s72, 9, 64]), 32, -1);  q1 = split_1[0];  q2 = split_1[1]
    cos_ = aten.unsqueeze(cos, 1);  sin_ = aten.unsqueeze(sin, 1)
    cat = aten.cat([sub(mul(q1, cos_), mul(q2, sin_)), add(mul(q2, cos_), mul(q1, sin_))], -1)
    ... the same for k ...
    attn: "f32[s72, 576]" = compilelm.unified_attention(view(cat), view(cat_1), v, 'model.layers.0.self_attn.attn')

After (with `passes.fuse_qkv_rope` off):

    attn: "f32[s72, 576]" = compilelm.unified_attention_rope(q, k, v, positions, cos_sin_cache, 64,
                                                             'model.layers.0.self_attn.attn')

and with `passes.fuse_qkv_rope` (the default at -O2) RoPE and the KV-cache write stay in the
piece before the split (this SmolLM2-135M layer), one op that the QKV projection takes in on CUDA
(`QKVRopeFusionPass`):

    rotated: "f32[s72, 576]" = compilelm.rope_cache(q, k, v, positions, cos_sin_cache, 64)
    attn: "f32[s72, 576]" = compilelm.unified_attention_rotated(rotated, 'model.layers.0.self_attn.attn')

Qwen3 (per-head RMSNorm of q and k before RoPE) becomes `compilelm.unified_attention_qknorm_rope(
q, k, v, q_norm_weight, k_norm_weight, eps, positions, cos_sin_cache, head_dim, layer_name)`.

How: the attention op's `layer_name` is a string, which Inductor's pattern matcher cannot leave
open, so the rewrite is two steps. (1) Patterns (`pattern_qknorm_rope`, then `pattern_rope`)
replace the rotary embedding of one tensor by a functional op `compilelm::rope(x, cos, sin)` /
`compilelm::qknorm_rope(x, weight, cos, sin, eps)` (compilelm/ops/rope.py). (2) An attention op whose q and k are such
ops (used by nothing else), rotated by the same `cos, sin = cos_sin_cache[positions].chunk(2)`,
becomes the fused op. A rope op that cannot be fused stays in the graph: it computes the same
as the ops it replaced.
"""

from __future__ import annotations

import operator

import torch
from torch._inductor import pattern_matcher as pm

from compilelm.ops.norm import rms_norm
from compilelm.ops.rope import apply_rope
from compilelm.passes.debug.verify import STAND_INS, stand_in
from compilelm.passes.fusion_pass import FusionPass

ops = torch.ops.compilelm
aten = torch.ops.aten


# --verify stands attention in by a deterministic function; the fused ops stand in as their
# RoPE (QK-norm) prologue followed by that function, like the graph before the rewrite.

def _stand_in_rope(q, k, v, positions, cos_sin_cache, head_dim, layer_name):
    cos, sin = cos_sin_cache[positions].chunk(2, dim=-1)
    return stand_in(apply_rope(q, cos, sin, head_dim), apply_rope(k, cos, sin, head_dim), v)


def _stand_in_qknorm_rope(q, k, v, q_w, k_w, eps, positions, cos_sin_cache, head_dim, layer_name):
    n = q.shape[0]
    q = rms_norm(q.view(n, -1, head_dim), q_w, eps).view(n, -1)
    k = rms_norm(k.view(n, -1, head_dim), k_w, eps).view(n, -1)
    return _stand_in_rope(q, k, v, positions, cos_sin_cache, head_dim, layer_name)


STAND_INS["compilelm::unified_attention_rope"] = _stand_in_rope
STAND_INS["compilelm::unified_attention_qknorm_rope"] = _stand_in_qknorm_rope
# the small-model form: rope_cache stands in for the whole attention, the attention op passes it on
STAND_INS["compilelm::rope_cache"] = lambda q, k, v, positions, cos_sin_cache, head_dim: _stand_in_rope(
    q, k, v, positions, cos_sin_cache, head_dim, None)
STAND_INS["compilelm::unified_attention_rotated"] = lambda q, layer_name: q


# -- patterns (the model's own RoPE / RMSNorm code, so they stay in sync with it) ------------

def pattern_rope(x, cos, sin):
    # x: [num_tokens, num_heads * head_dim]; cos, sin: [num_tokens, head_dim // 2]
    return apply_rope(x, cos, sin, 2 * cos.shape[-1])


def replace_rope(x, cos, sin):
    return ops.rope(x, cos, sin)


def pattern_qknorm_rope(x, weight, cos, sin, eps):
    # weight: [head_dim] (one RMSNorm shared by every head). The view spells the head count out,
    # like Qwen3Attention.qk_norm: the matcher checks a match by retracing with its shapes.
    n, head_dim = x.shape[0], 2 * cos.shape[-1]
    x = rms_norm(x.view(n, x.shape[1] // head_dim, head_dim), weight, eps).view(n, -1)
    return apply_rope(x, cos, sin, head_dim)


def replace_qknorm_rope(x, weight, cos, sin, eps):
    return ops.qknorm_rope(x, weight, cos, sin, eps)


def _examples(dtype, cos_dtype, qk_norm: bool):
    n, head_dim = 8, 16
    x, cos, sin = torch.empty(n, 4 * head_dim, dtype=dtype), *torch.empty(2, n, head_dim // 2, dtype=cos_dtype)
    return [x, torch.empty(head_dim, dtype=dtype), cos, sin] if qk_norm else [x, cos, sin]


class RopeAttentionFusionPass(FusionPass):
    stage = "whole_graph"

    _registered: tuple | None = None  # (patterns, rope_patterns): traced once per process

    def config_dict(self) -> dict:
        return {"fuse_qkv_rope": self.config.fuse_qkv_rope}

    def register(self) -> None:
        cls = type(self)
        if cls._registered is None:
            self.rope_patterns = pm.PatternMatcherPass(pass_name=f"{self.name}.rope")
            # fp32 (the cast of cos/sin is a no-op) and 16-bit activations with an fp32 or 16-bit cache.
            for dtype, cos_dtype in ((torch.float32, torch.float32), (torch.bfloat16, torch.float32),
                                     (torch.bfloat16, torch.bfloat16)):
                self.replace(pattern_qknorm_rope, replace_qknorm_rope, _examples(dtype, cos_dtype, True),
                             scalar_workaround={"eps": 1e-6})
                self.replace(pattern_rope, replace_rope, _examples(dtype, cos_dtype, False), into=self.rope_patterns)
            cls._registered = (self.patterns, self.rope_patterns)
        self.patterns, self.rope_patterns = cls._registered

    def run(self, graph: torch.fx.Graph) -> int:
        _share_size_inputs(graph)
        self.patterns.apply(graph)  # QK-norm + RoPE first: plain RoPE is a part of it
        self.rope_patterns.apply(graph)
        fused = 0
        for attn in list(graph.find_nodes(op="call_function", target=ops.unified_attention.default)):
            fused += _fuse(graph, attn, self.config.fuse_qkv_rope)
        graph.eliminate_dead_code()
        return fused


def _share_size_inputs(graph: torch.fx.Graph) -> None:
    """Dynamo passes the token count once per input that has it (input_ids, positions). Use one
    placeholder for each symbol: the matcher retraces a match with one symbol per size and
    would otherwise see `view(x, [arg1_1, ...])` and `expand(cos, [arg8_1, ...])` as different."""
    first: dict[str, torch.fx.Node] = {}
    for node in graph.find_nodes(op="placeholder"):
        val = node.meta.get("val")
        if isinstance(val, torch.SymInt) and val.node.expr.is_Symbol:
            kept = first.setdefault(str(val.node.expr), node)
            if kept is not node:
                node.replace_all_uses_with(kept)


def _fuse(graph: torch.fx.Graph, attn: torch.fx.Node, split_rope: bool) -> int:
    """unified_attention(rope(q), rope(k), v), both rotated by the same cos/sin from
    cos_sin_cache[positions] -> the fused op (with `split_rope`, without QK-norm: rope_cache and
    unified_attention_rotated). Returns 1 if rewritten."""
    q, k, v, layer_name = attn.args
    if not all(isinstance(t, torch.fx.Node) and len(t.users) == 1 for t in (q, k)) or q.target != k.target:
        return 0
    if q.target == ops.rope.default:
        (q_in, cos, sin), (k_in, *k_cos_sin) = q.args, k.args
        target, norm_args = ops.unified_attention_rope.default, ()
    elif q.target == ops.qknorm_rope.default:
        (q_in, q_w, cos, sin, eps), (k_in, k_w, *k_cos_sin, k_eps) = q.args, k.args
        if eps != k_eps:
            return 0
        target, norm_args = ops.unified_attention_qknorm_rope.default, (q_w, k_w, eps)
    else:
        return 0
    source = _cos_sin_source(cos, sin)
    if source is None or k_cos_sin != [cos, sin]:
        return 0
    cache, positions = source
    head_dim = 2 * int(cos.meta["val"].shape[-1])
    with graph.inserting_before(attn):
        if split_rope and not norm_args:  # RoPE before the split
            rotated = graph.call_function(ops.rope_cache.default, (q_in, k_in, v, positions, cache, head_dim))
            rotated.meta = dict(attn.meta)  # (shaped like attention's output)
            fused = graph.call_function(ops.unified_attention_rotated.default, (rotated, layer_name))
        else:
            fused = graph.call_function(target, (q_in, k_in, v, *norm_args, positions, cache, head_dim, layer_name))
    fused.meta = dict(attn.meta)
    attn.replace_all_uses_with(fused)
    graph.erase_node(attn)
    return 1


def _cos_sin_source(cos, sin) -> tuple[torch.fx.Node, torch.fx.Node] | None:
    """(cos_sin_cache, positions) if cos, sin = cos_sin_cache[positions].chunk(2, -1)."""
    if not all(isinstance(t, torch.fx.Node) and t.target is operator.getitem for t in (cos, sin)):
        return None
    split = cos.args[0]
    if sin.args[0] is not split or (cos.args[1], sin.args[1]) != (0, 1) or split.target != aten.split.Tensor:
        return None
    index = split.args[0]
    if index.target != aten.index.Tensor or len(index.args[1]) != 1:
        return None
    if index.meta["val"].shape[-1] != 2 * cos.meta["val"].shape[-1]:  # chunk(2, dim=-1)
        return None
    return index.args[0], index.args[1][0]
