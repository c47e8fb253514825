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

A walk over the consumers, not a pattern: qkv_rope's head count is an int argument, which
Inductor's pattern matcher would take as a constant. Only norms whose every node feeds nothing
else, and products that feed nothing but the add, match.

On an H100, Llama-3.1-8B dummy bf16 at mean context 1024, this pass (and the fold) on vs off, one
engine per process (benchmarks/results/decode_session23_gpu.log): batch 64 8.809 -> 8.756 ms a step
(decode graph 8.855 -> 8.802; 227 -> 164 kernels, ~262.5 us a layer); batch 1 5.823 -> 5.812 (there
the op runs the kernels the graph ran). An 8-layer chain of the kernels alone had promised 4-7 us a
layer: its Inductor norm kernels were slower than the engine's. The greedy tokens of that random
model differ from the unfused engine's after the third (its logits are nearly tied; the rounding
moves, see compilelm/ops/norm_gemm.py); `passes.fuse_norm_gemm=False` keeps the unfused roundings.

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

from compilelm.distributed.parallel_state import get_tp_size
from compilelm.ops import norm_gemm
from compilelm.ops.gemm import MAX_INTERMEDIATE
from compilelm.passes.base import CompilePass

ops = torch.ops.compilelm
aten = torch.ops.aten
prims = torch.ops.prims
FUSED = {ops.gate_up_silu_mul.default: ops.linear_add_rms_norm_gate_up_silu_mul.default,
         ops.qkv_rope.default: ops.linear_add_rms_norm_qkv_rope.default}


class NormGemmFusionPass(CompilePass):
    def applies_to(self, graph: torch.fx.Graph) -> bool:
        return any(graph.find_nodes(op="call_function", target=t) for t in FUSED)

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

    def run(self, graph: torch.fx.Graph) -> int:
        consumers = [n for t in FUSED for n in graph.find_nodes(op="call_function", target=t)]
        return sum(_fuse(graph, node) for node in consumers)


def _only_user(node, user) -> bool:
    return isinstance(node, torch.fx.Node) and list(node.users) == [user]


def _weightless_norm(x: torch.fx.Node):
    """(h, eps, the norm's nodes) if x = convert(convert(h, f32) * rsqrt(mean(pow(., 2), [-1], True)
    + eps), h's dtype), else None."""
    if x.target != prims.convert_element_type.default or len(x.users) != 1:
        return None
    mul = x.args[0]
    if not (_only_user(mul, x) and mul.target == aten.mul.Tensor and len(mul.args) == 2):
        return None
    hf, rsqrt = mul.args
    if not (_only_user(rsqrt, mul) and rsqrt.target == aten.rsqrt.default):
        return None
    add = rsqrt.args[0]
    if not (_only_user(add, rsqrt) and add.target in (aten.add.Tensor, aten.add.Scalar)
            and isinstance(add.args[1], float)):
        return None
    mean = add.args[0]
    if not (_only_user(mean, add) and mean.target == aten.mean.dim and list(mean.args[1]) in ([-1], [1])
            and (mean.args[2] if len(mean.args) > 2 else mean.kwargs.get("keepdim"))):
        return None
    square = mean.args[0]
    if not (_only_user(square, mean) and square.target == aten.pow.Tensor_Scalar and square.args == (hf, 2)):
        return None
    if not (isinstance(hf, torch.fx.Node) and hf.target == prims.convert_element_type.default
            and hf.args[1] == torch.float32 and set(hf.users) == {square, mul}):
        return None
    h = hf.args[0]
    h_val = h.meta.get("val") if isinstance(h, torch.fx.Node) else None
    if not isinstance(h_val, torch.Tensor) or x.args[1] != h_val.dtype:
        return None
    return h, add.args[1], [x, mul, rsqrt, add, mean, square, hf]


def _fuse(graph: torch.fx.Graph, consumer: torch.fx.Node) -> int:
    """consumer(weightless_rms_norm(linear(x, w) + residual), ...) -> the fused op. 1 if rewritten."""
    normed, *rest = consumer.args
    if not isinstance(normed, torch.fx.Node) or consumer.kwargs:
        return 0
    found = _weightless_norm(normed)
    if found is None:
        return 0
    h, eps, norm_nodes = found
    if h.target != aten.add.Tensor or len(h.args) != 2:
        return 0
    y, residual = h.args
    if not (_only_user(y, h) and y.target == ops.linear.default) or not isinstance(residual, torch.fx.Node):
        return 0
    x, w = y.args
    with graph.inserting_before(h):  # the add's place: every input is defined, every user of h comes after
        fused = graph.call_function(FUSED[consumer.target], (x, w, residual, eps, *rest))
        out = graph.call_function(operator.getitem, (fused, 0))
        new_h = graph.call_function(operator.getitem, (fused, 1))
    # only the values: other metadata (Inductor's eager_input_vals) describes the old ops' arguments
    fused.meta = {"val": (consumer.meta["val"], h.meta["val"])}
    out.meta, new_h.meta = {"val": consumer.meta["val"]}, {"val": h.meta["val"]}
    consumer.replace_all_uses_with(out)
    h.replace_all_uses_with(new_h)
    for node in (consumer, *norm_nodes, h, y):
        graph.erase_node(node)
    return 1


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
