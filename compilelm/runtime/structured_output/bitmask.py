"""Token bitmasks: filled on the host by llguidance, applied to the logits on the device.

A mask row is int32 [ceil(vocab / 32)], bit j of word w allowing token 32 * w + j. The rows of a
step's constrained requests are filled in one call (llguidance's threads, GIL released) into a
pinned host buffer, copied without waiting, and applied to those logits rows in one batched op;
unconstrained rows are never touched. `MaskFiller` runs that call on a thread of its own, so the
engine does the previous step's host work meanwhile. The masks are applied after the forward (for
CUDA graphs, after the replay: the logits are masked outside the graph, before sampling)."""

from __future__ import annotations

import concurrent.futures
import threading

import torch


def fill_token_bitmask(executor, matchers: list, vocab_size: int, pin: bool,
                       out: torch.Tensor | None = None) -> torch.Tensor:
    """int32 [len(matchers), ceil(vocab_size / 32)] on the host: row i is matchers[i]'s mask
    (written into `out`'s first rows when given: contiguous int32 of that width)."""
    words = (vocab_size + 31) // 32
    if out is None:
        out = torch.empty((len(matchers), words), dtype=torch.int32, pin_memory=pin)
    bitmask = out[:len(matchers)]
    assert bitmask.dtype == torch.int32 and bitmask.shape[1] == words and bitmask.is_contiguous()
    executor.unsafe_compute_mask_ptr([(m, i) for i, m in enumerate(matchers)], bitmask.data_ptr(),
                                     words * 4, len(matchers))
    return bitmask


class MaskFiller:
    """`fill_token_bitmask` on a thread of its own, into one reused host buffer (pinned for a GPU).

    Contract: a fill may start only once the device has consumed the previous one (the engine
    starts it after waiting for the last step's sampled ids, which come after that step's mask
    copy), so the buffer is never rewritten under a pending copy."""

    def __init__(self, executor, vocab_size: int, pin: bool):
        self.executor, self.vocab_size, self.pin = executor, vocab_size, pin
        self._buffer = torch.empty(0, (vocab_size + 31) // 32, dtype=torch.int32)
        self._thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="compilelm-mask")

    def start(self, matchers: list) -> concurrent.futures.Future:
        """The masks of `matchers` (a Future of int32 [len(matchers), words], a view of the buffer)."""
        if len(matchers) > self._buffer.shape[0]:
            rows = max(len(matchers), 2 * self._buffer.shape[0], 8)
            self._buffer = torch.empty(rows, self._buffer.shape[1], dtype=torch.int32, pin_memory=self.pin)
        inside = threading.Event()
        future = self._thread.submit(self._fill, matchers, self._buffer[:len(matchers)], inside)
        # hand the GIL over until the mask thread is inside llguidance (which runs without it):
        # else the thread would wait for the GIL until this one next blocks, i.e. not run at all
        inside.wait()
        return future

    def _fill(self, matchers: list, bitmask: torch.Tensor, inside: threading.Event) -> torch.Tensor:
        words = bitmask.shape[1]
        rows = [(m, i) for i, m in enumerate(matchers)]
        inside.set()
        self.executor.unsafe_compute_mask_ptr(rows, bitmask.data_ptr(), words * 4, len(matchers))
        return bitmask

    def shutdown(self) -> None:
        self._thread.shutdown(wait=False, cancel_futures=True)


_SHIFTS: dict[torch.device, torch.Tensor] = {}  # [0, 1, ..., 31] int32 per device


def apply_token_bitmask(logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """logits[rows[i]] keeps the tokens bitmask[i] allows, the rest -> -inf (in place; returns logits)."""
    # logits: [num_rows, vocab] (any float dtype); rows: int64 [k] on logits' device;
    # bitmask: int32 [k, words] (host, pinned on CUDA)
    vocab = logits.shape[-1]
    bitmask = bitmask.to(logits.device, non_blocking=True)
    shifts = _SHIFTS.get(logits.device)
    if shifts is None:
        shifts = _SHIFTS[logits.device] = torch.arange(32, dtype=torch.int32, device=logits.device)
    allowed = ((bitmask.unsqueeze(-1) >> shifts) & 1).flatten(1)[:, :vocab].bool()  # [k, words * 32 -> vocab]
    masked = logits.index_select(0, rows).masked_fill_(~allowed, float("-inf"))
    return logits.index_copy_(0, rows, masked)
