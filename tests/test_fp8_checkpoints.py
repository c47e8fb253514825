"""FP8 checkpoints as published (fp8, compressed-tensors; per tensor / channel / 128x128 block;
dynamic / static activations): detected from config.json without a flag, served with the
published fp8 weights and scales, logits equal to a plain-torch W8A8 reference of the same
weights (tests/fp8_fixtures.py) and close to the bf16 source; every other quantization_config
refused at load by name."""

import json

import pytest
import torch

from compilelm import LLM, SamplingParams
from compilelm.layers.quantization import Fp8BlockLinearMethod, Fp8LinearMethod, UnsupportedQuantization
from compilelm.models.loader import build_model, load_model_config, resolve_model
from tests.fp8_fixtures import CONFIG, FORMATS, LINEARS, PACKED, write_checkpoint
from tests.test_fp8 import _forward_logits

PROMPT = [1, 17, 99, 3, 250, 42, 42, 7, 128, 64, 5, 200, 31, 77, 8, 190]
ARCH = {"fp8-block": "Qwen3ForCausalLM", "ct-block": "Qwen3ForCausalLM", "ct-tensor-static": "Qwen3ForCausalLM"}
LLM_ARGS = dict(enforce_eager=True, num_kv_blocks=16, max_model_len=64)


def _shard_rows(name: str) -> list[tuple[str, int, int]]:
    """(checkpoint linear, first row, rows) of each shard packed into our layer `name`."""
    q = CONFIG["num_attention_heads"] * CONFIG["head_dim"]
    kv = CONFIG["num_key_value_heads"] * CONFIG["head_dim"]
    inter = CONFIG["intermediate_size"]
    if name.endswith("qkv_proj"):
        return [("self_attn.q_proj", 0, q), ("self_attn.k_proj", q, kv), ("self_attn.v_proj", q + kv, kv)]
    if name.endswith("gate_up_proj"):
        return [("mlp.gate_proj", 0, inter), ("mlp.up_proj", inter, inter)]
    return [(name, 0, None)]


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_fp8_checkpoint_served_as_published(tmp_path, fmt):
    from safetensors.torch import load_file
    method, weights, activations = FORMATS[fmt]
    src, ref = write_checkpoint(tmp_path, fmt, ARCH.get(fmt, "LlamaForCausalLM"), PROMPT)
    disk = load_file(str(tmp_path / "model.safetensors"))
    source = resolve_model(str(tmp_path))
    mc = load_model_config(source)  # no flag: the scheme comes from config.json
    assert (mc.quantization.method, mc.quantization.weights, mc.quantization.activations) == FORMATS[fmt]
    model = build_model(source, mc, torch.float32, torch.device("cpu"))

    # the published bytes and scales, untouched
    layer0 = model.model.layers[0]
    for name in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj"):
        layer = layer0.get_submodule(name)
        assert layer.weight.dtype == torch.float8_e4m3fn
        want_method = Fp8BlockLinearMethod if weights == "block" else Fp8LinearMethod
        assert isinstance(layer.quant_method, want_method)
        shards = _shard_rows(name)
        want_w = torch.cat([disk[f"model.layers.0.{s}.weight"] for s, _, _ in shards])
        assert torch.equal(layer.weight.view(torch.uint8), want_w.view(torch.uint8))
        for s, first, rows in shards:
            published = disk[f"model.layers.0.{s}.{'weight_scale_inv' if fmt == 'fp8-block' else 'weight_scale'}"]
            rows = rows or layer.weight.shape[0]
            if weights == "block":
                got = layer.weight_scale[first // 128:(first + rows) // 128]
                assert torch.equal(got, published)
            else:
                got = layer.weight_scale[0, first:first + rows]
                assert torch.equal(got, published.reshape(-1).expand(rows))
        if activations == "static":
            want = max(disk[f"model.layers.0.{s}.input_scale"].item() for s, _, _ in shards)
            assert layer.input_scale.item() == want
        else:
            assert getattr(layer, "input_scale", None) is None
    assert model.lm_head.weight.dtype == torch.float32

    # logits: equal to the plain-torch W8A8 reference, close to the bf16 source
    llm = LLM(str(tmp_path), **LLM_ARGS)
    got = _forward_logits(llm, PROMPT)
    with torch.no_grad():
        want = ref(torch.tensor([PROMPT])).logits[0].float()
        base = src(torch.tensor([PROMPT])).logits[0].float()
    scale = base.abs().amax().item()
    ref_err, src_err = (got - want).abs().amax().item() / scale, (got - base).abs().amax().item() / scale
    print(f"\n{fmt}: max |logit - W8A8 reference| {ref_err:.2e}, max |logit - bf16 source| {src_err:.2e} (relative)")
    assert ref_err < 2e-3  # the same computation, up to summation order
    top1 = (got.argmax(-1) == base.argmax(-1)).float().mean().item()
    # a random 2-layer model has flat logits (std ~1.3): fp8's ~6% per-value rounding moves them by
    # ~13% on average (measured for every format); a wrong scale moves them by far more
    assert 1e-3 < src_err < 0.3 and top1 >= 0.6

    out = llm.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True), use_tqdm=False)
    ids = out[0].outputs[0].token_ids
    assert len(ids) == 6
    assert ids[0] == got[-1].argmax().item()


def test_fp8_flag_on_fp8_checkpoint_and_cache_key(tmp_path):
    """--quantization fp8 on an FP8 checkpoint serves the checkpoint's scales (no re-quantization);
    the scheme is part of the compile cache key, which unquantized models keep as before."""
    from compilelm.config import EngineConfig
    write_checkpoint(tmp_path, "ct-tensor-static", "LlamaForCausalLM", PROMPT)
    source = resolve_model(str(tmp_path))
    mc = load_model_config(source)
    model = build_model(source, mc, torch.float32, torch.device("cpu"), "fp8")
    assert model.model.layers[0].self_attn.qkv_proj.input_scale is not None  # static: from the checkpoint
    key = EngineConfig().cache_key_factors(mc)["model"]
    assert key["quantization"]["weights"] == "tensor" and key["quantization"]["activations"] == "static"
    plain = load_model_config(resolve_model("dummy:smollm2-135m"))
    assert "quantization" not in EngineConfig().cache_key_factors(plain)["model"]


def test_ignored_layers_stay_unquantized(tmp_path):
    write_checkpoint(tmp_path, "ct-channel-dynamic", "LlamaForCausalLM")
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["quantization_config"]["ignore"] = ["lm_head", "re:.*layers\\.1\\.mlp\\.down_proj$"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    # the ignored layer's checkpoint weights are unquantized, as llm-compressor writes them
    from safetensors.torch import load_file, save_file
    tensors = load_file(str(tmp_path / "model.safetensors"))
    key = "model.layers.1.mlp.down_proj"
    scale = tensors.pop(f"{key}.weight_scale")
    tensors[f"{key}.weight"] = (tensors[f"{key}.weight"].float() * scale).to(torch.bfloat16)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    source = resolve_model(str(tmp_path))
    model = build_model(source, load_model_config(source), torch.float32, torch.device("cpu"))
    assert model.model.layers[1].mlp.down_proj.weight.dtype == torch.float32
    assert model.model.layers[1].mlp.down_proj.quant_method is None
    assert model.model.layers[0].mlp.down_proj.weight.dtype == torch.float8_e4m3fn


def test_missing_shard_scale_is_named(tmp_path):
    write_checkpoint(tmp_path, "fp8-tensor-dynamic", "LlamaForCausalLM")
    from safetensors.torch import load_file, save_file
    tensors = load_file(str(tmp_path / "model.safetensors"))
    del tensors["model.layers.0.self_attn.k_proj.weight_scale"]
    save_file(tensors, str(tmp_path / "model.safetensors"))
    source = resolve_model(str(tmp_path))
    with pytest.raises(ValueError, match="qkv_proj.weight_scale"):
        build_model(source, load_model_config(source), torch.float32, torch.device("cpu"))


@pytest.mark.parametrize("names", ["modelopt", "kv_scale", "compressed-tensors"])
def test_kv_cache_scales_are_loaded(tmp_path, names):
    """The checkpoint's FP8 KV-cache scales reach each layer's Attention (k_scale, v_scale), under
    each naming: self_attn.k_scale / v_scale, the older self_attn.kv_scale (both), and
    compressed-tensors' k_proj / v_proj.output_scale; query scales are dropped."""
    write_checkpoint(tmp_path, "ct-channel-dynamic", "LlamaForCausalLM")
    from safetensors.torch import load_file, save_file
    tensors = load_file(str(tmp_path / "model.safetensors"))
    for i in range(CONFIG["num_hidden_layers"]):
        attn = f"model.layers.{i}.self_attn"
        k, v = 0.25 * (i + 1), 0.5 * (i + 1)
        if names == "modelopt":
            tensors.update({f"{attn}.k_scale": torch.tensor(k), f"{attn}.v_scale": torch.tensor(v),
                            f"{attn}.q_scale": torch.tensor(1.0)})
        elif names == "kv_scale":
            tensors[f"{attn}.kv_scale"] = torch.tensor([k])
            v = k
        else:
            tensors.update({f"{attn}.k_proj.output_scale": torch.tensor([k]),
                            f"{attn}.v_proj.output_scale": torch.tensor([v]),
                            f"{attn}.q_proj.output_scale": torch.tensor([1.0])})
    save_file(tensors, str(tmp_path / "model.safetensors"))
    source = resolve_model(str(tmp_path))
    model = build_model(source, load_model_config(source), torch.float32, torch.device("cpu"))
    for i, layer in enumerate(model.model.layers):
        attn = layer.self_attn.attn
        want_v = 0.25 * (i + 1) if names == "kv_scale" else 0.5 * (i + 1)
        assert (attn.k_scale, attn.v_scale, attn.kv_scales_loaded) == (0.25 * (i + 1), want_v, True)


def test_bad_kv_cache_scale_is_named(tmp_path):
    write_checkpoint(tmp_path, "ct-channel-dynamic", "LlamaForCausalLM")
    from safetensors.torch import load_file, save_file
    tensors = load_file(str(tmp_path / "model.safetensors"))
    tensors["model.layers.0.self_attn.k_scale"] = torch.tensor(0.0)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    source = resolve_model(str(tmp_path))
    with pytest.raises(ValueError, match="self_attn.k_scale"):
        build_model(source, load_model_config(source), torch.float32, torch.device("cpu"))


def _ct(weights: dict, acts: dict | None, **extra) -> dict:
    group = {"targets": ["Linear"], "weights": weights, "input_activations": acts}
    return {"quant_method": "compressed-tensors", "config_groups": {"group_0": group}, **extra}


REFUSED = {
    "awq": ({"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True}, "'awq'"),
    "gptq": ({"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False}, "'gptq'"),
    "bitsandbytes": ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "'bitsandbytes'"),
    "modelopt": ({"quant_method": "modelopt", "quant_algo": "FP8"}, "'modelopt'"),
    "mxfp4": ({"quant_method": "mxfp4"}, "'mxfp4'"),
    "ct-w4a16": (_ct({"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 128}, None,
                     format="pack-quantized"), "int 4-bit"),
    "ct-w8a8-int8": (_ct({"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel"},
                         {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "token", "dynamic": True}),
                     "int 8-bit"),
    "ct-fp8-weight-only": (_ct({"num_bits": 8, "type": "float", "symmetric": True, "strategy": "channel"}, None),
                           "weight-only"),
    "ct-fp8-static-token": (_ct({"num_bits": 8, "type": "float", "symmetric": True, "strategy": "channel"},
                                {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "token",
                                 "dynamic": False}), "static input activations of strategy 'token'"),
    "fp8-e5m2": ({"quant_method": "fp8", "fmt": "e5m2"}, "e5m2"),
    "fp8-block-static": ({"quant_method": "fp8", "activation_scheme": "static", "weight_block_size": [128, 128]},
                         "static"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_other_quantization_refused_by_name(tmp_path, case):
    from safetensors.torch import save_file
    qc, detail = REFUSED[case]
    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], **{k: v for k, v in CONFIG.items() if k != "initializer_range"},
        "quantization_config": qc}))
    save_file({"model.embed_tokens.weight": torch.zeros(4, 4)}, str(tmp_path / "model.safetensors"))
    source = resolve_model(str(tmp_path))
    with pytest.raises(UnsupportedQuantization) as err:
        load_model_config(source)
    msg = str(err.value)
    assert str(tmp_path / "config.json") in msg and repr(qc["quant_method"]) in msg and detail in msg
    assert "compressed-tensors FP8" in msg and "weight_block_size" in msg  # what is supported
    if case == "awq":  # the engine refuses it the same way, before building anything
        with pytest.raises(UnsupportedQuantization, match="'awq'"):
            LLM(str(tmp_path), **LLM_ARGS)


def test_packed_shards_share_the_max_static_input_scale(tmp_path):
    """The fixture gives k/v and up shards input scales that differ from q / gate: the packed layer
    serves their max (what the reference computes with, so the logits test covers it too)."""
    write_checkpoint(tmp_path, "fp8-tensor-static", "LlamaForCausalLM", PROMPT)
    from safetensors.torch import load_file
    disk = load_file(str(tmp_path / "model.safetensors"))
    source = resolve_model(str(tmp_path))
    model = build_model(source, load_model_config(source), torch.float32, torch.device("cpu"))
    for lin in LINEARS:
        ours = lin if lin.split(".")[1] not in PACKED else lin.replace(
            lin.split(".")[1], PACKED[lin.split(".")[1]] + "_proj")
        group = [f"{lin.split('.')[0]}.{k}" for k, g in PACKED.items() if g == PACKED.get(lin.split(".")[1])] or [lin]
        scales = [disk[f"model.layers.1.{g}.input_scale"].item() for g in group]
        assert model.model.layers[1].get_submodule(ours).input_scale.item() == max(scales)
    assert len({disk[f"model.layers.1.self_attn.{p}_proj.input_scale"].item() for p in "qkv"}) == 3


@pytest.mark.parametrize("weights", ["tensor", "channel", "block"])
def test_tensor_parallel_slices_keep_their_scales(monkeypatch, weights):
    """tensor_parallel_size 2: each rank's fp8 rows / columns come with their own scales (q split
    by heads, the one KV head replicated, down_proj split by 128-column blocks)."""
    from compilelm.distributed import parallel_state
    from compilelm.layers.linear import QKVParallelLinear, RowParallelLinear
    from compilelm.layers.quantization import Fp8Scheme
    from compilelm.layers.quantization.checkpoint import _make_fp8_params
    from tests.fp8_fixtures import quantize_weight
    scheme = Fp8Scheme("compressed-tensors", weights, "dynamic", (128, 128) if weights == "block" else None)
    g = torch.Generator().manual_seed(0)
    shards = {s: quantize_weight(torch.randn(rows, 256, generator=g) * 0.05, weights)
              for s, rows in (("q", 256), ("k", 128), ("v", 128))}
    down = quantize_weight(torch.randn(256, 512, generator=g) * 0.05, weights)

    def dequantized(layer):
        s = layer.weight_scale
        full = (s.repeat_interleave(128, 0).repeat_interleave(128, 1) if weights == "block" else s.t())
        return layer.weight.float() * full

    for rank in (0, 1):
        monkeypatch.setattr(parallel_state, "_TP_RANK", rank)
        monkeypatch.setattr(parallel_state, "_TP_SIZE", 2)
        qkv, row = QKVParallelLinear(256, 128, 2, 1), RowParallelLinear(512, 256)
        _make_fp8_params(qkv, scheme, "qkv_proj")
        _make_fp8_params(row, scheme, "down_proj")
        for s, (q, scale, _) in shards.items():
            qkv.weight.weight_loader(qkv.weight, q, s)
            qkv.weight_scale.weight_loader(qkv.weight_scale, scale, s)
        row.weight.weight_loader(row.weight, down[0])
        row.weight_scale.weight_loader(row.weight_scale, down[1])
        want = torch.cat([shards["q"][2][rank * 128:(rank + 1) * 128], shards["k"][2], shards["v"][2]])
        assert torch.equal(dequantized(qkv), want)
        assert torch.equal(dequantized(row), down[2][:, rank * 256:(rank + 1) * 256])
