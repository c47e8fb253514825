"""Small FP8 checkpoints written inside a test, in each published format, from a random transformers
model (its weights rounded to bf16: the "bf16 source"), and a plain-torch reference of what
serving them as W8A8 computes: the same transformers model with each decoder linear's weight
replaced by its dequantized fp8 weight (q * scale) and its input fake-quantized (quantize, then
dequantize) the way the format says.

FORMATS: id -> (config.json quant_method, weights "tensor"|"channel"|"block", activations
"dynamic"|"static"). Block formats use 128 x 128 blocks and 1 x 128 activation groups.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

FP8, FP8_MAX = torch.float8_e4m3fn, 448.0
MIN_SCALE = 1.0 / (448.0 * 512.0)
BLOCK = 128
LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
           "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
PACKED = {"q_proj": "qkv", "k_proj": "qkv", "v_proj": "qkv", "gate_proj": "gate_up", "up_proj": "gate_up"}

FORMATS = {
    "fp8-tensor-dynamic": ("fp8", "tensor", "dynamic"),
    "fp8-tensor-static": ("fp8", "tensor", "static"),
    "fp8-block": ("fp8", "block", "dynamic"),
    "ct-channel-dynamic": ("compressed-tensors", "channel", "dynamic"),
    "ct-tensor-static": ("compressed-tensors", "tensor", "static"),
    "ct-channel-static": ("compressed-tensors", "channel", "static"),
    "ct-block": ("compressed-tensors", "block", "dynamic"),
}

# every projection a multiple of 128 rows and columns (block formats need it)
CONFIG = dict(vocab_size=256, hidden_size=256, intermediate_size=384, num_hidden_layers=2, num_attention_heads=2,
              num_key_value_heads=1, head_dim=128, max_position_embeddings=256, rms_norm_eps=1e-6,
              tie_word_embeddings=False, initializer_range=0.08, bos_token_id=1, eos_token_id=2)


def quantization_config(method: str, weights: str, activations: str) -> dict:
    if method == "fp8":
        qc = {"quant_method": "fp8", "activation_scheme": activations, "fmt": "e4m3"}
        if weights == "block":
            qc["weight_block_size"] = [BLOCK, BLOCK]
        return qc
    acts = ({"strategy": "group", "group_size": BLOCK, "dynamic": True} if weights == "block" else
            {"strategy": "token", "dynamic": True} if activations == "dynamic" else
            {"strategy": "tensor", "dynamic": False})
    w = {"strategy": weights, "dynamic": False, "block_structure": [BLOCK, BLOCK] if weights == "block" else None}
    group = {"targets": ["Linear"], "output_activations": None,
             "weights": {"num_bits": 8, "type": "float", "symmetric": True, "group_size": None,
                         "observer": "minmax", **w},
             "input_activations": {"num_bits": 8, "type": "float", "symmetric": True, "observer": None,
                                   "group_size": None, **acts}}
    return {"quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
            "config_groups": {"group_0": group}, "ignore": ["lm_head"], "kv_cache_scheme": None}


def source_model(arch: str):
    """A random transformers model (fp32 holding bf16-representable values), eval mode."""
    import transformers
    cfg = getattr(transformers, arch.replace("ForCausalLM", "Config"))(**CONFIG)
    torch.manual_seed(0)
    model = getattr(transformers, arch)(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    return model


def quantize_weight(w: torch.Tensor, weights: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """w [out, in] -> (q fp8, the scale as published, the dequantized weight [out, in])."""
    if weights == "tensor":
        scale = w.abs().amax() / FP8_MAX  # []
        full = scale.expand_as(w)
    elif weights == "channel":
        scale = w.abs().amax(1, keepdim=True) / FP8_MAX  # [out, 1]
        full = scale.expand_as(w)
    else:
        out_f, in_f = w.shape
        blocks = w.reshape(out_f // BLOCK, BLOCK, in_f // BLOCK, BLOCK)
        scale = blocks.abs().amax(dim=(1, 3)) / FP8_MAX  # [out / 128, in / 128]
        full = scale.repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)
    q = (w / full).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q, scale.float(), q.float() * full


def fake_quant(x: torch.Tensor, activations: str, weights: str, input_scale: torch.Tensor | None) -> torch.Tensor:
    """quantize then dequantize x [..., in] as the W8A8 layer does."""
    xf = x.float()
    if weights == "block":
        g = xf.reshape(*xf.shape[:-1], -1, BLOCK)
        s = (g.abs().amax(-1, keepdim=True) / FP8_MAX).clamp(min=MIN_SCALE)
        return ((g / s).clamp(-FP8_MAX, FP8_MAX).to(FP8).float() * s).reshape(xf.shape)
    if activations == "dynamic":
        s = (xf.abs().amax(-1, keepdim=True) / FP8_MAX).clamp(min=MIN_SCALE)
    else:
        s = input_scale
    return (xf / s).clamp(-FP8_MAX, FP8_MAX).to(FP8).float() * s


def write_checkpoint(path: Path, fmt: str, arch: str = "LlamaForCausalLM", calib_ids=None):
    """Writes config.json + model.safetensors of format `fmt`; returns (source model, reference model)
    where the reference is the source with dequantized weights and fake-quantized linear inputs."""
    import copy

    from safetensors.torch import save_file
    method, weights, activations = FORMATS[fmt]
    src = source_model(arch)
    input_scales = _calibrate(src, calib_ids) if activations == "static" else {}
    ref = copy.deepcopy(src)
    tensors = {}
    for name, p in src.state_dict().items():
        tensors[name] = p.to(torch.bfloat16)
    for i in range(CONFIG["num_hidden_layers"]):
        for lin in LINEARS:
            key = f"model.layers.{i}.{lin}"
            q, scale, deq = quantize_weight(src.get_submodule(key).weight.detach(), weights)
            tensors[f"{key}.weight"] = q
            scale_name = "weight_scale_inv" if (method, weights) == ("fp8", "block") else "weight_scale"
            per_tensor_shape = (1,) if method == "compressed-tensors" else ()
            tensors[f"{key}.{scale_name}"] = scale.reshape(per_tensor_shape) if weights == "tensor" else scale
            layer = ref.get_submodule(key)
            with torch.no_grad():
                layer.weight.copy_(deq)
            s = None
            if activations == "static":
                tensors[f"{key}.input_scale"] = input_scales[key].reshape(per_tensor_shape)
                s = _served_input_scale(input_scales, key)
            layer.register_forward_pre_hook(
                lambda mod, args, s=s: (fake_quant(args[0], activations, weights, s).to(args[0].dtype),))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / "model.safetensors"))
    cfg = json.loads(src.config.to_json_string())
    cfg.update(architectures=[arch], torch_dtype="bfloat16",
               quantization_config=quantization_config(method, weights, activations))
    (path / "config.json").write_text(json.dumps(cfg))
    return src, ref


def _calibrate(model, ids) -> dict[str, torch.Tensor]:
    """input_scale = amax(|input|) / 448 of each decoder linear over `ids`, the shards of a packed
    layer made to differ (x1, x1.25, x0.8) so that loading must take their max."""
    amax, hooks = {}, []
    for i in range(CONFIG["num_hidden_layers"]):
        for lin in LINEARS:
            key = f"model.layers.{i}.{lin}"
            hooks.append(model.get_submodule(key).register_forward_pre_hook(
                lambda mod, args, key=key: amax.__setitem__(key, args[0].detach().abs().amax().float())))
    with torch.no_grad():
        model(torch.tensor([ids]))
    for h in hooks:
        h.remove()
    factor = {"k_proj": 1.25, "v_proj": 0.8, "up_proj": 1.25}
    return {k: (a / FP8_MAX * factor.get(k.rsplit(".", 1)[1], 1.0)).reshape(()) for k, a in amax.items()}


def _served_input_scale(scales: dict, key: str) -> torch.Tensor:
    """What a packed layer serves with: the max over its shards' input scales (vLLM's rule)."""
    prefix, last = key.rsplit(".", 1)
    group = [f"{prefix}.{k}" for k, g in PACKED.items() if g == PACKED.get(last)] or [key]
    return torch.stack([scales[k] for k in group]).amax()
