"""A model's `generation_config.json`, applied as vLLM applies it (`--generation-config`).

- "auto" (the default): the model folder's file gives the default sampling of every request that
  does not set the field itself: `temperature`, `top_p`, `top_k`, `min_p`,
  `repetition_penalty`, and `max_new_tokens` (a cap on max_tokens). A value equal to
  transformers' own default (temperature 1.0, top_p 1.0, top_k 50, repetition_penalty 1.0)
  changes nothing, as in vLLM, which reads the file's difference from those defaults.
  `do_sample` is ignored, as in vLLM.
- "vllm": neutral sampling defaults; a folder path: that folder's generation_config.json.
- `--override-generation-config JSON` is laid over either.

Its `eos_token_id` (an id or a list) ends generation in every mode, "vllm" included (vLLM reads
the model's file for the EOS ids even then); a request with `ignore_eos` ignores them.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

from compilelm.models.loader import ModelSource

FILE = "generation_config.json"
# generation_config key -> SamplingParams field
SAMPLING_KEYS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                  "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}
_HF_DEFAULTS = {"temperature": 1.0, "top_p": 1.0, "top_k": 50, "repetition_penalty": 1.0}


@dataclass(frozen=True)
class GenerationDefaults:
    sampling: tuple[tuple[str, Any], ...] = ()  # (SamplingParams field, value), in SAMPLING_KEYS order
    eos_token_ids: tuple[int, ...] = ()
    source: str | None = None  # the file they came from

    def sampling_dict(self) -> dict[str, Any]:
        return dict(self.sampling)


def read_generation_config(folder: str) -> dict:
    """The folder's generation_config.json as a dict ({} when there is none); ValueError when
    it is not a JSON object."""
    path = os.path.join(folder, FILE)
    if not os.path.isfile(path):
        return {}
    try:
        with open(path) as f:
            data = json.load(f)
    except ValueError as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from e
    if not isinstance(data, dict):
        raise ValueError(f"{path} must hold a JSON object")
    return data


def load_generation_defaults(source: ModelSource, mode: str = "auto",
                             overrides: dict | None = None) -> GenerationDefaults:
    folder = source.path if source.kind == "hf" else None
    if mode not in ("auto", "vllm"):
        folder = mode
        if not os.path.isfile(os.path.join(folder, FILE)):
            raise FileNotFoundError(f"generation_config: no {FILE} in {folder} (auto | vllm | a folder holding one)")
    config = read_generation_config(folder) if folder else {}
    sampling = {} if mode == "vllm" else {k: v for k, v in config.items()
                                          if k in SAMPLING_KEYS and v is not None and _HF_DEFAULTS.get(k) != v}
    for key, value in (overrides or {}).items():
        if key not in SAMPLING_KEYS:
            raise ValueError(f"override_generation_config: unknown key {key!r}; known: {', '.join(SAMPLING_KEYS)}")
        sampling[key] = value
    eos = config.get("eos_token_id")
    eos = () if eos is None else (eos,) if isinstance(eos, int) else tuple(int(t) for t in eos)
    return GenerationDefaults(tuple((SAMPLING_KEYS[k], sampling[k]) for k in SAMPLING_KEYS if k in sampling),
                              eos, os.path.join(folder, FILE) if folder and config else None)
