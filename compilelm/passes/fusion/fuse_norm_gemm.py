"""Projection + residual add + weightless RMSNorm + projection -> one op (CUDA, post-grad, per piece).

Where this pass's `prepare_model` folded a layer's norm weights into qkv_proj and gate_up_proj
(Llama-3.1-8B on an H100; see "Load time" below), each norm sits between two of our GEMMs: o_proj -> add -> norm ->
gate_up_proj with its SiLU-and-mul, and down_proj -> add -> norm -> the next layer's QKV projection
with RoPE and the cache write. Both become one op (compilelm/ops/norm_gemm.py), two kernels at 3-64
rows on sm_90: the first GEMM adds the residual and sums squares per 64 columns, the second scales
its accumulators by the norm's rstd. No norm kernel between them.

    before (bf16)                                            after
    y = compilelm.linear(x, w_o)                          f = compilelm.linear_add_rms_norm_gate_up_silu_mul(
    h = aten.add(y, residual)                                        x, w_o, residual, eps, w_gu)
    hf = convert(h, f32)                               ==>   act, h = f[0], f[1]
    rstd = rsqrt(mean(pow(hf, 2), [-1]) + eps)
    act = compilelm.gate_up_silu_mul(convert(hf * rstd, bf16), w_gu)

and with `compilelm.qkv_rope(normed, w_qkv, positions, cos_sin_cache, num_heads)` after the norm:
`compilelm.linear_add_rms_norm_qkv_rope(x, w_d, residual, eps, w_qkv, positions, cos_sin_cache,
num_heads)`, which writes the next attention layer's cache as qkv_rope does. The first layer's norm
(after the embedding) and the final one (before the LM head) have no GEMM before them and stay.

Two graph patterns (Inductor's pattern matcher), one per consumer: the weightless norm is
spelled out node by node (`_weightless_rms_norm`); qkv_rope's head count is captured
(`KeywordArg`), not traced in. Only norms whose every node feeds nothing else, and products that
feed nothing but the add, match. The rewrite changes the roundings a little: see
compilelm/ops/norm_gemm.py and docs/perf.md ("fuse_norm_gemm"); `passes.fuse_norm_gemm=False`
keeps the unfused ones.

Load time: the fused ops' fast path scales a GEMM's accumulators by the norm's per-row rstd, which
leaves no place for the norm's weight g. So `prepare_model` folds it into the projection after
each norm, before tracing:

    rms_norm(h, g) @ W.T  ==  rms_norm(h, None) @ T(W * g).T

for input_layernorm -> qkv_proj and post_attention_layernorm -> gate_up_proj (equal in exact
arithmetic; in bf16 the operand W * g is rounded once where the unfolded model rounds the normed
activations times g). It folds only where this pass will take both sides of every layer
(`takes_layers`): CUDA sm_90 with Triton, bf16/fp16 weights (not FP8), one rank, Llama-family
layers without QK-norm whose shapes both ops take, the SiLU in gate_up_proj's epilogue, and the
passes that make this one's inputs on. A model that does not qualify is left exactly as loaded.
"""

from __future__ import annotations

import operator

import torch
from torch import nn
from torch._inductor import pattern_matcher as pm
from torch._inductor.pattern_matcher import MULTIPLE, CallFunction, KeywordArg, Match

from compilelm.distributed.parallel_state import get_tp_size
from compilelm.ops import norm_gemm
from compilelm.ops.gemm import MAX_INTERMEDIATE
from compilelm.passes.fusion_pass import FusionPass

ops = torch.ops.compilelm
aten = torch.ops.aten
prims = torch.ops.prims
FUSED = {ops.gate_up_silu_mul.default: ops.linear_add_rms_norm_gate_up_silu_mul.default,
         ops.qkv_rope.default: ops.linear_add_rms_norm_qkv_rope.default}




def _weightless_rms_norm(h: pm.PatternExpr) -> pm.PatternExpr:
    """convert(convert(h, f32) * rsqrt(mean(pow(., 2), dims, True) + eps), dtype): rms_norm(h, None)."""
    hf = CallFunction(prims.convert_element_type.default, h, torch.float32, _users=2)
    var = CallFunction(aten.mean.dim, CallFunction(aten.pow.Tensor_Scalar, hf, 2), KeywordArg("dims"), True)
    rstd = CallFunction(aten.rsqrt.default, CallFunction([aten.add.Tensor, aten.add.Scalar], var, KeywordArg("eps")))
    return CallFunction(prims.convert_element_type.default, CallFunction(aten.mul.Tensor, hf, rstd),
                        KeywordArg("dtype"))


# h = linear(x, w) + residual, used on by the next layer (the residual stream), normed for the consumer
_h = CallFunction(aten.add.Tensor, CallFunction(ops.linear.default, KeywordArg("x"), KeywordArg("w")),
                  KeywordArg("residual"), _users=MULTIPLE)
_normed = _weightless_rms_norm(_h)
PATTERNS = [  # (consumer of the normed h, the fused op)
    (CallFunction(ops.gate_up_silu_mul.default, _normed, KeywordArg("w2")),
     ops.linear_add_rms_norm_gate_up_silu_mul.default),
    (CallFunction(ops.qkv_rope.default, _normed, KeywordArg("w2"), KeywordArg("positions"), KeywordArg("cos_sin_cache"),
                  KeywordArg("num_heads")), ops.linear_add_rms_norm_qkv_rope.default),
]
FUSED = {pattern.fns[0]: fused for pattern, fused in PATTERNS}  # consumer op -> the fused op


class NormGemmFusionPass(FusionPass):
    def applies_to(self, graph: torch.fx.Graph) -> bool:
        return any(graph.find_nodes(op="call_function", target=t) for t in FUSED)

    def register(self) -> None:
        for pattern, _ in PATTERNS:
            pm.register_graph_pattern(pattern, extra_check=_same_dtype_last_dim, pass_dict=self.patterns)(_rewrite)

    def prepare_model(self, model: nn.Module) -> str | None:
        layers = self.takes_layers(model)
        if not layers:
            return None
        fold_norm_weights(layers)
        return (f"the input and post-attention RMSNorm weights of {len(layers)} layers folded into qkv_proj "
                "and gate_up_proj")

    def takes_layers(self, model: nn.Module) -> list[nn.Module]:
        """The decoder layers whose norms this pass will move into the GEMMs around them, else []."""
        p = self.config
        if not (p.route_linear and (p.fuse_act_linear or p.fuse_qkv_rope)) or get_tp_size() != 1:
            return []
        layers = _llama_layers(model)
        if not layers or norm_gemm.triton is None:
            return []
        qkv = layers[0].self_attn.qkv_proj.weight
        if (qkv.device.type != "cuda" or qkv.dtype not in (torch.bfloat16, torch.float16)
                or torch.cuda.get_device_capability(qkv.device) != (9, 0)):
            return []
        return layers if shapes_fit(layers[0]) else []



def _same_dtype_last_dim(match: Match) -> bool:
    """The norm is over the last dim, in fp32, rounded back to h's dtype, with a float eps."""
    h = next(n for n in match.nodes if n.target is aten.add.Tensor)
    return (list(match.kwargs["dims"]) in ([-1], [1]) and isinstance(match.kwargs["eps"], float)
            and match.kwargs["dtype"] == h.meta["val"].dtype)


def _rewrite(match: Match, x, w, residual, eps, w2, **rest) -> None:
    """consumer(rms_norm(linear(x, w) + residual, None), w2, ...) -> the fused op's (out, h)."""
    consumer = match.output_node()
    graph = consumer.graph
    h = next(n for n in match.nodes if n.target is aten.add.Tensor)
    with graph.inserting_before(h):  # the add's place: every input is defined, every user of h comes after
        fused = graph.call_function(FUSED[consumer.target], (x, w, residual, eps, *consumer.args[1:]))
        out = graph.call_function(operator.getitem, (fused, 0))
        new_h = graph.call_function(operator.getitem, (fused, 1))
    # only the values: other metadata (Inductor's eager_input_vals) describes the old ops' arguments
    fused.meta = {"val": (consumer.meta["val"], h.meta["val"])}
    out.meta, new_h.meta = {"val": consumer.meta["val"]}, {"val": h.meta["val"]}
    consumer.replace_all_uses_with(out)
    h.replace_all_uses_with(new_h)
    match.erase_nodes()


def shapes_fit(layer: nn.Module) -> bool:
    """Whether both fused ops take the layer's weights (norm_gemm.shapes_fit: o_proj then gate_up_proj,
    down_proj then qkv_proj), and gate_up_proj is wider than `passes.fuse_act_linear` moves the
    SiLU out of (past MAX_INTERMEDIATE the SiLU-and-mul is gate_up's epilogue, which the MLP side
    fuses into; below, down_proj's prologue, and neither side matches)."""
    attn, mlp = layer.self_attn, layer.mlp
    return (norm_gemm.shapes_fit(attn.o_proj.weight.shape, mlp.gate_up_proj.weight.shape)
            and norm_gemm.shapes_fit(mlp.down_proj.weight.shape, attn.qkv_proj.weight.shape)
            and mlp.gate_up_proj.weight.shape[0] // 2 > MAX_INTERMEDIATE)


def fold_norm_weights(layers: list[nn.Module]) -> None:
    """Folds each layer's two norm weights into qkv_proj / gate_up_proj (their norms keep no weight)."""
    with torch.no_grad():
        for layer in layers:
            for norm, linear in ((layer.input_layernorm, layer.self_attn.qkv_proj),
                                 (layer.post_attention_layernorm, layer.mlp.gate_up_proj)):
                # weight: [N, K]; the norm's g: [K], per input column
                linear.weight.copy_((linear.weight.float() * norm.weight.float()).to(linear.weight.dtype))
                norm.weight = None


def _llama_layers(model: nn.Module) -> list[nn.Module]:
    """The decoder layers of a Llama-family model without QK-norm whose norms still have their
    weights (not folded yet), else []."""
    layers = getattr(getattr(model, "model", None), "layers", None)
    if layers is None:
        return []
    ok = all(hasattr(layer, "input_layernorm") and hasattr(layer, "post_attention_layernorm")
             and isinstance(getattr(layer.input_layernorm, "weight", None), torch.Tensor)
             and hasattr(layer.self_attn, "qkv_proj") and hasattr(layer.self_attn, "o_proj")
             and not hasattr(layer.self_attn, "q_norm") and hasattr(layer.mlp, "gate_up_proj")
             and hasattr(layer.mlp, "down_proj") for layer in layers)
    return list(layers) if ok else []
