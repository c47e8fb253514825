"""Which files of a Hugging Face folder hold the weights (vLLM's choice).

`model.safetensors.index.json`, when present, names them (its `weight_map`); a folder may hold
more `*.safetensors` than that (Mistral's repos also ship `consolidated.safetensors`, the same
weights under Mistral's own names, which no Hugging Face model class reads). Without an index,
every `*.safetensors` is read except `consolidated*.safetensors` next to Hugging Face-named
files. PyTorch `.bin` checkpoints are refused with a message, never unpickled.
"""

from __future__ import annotations

import json
import os

INDEX_FILE = "model.safetensors.index.json"


def safetensors_files(path: str) -> list[str]:
    """Absolute paths of the weight files to load, in order; FileNotFoundError / ValueError
    with what to do when there are none."""
    index = os.path.join(path, INDEX_FILE)
    if os.path.isfile(index):
        with open(index) as f:
            weight_map = json.load(f).get("weight_map") or {}
        names = sorted(set(weight_map.values()))
        missing = [n for n in names if not os.path.isfile(os.path.join(path, n))]
        if not names or missing:
            raise FileNotFoundError(f"{index} names {len(names)} weight files, {len(missing)} missing in "
                                    f"{path}: {missing[:3]}")
        return [os.path.join(path, n) for n in names]
    names = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    hf_named = [n for n in names if not n.startswith("consolidated")]
    if hf_named:
        return [os.path.join(path, n) for n in hf_named]
    if names:
        raise ValueError(f"{path} holds only Mistral-format weights ({', '.join(names)}); compilelm reads "
                         "Hugging Face-format checkpoints (model*.safetensors with config.json)")
    if any(f.endswith((".bin", ".pt", ".pth")) for f in os.listdir(path)):
        raise ValueError(f"{path} holds only PyTorch .bin weights; compilelm loads safetensors only (pickled "
                         "checkpoints can run code when loaded). Convert it once, e.g. "
                         "`AutoModelForCausalLM.from_pretrained(dir).save_pretrained(out_dir)`")
    raise FileNotFoundError(f"no *.safetensors weight files in {path}")
