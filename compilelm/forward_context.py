"""Per-step metadata for the model forward, passed explicitly through a context manager.

The model signature stays `forward(input_ids, positions)` so that Dynamo traces one graph for
every batch; everything that changes per step and is only needed by attention (slot mapping,
block tables, sequence lengths, the KV-cache tensors) travels here instead.

The next layer's KV cache (the one place this protocol is written down). The attention ops the
graph is split at name their layer (`unified_attention*(..., layer_name)`) and read
`kv_caches[layer_name]`. Some fused ops run *inside* the compiled pieces and write the KV cache
too (rope_cache, qkv_rope and its norm variants, linear_add_rms_norm_qkv_rope: RoPE + the cache
write moved into the piece before attention). They name no layer: a layer name in a piece would
make every layer's piece distinct, one Inductor compile each instead of one for all. Instead:

- every attention op calls `attention_done(layer_name)` when it runs;
- an op inside a piece writes `next_kv_cache()`: the cache of the layer after the last attention
  op that ran (the first layer's before any has run). The piece before layer i's attention op
  runs after layer i-1's attention op, so that is layer i's cache;
- `kv_caches` is in layer order (the model's `attention_layer_names()`), and a forward runs the
  layers in order, eagerly, compiled or replayed from CUDA graphs (a graph replay runs the
  attention ops eagerly between pieces, or captured in order in a full graph).

FP8 KV caches (float8_e4m3fn tensors in `kv_caches`) come with each layer's (k_scale, v_scale) in
`kv_scales`: cache = fp8(value / scale), read back as fp8 * scale. Every op that writes or reads
a cache takes its layer's scales from here (`kv_scales_of`, `next_kv_scales`) at run time, so they
are never constants of a compiled piece; a layer missing from `kv_scales` has 1.0 and 1.0.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # int64 [num_tokens]; -1 = do not write (padding)
    cu_seqlens_q: torch.Tensor  # int32 [num_seqs + 1]
    seq_lens: torch.Tensor  # int32 [num_seqs], context length including this step's tokens
    block_tables: torch.Tensor  # int32 [num_seqs, max_blocks_per_seq]
    max_query_len: int
    max_seq_len: int


@dataclass
class ForwardContext:
    attn_metadata: AttentionMetadata | None
    kv_caches: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)  # in layer order
    # FP8 caches: layer name -> (k_scale, v_scale), fp32 values as Python floats (see above)
    kv_scales: dict[str, tuple[float, float]] = field(default_factory=dict)
    # The layer of the last attention op run in this forward (see "The next layer's KV cache").
    last_attention: str | None = None

    def next_layer(self) -> str:
        """The layer after the last attention op run (the first layer before any, and again after the last)."""
        names = list(self.kv_caches)
        i = 0 if self.last_attention is None else names.index(self.last_attention) + 1
        return names[i % len(names)]

    def next_kv_cache(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(key_cache, value_cache) of `next_layer()`."""
        return self.kv_caches[self.next_layer()]

    def kv_scales_of(self, layer_name: str) -> tuple[float, float]:
        """(k_scale, v_scale) of a layer's cache: 1.0 each unless set (model-dtype caches ignore them)."""
        return self.kv_scales.get(layer_name, (1.0, 1.0))

    def next_kv_scales(self) -> tuple[float, float]:
        """(k_scale, v_scale) of `next_layer()`."""
        return self.kv_scales_of(self.next_layer())

    def attention_done(self, layer_name: str) -> None:
        """Called by every attention op (cheap: it runs each step; next_kv_cache does the lookup)."""
        self.last_attention = layer_name


_current: ForwardContext | None = None


@contextlib.contextmanager
def set_forward_context(ctx: ForwardContext):
    """Make `ctx` the context that attention layers read during one model forward."""
    global _current
    prev, _current = _current, ctx
    try:
        yield ctx
    finally:
        _current = prev


def get_forward_context() -> ForwardContext:
    if _current is None:
        raise RuntimeError("no forward context is set: run the model inside set_forward_context(...)")
    return _current
