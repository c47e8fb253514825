"""Token bitmasks: filled on the host by llguidance, applied to the logits on the device.

A mask row is int32 [ceil(vocab / 32)], bit j of word w allowing token 32 * w + j. The rows of a
step's constrained requests are filled in one call (llguidance's threads, GIL released) into a
pinned host tensor, copied without waiting, and applied to those logits rows in one batched op;
unconstrained rows are never touched. It runs after the forward is launched (and, for CUDA
graphs, after the replay: the logits are masked outside the graph, before sampling)."""

from __future__ import annotations

import torch


def fill_token_bitmask(executor, matchers: list, vocab_size: int, pin: bool) -> torch.Tensor:
    """int32 [len(matchers), ceil(vocab_size / 32)] on the host: row i is matchers[i]'s mask."""
    words = (vocab_size + 31) // 32
    bitmask = torch.empty((len(matchers), words), dtype=torch.int32, pin_memory=pin)
    executor.unsafe_compute_mask_ptr([(m, i) for i, m in enumerate(matchers)], bitmask.data_ptr(),
                                     words * 4, len(matchers))
    return bitmask


def apply_token_bitmask(logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """logits[rows[i]] keeps the tokens bitmask[i] allows, the rest -> -inf (in place; returns logits)."""
    # logits: [num_rows, vocab] (any float dtype); rows: int64 [k] on logits' device;
    # bitmask: int32 [k, words] (host, pinned on CUDA)
    vocab = logits.shape[-1]
    bitmask = bitmask.to(logits.device, non_blocking=True)
    shifts = torch.arange(32, dtype=torch.int32, device=logits.device)
    allowed = ((bitmask.unsqueeze(-1) >> shifts) & 1).flatten(1)[:, :vocab].bool()  # [k, words * 32 -> vocab]
    masked = logits.index_select(0, rows).masked_fill_(~allowed, float("-inf"))
    return logits.index_copy_(0, rows, masked)
