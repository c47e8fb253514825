"""`--dtype auto`, settled the way vLLM settles it: the checkpoint's `torch_dtype` (config.json),
except that a float32 checkpoint (or one that names none: GGUF, dummy) runs in bfloat16 on a GPU
(float16 where the GPU has no bfloat16). On CPU `auto` is float32: compilelm's CPU kernels are
fastest and exact there (vLLM's CPU backend picks bfloat16 where the CPU has it).
"""

from __future__ import annotations

import json
import os

from compilelm.models.loader import ModelSource

_HALF = ("bfloat16", "float16")


def checkpoint_dtype(source: ModelSource) -> str | None:
    """config.json's `torch_dtype` (transformers v5 writes `dtype`), or None."""
    if source.kind != "hf":
        return None
    try:
        with open(os.path.join(source.path, "config.json")) as f:
            cfg = json.load(f)
    except (OSError, ValueError):
        return None
    value = cfg.get("torch_dtype") or cfg.get("dtype")
    return value.removeprefix("torch.") if isinstance(value, str) else None


def resolve_dtype(requested: str, source: ModelSource, device_type: str) -> str:
    """`requested` unless it is "auto"; then the rule above."""
    if requested != "auto":
        return requested
    if device_type != "cuda":
        return "float32"
    found = checkpoint_dtype(source)
    if found in _HALF:
        return found
    import torch
    return "bfloat16" if torch.cuda.is_bf16_supported() else "float16"
