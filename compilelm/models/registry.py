"""Model family name -> model class."""

from __future__ import annotations

from torch import nn

from compilelm.models.config import ModelConfig


def get_model_class(config: ModelConfig) -> type[nn.Module]:
    if config.family == "qwen3":
        from compilelm.models.qwen3 import Qwen3ForCausalLM
        return Qwen3ForCausalLM
    from compilelm.models.llama import LlamaForCausalLM
    return LlamaForCausalLM
