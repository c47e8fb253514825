"""Qwen3: the Llama decoder plus a per-head RMSNorm on q and k (QK-norm) before RoPE."""

from __future__ import annotations

import torch

from compilelm.layers.layernorm import RMSNorm
from compilelm.models.config import ModelConfig
from compilelm.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM


class Qwen3Attention(LlamaAttention):
    def __init__(self, config: ModelConfig, prefix: str, rotary_emb):
        super().__init__(config, prefix, rotary_emb)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)

    def qk_norm(self, q: torch.Tensor, k: torch.Tensor):
        n = q.shape[0]
        q = self.q_norm(q.view(n, self.num_heads, self.head_dim)).view(n, self.q_size)
        k = self.k_norm(k.view(n, self.num_kv_heads, self.head_dim)).view(n, self.kv_size)
        return q, k


class Qwen3DecoderLayer(LlamaDecoderLayer):
    attention_cls = Qwen3Attention


class Qwen3ForCausalLM(LlamaForCausalLM):
    decoder_layer_cls = Qwen3DecoderLayer
