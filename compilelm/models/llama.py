"""Llama-family decoder: Llama 2/3, Mistral, Qwen2, SmolLM2 (and the base of Qwen3).

forward(input_ids, positions) takes a flat batch of tokens from many sequences; attention reads
which tokens belong to which sequence from the forward context. Under tensor parallelism each
rank holds its heads and its slice of the MLP (column-parallel qkv/gate_up, row-parallel o/down,
each followed by one all-reduce) and its slice of the vocabulary.
"""

from __future__ import annotations

import torch
from torch import nn

from compilelm.layers.activation import SiluAndMul
from compilelm.layers.attention import Attention
from compilelm.layers.layernorm import RMSNorm
from compilelm.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from compilelm.layers.rotary_embedding import RotaryEmbedding
from compilelm.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding, compute_logits
from compilelm.models.config import ModelConfig


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelConfig, prefix: str, rotary_emb: RotaryEmbedding):
        super().__init__()
        c = config
        self.qkv_proj = QKVParallelLinear(c.hidden_size, c.head_dim, c.num_attention_heads, c.num_key_value_heads,
                                          bias=c.attention_bias)
        # this rank's heads
        self.num_heads, self.num_kv_heads, self.head_dim = (self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads,
                                                            c.head_dim)
        self.q_size, self.kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.o_proj = RowParallelLinear(c.num_attention_heads * c.head_dim, c.hidden_size)
        self.rotary_emb = rotary_emb  # one module shared by all layers
        self.attn = Attention(self.num_heads, self.num_kv_heads, self.head_dim, f"{prefix}.attn")

    def qk_norm(self, q: torch.Tensor, k: torch.Tensor):
        return q, k

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv_proj(x)  # [num_tokens, q_size + 2 * kv_size]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = self.qk_norm(q, k)
        q, k = self.rotary_emb(positions, q, k)
        return self.o_proj(self.attn(q, k, v))


class LlamaMLP(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        inter = config.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(config.hidden_size, {"gate": inter, "up": inter})
        self.down_proj = RowParallelLinear(inter, config.hidden_size)
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    attention_cls = LlamaAttention

    def __init__(self, config: ModelConfig, prefix: str, rotary_emb: RotaryEmbedding):
        super().__init__()
        self.self_attn = self.attention_cls(config, f"{prefix}.self_attn", rotary_emb)
        self.mlp = LlamaMLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, positions, x, residual):
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(positions, x)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig, layer_cls=LlamaDecoderLayer):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        rope = RotaryEmbedding(config.head_dim, config.max_position_embeddings, config.rope_theta,
                               config.rope_scaling_dict)
        self.layers = nn.ModuleList(layer_cls(config, f"model.layers.{i}", rope)
                                    for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        # input_ids, positions: [num_tokens] -> hidden: [num_tokens, hidden_size]
        x, residual = self.embed_tokens(input_ids), None
        for layer in self.layers:
            x, residual = layer(positions, x, residual)
        x, _ = self.norm(x, residual)
        return x


class LlamaForCausalLM(nn.Module):
    # checkpoint name fragment -> (our fragment, shard id) for packed parameters
    packed_modules = {
        "q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", "gate"), "up_proj": ("gate_up_proj", "up"),
    }
    decoder_layer_cls = LlamaDecoderLayer

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.model = LlamaModel(config, self.decoder_layer_cls)
        if config.tie_word_embeddings:
            self.lm_head = None
        else:
            self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions)

    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None,
                       argmax_out: torch.Tensor | None = None) -> torch.Tensor:
        # hidden: [n, hidden_size] -> logits [n, vocab_size], model dtype (gathered from every rank), in `out` if
        # given; each row's argmax into argmax_out (int64 [n]) if given
        return compute_logits(hidden, self.model.embed_tokens if self.lm_head is None else self.lm_head, out,
                              argmax_out)

    def attention_layer_names(self) -> list[str]:
        return [layer.self_attn.attn.layer_name for layer in self.model.layers]
