"""Fold a decoder layer's RMSNorm weights into the projection after each norm, at load:

    rms_norm(h, g) @ W.T  ==  rms_norm(h, None) @ T(W * g).T

for input_layernorm -> qkv_proj and post_attention_layernorm -> gate_up_proj. Their norms then
have no weight, and `passes.fuse_norm_gemm` (compilelm/passes/fuse_norm_gemm.py) can move them into
the GEMMs around them (compilelm/ops/norm_gemm.py), whose fast path scales a GEMM's accumulators by
the norm's per-row rstd: that leaves no place for g. Equal in exact arithmetic; in bf16 the
operand W * g is rounded once where the unfolded model rounds the normed activations times g.

Done only where those ops will take the layer's calls (`applies`): on sm_90 with Triton, bf16/fp16
weights unquantized, one rank, Llama-family layers without QK-norm whose shapes both ops take
(`fits`: Llama-3.1-8B's), with the pass and the passes that make its inputs (skinny_mm, and
fuse_act_skinny_mm or fuse_qkv_rope) on. Every path of such a model (eager, compiled, CUDA graphs)
runs the folded weights; a model that does not qualify is left exactly as loaded.
"""

from __future__ import annotations

import torch
from torch import nn


def applies(model: nn.Module, config, dtype: torch.dtype, device: torch.device) -> bool:
    """config: the engine's (compilation level and passes, quantization, tensor parallel size)."""
    compilation = config.compilation
    if compilation is None or compilation.level == 0:
        return False
    passes = compilation.passes
    if (not passes.fuse_norm_gemm or not passes.skinny_mm
            or not (passes.fuse_act_skinny_mm or passes.fuse_qkv_rope)
            or config.quantization is not None or config.tensor_parallel_size != 1
            or dtype not in (torch.bfloat16, torch.float16) or device.type != "cuda"
            or torch.cuda.get_device_capability(device) != (9, 0)):
        return False
    from compilelm.ops import norm_gemm
    return norm_gemm.triton is not None and fits(model)


def fits(model: nn.Module) -> bool:
    """Whether both fused ops take the layers' weights (norm_gemm.shapes_fit: o_proj then gate_up_proj,
    down_proj then qkv_proj), and gate_up_proj is wider than `passes.fuse_act_skinny_mm` moves the
    SiLU out of (past MAX_INTERMEDIATE the SiLU-and-mul is gate_up's epilogue, which the MLP side
    fuses into; below, down_proj's prologue, and neither side matches)."""
    # (not from compilelm.passes: the worker calls this while a thread imports the compiler, and two
    # threads importing Inductor at once can meet a partly initialized module)
    from compilelm.ops.linear import MAX_INTERMEDIATE
    from compilelm.ops.norm_gemm import shapes_fit

    layers = _layers(model)
    if not layers:
        return False
    attn, mlp = layers[0].self_attn, layers[0].mlp
    return (shapes_fit(attn.o_proj.weight.shape, mlp.gate_up_proj.weight.shape)
            and shapes_fit(mlp.down_proj.weight.shape, attn.qkv_proj.weight.shape)
            and mlp.gate_up_proj.weight.shape[0] // 2 > MAX_INTERMEDIATE)


def fold_norm_weights(model: nn.Module) -> int:
    """Folds every layer's two norm weights into qkv_proj / gate_up_proj; returns the layers folded."""
    layers = _layers(model)
    with torch.no_grad():
        for layer in layers:
            for norm, linear in ((layer.input_layernorm, layer.self_attn.qkv_proj),
                                 (layer.post_attention_layernorm, layer.mlp.gate_up_proj)):
                # weight: [N, K]; the norm's g: [K], per input column
                linear.weight.copy_((linear.weight.float() * norm.weight.float()).to(linear.weight.dtype))
                norm.weight = None
    # what `compilelm compile --dump` reports beside the passes (graphs/dump.py)
    model.load_rewrites = [*getattr(model, "load_rewrites", []),
                           f"fold_norms: the input and post-attention RMSNorm weights of {len(layers)} layers folded "
                           "into qkv_proj and gate_up_proj (for passes.fuse_norm_gemm)"]
    return len(layers)


def _layers(model: nn.Module) -> list[nn.Module]:
    """The decoder layers of a Llama-family model without QK-norm, else []."""
    layers = getattr(getattr(model, "model", None), "layers", None)
    if layers is None:
        return []
    ok = all(hasattr(layer, "input_layernorm") and hasattr(layer, "post_attention_layernorm")
             and isinstance(getattr(layer.input_layernorm, "weight", None), torch.Tensor)
             and hasattr(layer.self_attn, "qkv_proj") and hasattr(layer.self_attn, "o_proj")
             and not hasattr(layer.self_attn, "q_norm") and hasattr(layer.mlp, "gate_up_proj")
             and hasattr(layer.mlp, "down_proj") for layer in layers)
    return list(layers) if ok else []
