"""A tiny Llama-shaped model for compiler tests: embedding, N identical layers (RMSNorm, fused
qkv, RoPE, an opaque attention custom op, SwiGLU MLP), final norm. Its attention op is defined
here (causal attention over the batch's own tokens, no KV cache), so the compiler can be tested
without the real model or the csrc kernels."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

SPLIT_OP = "compilelm_test::attention"


@torch.library.custom_op(SPLIT_OP, mutates_args=())
def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_name: str) -> torch.Tensor:
    # q: [num_tokens, num_heads * head_dim]; k, v: [num_tokens, num_kv_heads * head_dim]
    n, hd = q.shape[0], ToyModel.HEAD_DIM
    qh, kh, vh = (t.reshape(n, -1, hd).transpose(0, 1) for t in (q, k, v))  # [heads, n, hd]
    rep = qh.shape[0] // kh.shape[0]
    out = F.scaled_dot_product_attention(qh, kh.repeat_interleave(rep, 0), vh.repeat_interleave(rep, 0), is_causal=True)
    return out.transpose(0, 1).reshape(n, -1)


@attention.register_fake
def _(q, k, v, layer_name):
    return torch.empty_like(q)


class RMSNorm(nn.Module):
    def __init__(self, hidden: int):
        super().__init__()
        self.weight = nn.Parameter(1 + 0.1 * torch.randn(hidden))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


def rope(x, cos, sin):
    # x: [num_tokens, heads * head_dim]; cos, sin: [num_tokens, head_dim // 2]
    n, half = x.shape[0], cos.shape[-1]
    x = x.view(n, -1, 2 * half)
    x1, x2 = x[..., :half], x[..., half:]
    c, s = cos[:, None, :], sin[:, None, :]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], -1).reshape(n, -1)


class Layer(nn.Module):
    def __init__(self, i: int, hidden: int, heads: int, kv_heads: int, inter: int):
        super().__init__()
        hd = ToyModel.HEAD_DIM
        self.layer_name = f"layers.{i}.attn"
        self.sizes = [heads * hd, kv_heads * hd, kv_heads * hd]
        self.input_norm, self.post_norm = RMSNorm(hidden), RMSNorm(hidden)
        self.qkv = nn.Linear(hidden, sum(self.sizes), bias=False)
        self.o_proj = nn.Linear(heads * hd, hidden, bias=False)
        self.gate_up = nn.Linear(hidden, 2 * inter, bias=False)
        self.down = nn.Linear(inter, hidden, bias=False)

    def forward(self, x, cos, sin):
        q, k, v = self.qkv(self.input_norm(x)).split(self.sizes, -1)
        x = x + self.o_proj(torch.ops.compilelm_test.attention(rope(q, cos, sin), rope(k, cos, sin), v,
                                                               self.layer_name))
        gate, up = self.gate_up(self.post_norm(x)).chunk(2, -1)
        return x + self.down(F.silu(gate) * up)


class ToyModel(nn.Module):
    HEAD_DIM = 16

    def __init__(self, num_layers: int = 4, hidden: int = 64, heads: int = 4, kv_heads: int = 2,
                 inter: int = 96, vocab: int = 101, max_pos: int = 512):
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.layers = nn.ModuleList(Layer(i, hidden, heads, kv_heads, inter) for i in range(num_layers))
        self.norm = RMSNorm(hidden)
        inv = 1.0 / 10000 ** (torch.arange(0, self.HEAD_DIM, 2).float() / self.HEAD_DIM)
        freqs = torch.arange(max_pos).float()[:, None] * inv[None]
        self.register_buffer("cos", freqs.cos(), persistent=False)
        self.register_buffer("sin", freqs.sin(), persistent=False)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.embed(input_ids)
        cos, sin = self.cos[positions], self.sin[positions]
        for layer in self.layers:
            x = layer(x, cos, sin)
        return self.norm(x)


SCALE = torch.ones(1)


class ToyModelWithGlobal(ToyModel):
    """Reads a module-level tensor in forward: not every graph input is a model tensor or an
    argument, so the compiled function keeps Dynamo (guard-free) at run time."""

    def forward(self, input_ids, positions):
        return super().forward(input_ids, positions) * SCALE


def inputs(n: int, vocab: int = 101, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (n,), generator=g), torch.arange(n) + 3
