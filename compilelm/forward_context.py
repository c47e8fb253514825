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
    kv_caches: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)


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
