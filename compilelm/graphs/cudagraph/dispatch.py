"""Which graph runs a step, and at which sizes graphs are captured (host-only; decided on the
driver, sent to every tensor-parallel rank).

Two kinds of graphs, picked per step by `CudaGraphDispatcher` (full -> piecewise -> eager):
- FULL (full.py): pure-decode batches (one query token per sequence) replay a whole-model graph
  captured at the next capture size, LM head included.
- PIECEWISE (piecewise.py, compiled models): any batch of up to the largest capture size (prefill
  chunks and decodes mixed) is padded to the next size; each compiled piece replays its graph of
  that size and the attention ops run eagerly between them.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass


def default_capture_sizes() -> list[int]:
    """1, 2, 4, then steps of 8 to 256, then steps of 16 to 512 (vLLM's list)."""
    return [1, 2, 4] + list(range(8, 257, 8)) + list(range(272, 513, 16))


def graph_sizes(compilation, max_num_seqs: int, max_num_batched_tokens: int) -> tuple[list[int], list[int]]:
    """(full, piecewise) capture sizes for `compilation` (a CompileConfig, or None: no graphs).
    Full graphs serve pure-decode batches (at most max_num_seqs tokens); piecewise graphs serve
    any batch of the step budget, and need compiled pieces (level >= 1)."""
    if compilation is None:
        return [], []
    sizes = list(compilation.cudagraph_capture_sizes) or default_capture_sizes()
    mode = compilation.cudagraph_mode
    full = [s for s in sizes if s <= min(max_num_seqs, max_num_batched_tokens)]
    piecewise = [s for s in sizes if s <= max_num_batched_tokens]
    return (sorted(full) if mode in ("full", "full_and_piecewise") else [],
            sorted(piecewise) if mode in ("piecewise", "full_and_piecewise") and compilation.level >= 1 else [])


def next_size(sizes: tuple[int, ...], n: int) -> int | None:
    i = bisect.bisect_left(sizes, n)
    return sizes[i] if i < len(sizes) else None


@dataclass(frozen=True)
class CudaGraphDispatcher:
    """Which graph runs a step (host-only: decided on the driver, sent to every TP rank)."""

    full_sizes: tuple[int, ...] = ()
    piecewise_sizes: tuple[int, ...] = ()

    def dispatch(self, num_tokens: int, num_seqs: int) -> tuple[str, int | None]:
        """("full", padded size) for a pure-decode batch that fits a full graph, else
        ("piecewise", padded size) for a batch that fits a piecewise graph, else ("none", None)."""
        if num_tokens == num_seqs:
            size = next_size(self.full_sizes, num_tokens)
            if size is not None:
                return "full", size
        size = next_size(self.piecewise_sizes, num_tokens)
        if size is not None:
            return "piecewise", size
        return "none", None
