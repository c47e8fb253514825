"""Token bitmasks: filled on the host by llguidance, applied to the logits on the device.

A mask row is int32 [ceil(vocab / 32)], bit j of word w allowing token 32 * w + j. The rows of a
step's constrained requests are filled in one call (llguidance's threads, GIL released) into a
pinned host buffer, copied without waiting, and applied to those logits rows in one batched op;
unconstrained rows are never touched. `MaskFiller` runs that call on a thread of its own, so the
engine does the previous step's host work meanwhile, and packs the masks with their rows for
`compilelm.ops.token_bitmask.mask_logits_rows_`. The masks are applied after the forward (for
CUDA graphs, after the replay: the logits are masked outside the graph, before sampling)."""

from __future__ import annotations

import concurrent.futures
import sys

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
    """A step's masks filled on a thread of its own into one reused host buffer (pinned for a GPU),
    packed for `compilelm.ops.token_bitmask.mask_logits_rows_`: k masks, then the k row indices.

    Contract: a fill may start only once the device has consumed the previous one (the engine
    starts it after waiting for the last step's sampled ids, which come after that step's mask
    copy), so the buffer is never rewritten under a pending copy.

    The mask thread needs the GIL twice: to call into llguidance (which then runs without it) and
    to return. The engine thread holds it meanwhile and would give it up only after the switch
    interval (5 ms) or when it blocks on the masks, so while a fill runs the interval is
    `handoff_interval` (the mask thread restores it when done): each handoff then costs tens of
    microseconds and the engine thread never waits for the mask thread to start.

    `threaded` (class default): False fills on the calling thread and returns a finished Future
    (bench_structured's `--mask-fill inline` compares the two)."""

    threaded = True
    handoff_interval = 5e-5  # seconds: sys.setswitchinterval while a fill runs

    def __init__(self, executor, vocab_size: int, pin: bool):
        self.executor, self.pin = executor, pin
        self.words = (vocab_size + 31) // 32
        self._buffer = torch.empty(0, dtype=torch.int32)
        self._thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="compilelm-mask")

    @torch.inference_mode()  # the buffer may be an inference tensor (made under the sampler's mode)
    def start(self, matchers: list, rows: list[int], also: list[int] | None = None) -> concurrent.futures.Future:
        """A Future of int32 [k * words + k] (a view of the buffer): matchers[i]'s mask at
        [i * words, (i + 1) * words), then `rows` (the logits row of each), k = len(matchers).
        `also[i]` >= 0: one more token row i allows (a reasoning gate's opening tag)."""
        k, words = len(matchers), self.words
        if k * (words + 1) > self._buffer.numel():
            self._buffer = torch.empty(max(k, 8) * (words + 1), dtype=torch.int32, pin_memory=self.pin)
        packed = self._buffer[:k * (words + 1)]
        packed[k * words:] = torch.tensor(rows, dtype=torch.int32)
        if not self.threaded:
            done = concurrent.futures.Future()
            done.set_result(self._fill_masks(matchers, packed, also or []))
            return done
        previous = sys.getswitchinterval()
        sys.setswitchinterval(min(previous, self.handoff_interval))
        return self._thread.submit(self._fill, matchers, packed, previous, also or [])

    def _fill(self, matchers: list, packed: torch.Tensor, previous: float, also: list[int]) -> torch.Tensor:
        """On the mask thread; `previous`: the switch interval to restore when done."""
        try:
            return self._fill_masks(matchers, packed, also)
        finally:
            sys.setswitchinterval(previous)

    def _fill_masks(self, matchers: list, packed: torch.Tensor, also: list[int]) -> torch.Tensor:
        args = [(m, i) for i, m in enumerate(matchers)]
        self.executor.unsafe_compute_mask_ptr(args, packed.data_ptr(), self.words * 4, len(matchers))
        with torch.inference_mode():  # (thread-local) the buffer may be an inference tensor
            for i, token in enumerate(also):
                if token >= 0:
                    bit = 1 << (token % 32)
                    word = i * self.words + token // 32
                    packed[word] = int(packed[word]) | (bit - (1 << 32) if bit >= 1 << 31 else bit)  # as int32
        return packed

    def shutdown(self) -> None:
        self._thread.shutdown(wait=False, cancel_futures=True)
