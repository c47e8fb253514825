"""Per-step metadata for the model forward, passed explicitly through a context manager.

The model signature stays `forward(input_ids, positions)` so that Dynamo traces one graph for
every batch; everything that changes per step and is only needed by attention (slot mapping,
block tables, sequence lengths, the KV-cache tensors) travels here instead.
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
    # The layer of the last attention op run in this forward. Ops inside the compiled pieces carry
    # no layer name (it would make every layer's piece distinct: one Inductor compile per layer);
    # their cache write goes to the layer after this one (next_kv_cache).
    last_attention: str | None = None

    def next_kv_cache(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(key_cache, value_cache) of the layer after the last attention op run (the first layer
        before any, and again after the last)."""
        names = list(self.kv_caches)
        i = 0 if self.last_attention is None else names.index(self.last_attention) + 1
        return self.kv_caches[names[i % len(names)]]

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
