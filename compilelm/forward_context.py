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
    # The layer whose cache the next KV-cache write before an attention op goes to: ops inside the
    # compiled pieces carry no layer name (it would make every layer's piece distinct: one Inductor
    # compile per layer), so each attention op, run in layer order, moves this past its own layer.
    next_layer: int = 0
    _names: tuple[str, ...] | None = field(default=None, repr=False)  # kv_caches' keys, made on first use

    def next_kv_cache(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(key_cache, value_cache) of the layer after the last attention op run (the first layer
        before any, and again after the last)."""
        names = self._layer_names()
        return self.kv_caches[names[self.next_layer % len(names)]]

    def attention_done(self, layer_name: str) -> None:
        """Called by every attention op: the next cache write belongs to the layer after it."""
        self.next_layer = self._layer_names().index(layer_name) + 1

    def _layer_names(self) -> tuple[str, ...]:
        if self._names is None:
            self._names = tuple(self.kv_caches)
        return self._names


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
