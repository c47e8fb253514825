"""CUDA graphs: the static input buffers that graphs read, full-model decode graphs, and the
dispatcher that picks a graph for each step.

A decode step of a small model is a few hundred short kernels; launching them one by one from
Python leaves the GPU idle between them. A CUDA graph records the launches once per batch size
and replays them with one call. Replays read and write fixed addresses, so every per-step input
(token ids, positions, slot mapping, cu_seqlens_q, seq_lens, block tables) lives in a static
device buffer owned by the runner (`InputBuffers`: one int64 buffer, the int32 inputs in a region
of it), and a step copies its values there from pinned host twins in one copy (non-blocking:
preparing a step never waits for the GPU).

Two kinds of graphs, picked per step by `CudaGraphDispatcher` (full -> piecewise -> eager):
- FULL: pure-decode batches (one query token per sequence) replay a whole-model graph captured
  at the next capture size, LM head included (every row of such a batch is sampled; the graph
  writes the logits into the runner's static buffer, and their argmax, greedy sampling, into its
  own input ids: at batch 1-2 in the LM head's kernel); the rows past the real batch are padding
  that the kernels skip (slot -1: no KV write; q_len 0 and seq_len 0: output row zeroed; block
  table row 0: the null block).
- PIECEWISE (compiled models, piecewise_graphs.py): any batch of up to the largest capture size
  (prefill chunks and decodes mixed) is padded to the next size; each compiled piece replays its
  graph of that size and the attention ops run eagerly between them.
Both are captured largest first into ONE memory pool (piecewise first), so the smaller ones
reuse the largest one's activation memory.

Memory: graphs hold the KV cache's addresses, so they are captured after the cache exists. The
engine sizes the cache leaving `memory.cuda_memory_reserve` free (an estimate of eager
activations + the graphs + logits); measured and estimated sizes are logged after capture.
On an H100, smollm2-135m -O2 (warm start, lazy_instantiate_ab_gpu.log): piecewise graphs of
1..512 tokens (31 pieces x 51 sizes) in ~0.9 s and 180 MiB (each is instantiated on its first
replay, piecewise_graphs.py), then full graphs of 1..256 in 0.3-0.5 s and 28 MiB more (the pool
is reused). A mixed step of 8 decodes + a 128-token prefill chunk: 2.0 ms with piecewise graphs,
6.6 ms without (measured at an earlier commit).

The argmax kernel at the end of a full graph also made batch-64 graphs faster in an A/B on one
H100: 135M 1.77 -> 1.64 ms, 8B 9.70 -> 9.55 ms (the kernels after cuBLAS GEMMs started ~0.7 us
sooner). The final run on another H100 gave 1.66 and 9.73 ms, with no A/B there. The cause is
not known (benchmarks/results/argmax_in_graph_ab_gpu.log). The batch-64 graph is sensitive the
other way too: copying the sampled ids out by a kernel after each step (instead of a copy-engine
transfer) saved ~5 us a step at batch 1 but left the 135M batch-64 graph replay 6% slower in
every run (1.66 -> 1.77 ms), so the ids leave by the copy engine
(benchmarks/results/copy_pinned_ab_gpu.log).
"""

from __future__ import annotations

import bisect
import logging
import time
from dataclasses import dataclass
from typing import Iterable

import numpy as np
import torch
from tqdm import tqdm

from compilelm.distributed.parallel_state import get_tp_rank
from compilelm.forward_context import AttentionMetadata, ForwardContext, set_forward_context

logger = logging.getLogger(__name__)


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


def _next_size(sizes: tuple[int, ...], n: int) -> int | None:
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
            size = _next_size(self.full_sizes, num_tokens)
            if size is not None:
                return "full", size
        size = _next_size(self.piecewise_sizes, num_tokens)
        if size is not None:
            return "piecewise", size
        return "none", None


@dataclass
class HostBatch:
    """One step's inputs on the host, before padding."""

    input_ids: np.ndarray  # int64 [num_tokens]
    positions: np.ndarray  # int64 [num_tokens]
    slot_mapping: np.ndarray  # int64 [num_tokens]
    cu_seqlens_q: np.ndarray  # int32 [num_seqs + 1]
    seq_lens: np.ndarray  # int32 [num_seqs]
    block_tables: np.ndarray  # int32 [num_seqs, max_blocks_in_batch]; padding -> null block 0
    logits_idx: np.ndarray  # int64 [num_logits_rows]: the rows of the output whose logits are needed
    max_query_len: int


class InputBuffers:
    """Static device tensors for a step's inputs, filled by one host -> device copy per step.

    A step's inputs sit back to back in one int64 buffer (the int32 ones in a region of it viewed
    as int32), packed at offsets that depend only on the step's padded sizes, so a graph replayed
    at its size reads the addresses it captured:

        [input_ids: T][positions: T][slot_mapping: T][int32: cu_seqlens_q S + 1, seq_lens S,
         block_tables S * W][logits_idx: L][pending rows: P][pending src: P]

    (T tokens, S sequences, W block-table width, L logits rows, P pending rows), each field at a
    16-byte aligned offset: Inductor copies a misaligned input of a compiled piece to an aligned
    buffer before every call (at batch 1 `positions`, 8 bytes in, took a memcpy node per piece
    that takes it, ~2.5 us of a decode graph each on an H100). It has two pinned
    host twins used in turn: with async scheduling the host fills step N+1's inputs while step N's
    copy may still be waiting in the stream, so step N+1 writes the other twin. Before a twin is
    rewritten, the event recorded after its last copy is waited on (already passed in practice:
    the engine has waited for step N-1's output by then). Seven copies a step became one: at batch
    1 each small copy is a microsecond of GPU time and a launch gap in front of the graph.

    input_ids is also where a full graph leaves each row's argmax (its greedy next token): a step
    whose first rows decode exactly those tokens, row for row, copies from past them (`in_place`)."""

    def __init__(self, max_tokens: int, max_seqs: int, max_blocks: int, device: torch.device):
        self.max_blocks = max_blocks  # block-table width of the captured graphs
        pinned = device.type == "cuda"
        size = 6 * max_tokens + (2 * max_seqs + 2 + max_seqs * max_blocks) // 2 + 16  # (+ the alignment gaps)
        self.hosts = [torch.zeros(size, dtype=torch.int64, pin_memory=pinned) for _ in range(2)]
        self.dev = torch.zeros(size, dtype=torch.int64, device=device)
        self.copied = [torch.cuda.Event() if pinned else None for _ in self.hosts]  # each twin's last copy
        self.turn = 0

    def load(self, b: HostBatch, num_tokens: int, num_seqs: int, width: int,
             pending: tuple[np.ndarray, np.ndarray] | None = None, in_place: int = 0):
        """Copies `b`, padded to `num_tokens` tokens and `num_seqs` sequences with block tables
        `width` wide (and the pending rows' (rows, src) index arrays), into the buffer, except the
        first `in_place` input ids (already there); returns (input_ids, positions, metadata,
        logits_idx, pending): views of the device buffer, pending = (rows, src) views or None."""
        s, t = len(b.seq_lens), num_tokens
        self.turn ^= 1
        host, copied = self.hosts[self.turn], self.copied[self.turn]
        if copied is not None:
            copied.synchronize()  # its previous copy has left this twin (returns at once if never recorded)
        h64 = host.numpy()
        head = _pack(h64, [(b.input_ids, 0, t), (b.positions, 0, t), (b.slot_mapping, -1, t)], 2)
        start64 = _aligned(head[-1].stop, 2)
        h32 = h64[start64:].view(np.int32)
        views32 = _pack(h32, [(b.cu_seqlens_q, b.cu_seqlens_q[-1], num_seqs + 1), (b.seq_lens, 0, num_seqs)], 4)
        start = _aligned(views32[-1].stop, 4)
        tables = h32[start:start + num_seqs * width].reshape(num_seqs, width)
        tables[:] = 0  # padding: the null block
        tables[:s, :b.block_tables.shape[1]] = b.block_tables
        views32.append(slice(start, start + num_seqs * width))
        rest = [(b.logits_idx, 0, len(b.logits_idx))]
        if pending is not None:
            rest += [(pending[0], 0, len(pending[0])), (pending[1], 0, len(pending[1]))]
        offset = start64 + _aligned(views32[-1].stop, 4) // 2
        tail = [slice(v.start + offset, v.stop + offset) for v in _pack(h64[offset:], rest, 2)]
        dev, end = self.dev, tail[-1].stop
        dev[in_place:end].copy_(host[in_place:end], non_blocking=True)  # queued behind the previous step's work
        if copied is not None:
            copied.record()
        input_ids, positions, slots = (dev[v] for v in head)
        d32 = dev[start64:].view(torch.int32)
        cu, seq_lens, block_tables = (d32[v] for v in views32)
        meta = AttentionMetadata(slot_mapping=slots, cu_seqlens_q=cu, seq_lens=seq_lens,
                                 block_tables=block_tables.view(num_seqs, width),
                                 max_query_len=b.max_query_len, max_seq_len=int(b.seq_lens.max()))
        pending_views = None if pending is None else (dev[tail[1]], dev[tail[2]])
        return input_ids, positions, meta, dev[tail[0]], pending_views


def _aligned(n: int, align: int) -> int:
    return -(-n // align) * align


def _pack(host: np.ndarray, fields, align: int) -> list[slice]:
    """Writes each (values, pad, size) field, padded to size, into `host`, each at the next offset
    that is a multiple of `align` elements; returns the fields' slices."""
    views, offset = [], 0
    for values, pad, size in fields:
        offset = _aligned(offset, align)
        host[offset:offset + len(values)] = values
        host[offset + len(values):offset + size] = pad
        views.append(slice(offset, offset + size))
        offset += size
    return views


class CUDAGraphRunner:
    """Full-model graphs for pure-decode batches, one per capture size, in one memory pool."""

    def __init__(self, sizes: list[int], pool=None, stream: torch.cuda.Stream | None = None):
        self.sizes = sorted(sizes)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        # shared with the piecewise graphs (captured first); the pool reuses freed memory only
        # for captures on the stream that freed it
        self.pool, self.stream = pool, stream
        self.memory_bytes = 0

    def padded_size(self, num_tokens: int) -> int | None:
        """The smallest captured size that holds `num_tokens`, else None (run eagerly)."""
        return _next_size(tuple(self.sizes), num_tokens)

    @torch.inference_mode()
    def capture(self, forward_fn, buffers: InputBuffers, kv_caches: dict, warm_sizes: Iterable[int] = ()) -> None:
        """Captures `forward_fn(input_ids, positions)` (the model runner's: hidden states, then
        logits) at every size, largest first. An uncaptured
        warm-up run (lazy initialisation, Triton autotuning) comes before the first size and the
        sizes in `warm_sizes` (sizes that run other code). The dummy batch decodes one token per
        sequence over the null block and writes no KV (slot -1).

        `capture_begin` on our stream, not the `torch.cuda.graph` context: that one runs
        gc.collect() and empties the allocator's cache before every capture (~35 of them)."""
        torch.cuda.synchronize()
        torch.cuda.empty_cache()  # capture empties the allocator's cache: do it first, measure the pool alone
        free_before, t0 = torch.cuda.mem_get_info()[0], time.perf_counter()
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        if self.stream is None:
            self.stream = torch.cuda.Stream()  # the legacy default stream cannot be captured
        warm = set(warm_sizes)
        bar = tqdm(sorted(self.sizes, reverse=True), desc="compilelm: capturing full CUDA graphs", unit="graph",
                   disable=True if get_tp_rank() > 0 else None)  # one bar: rank 0's
        for i, size in enumerate(bar):
            ones = np.ones(size, dtype=np.int64)
            dummy = HostBatch(input_ids=ones * 0, positions=ones * 0, slot_mapping=-ones,
                              cu_seqlens_q=np.arange(size + 1, dtype=np.int32), seq_lens=np.ones(size, np.int32),
                              block_tables=np.zeros((size, 1), np.int32), logits_idx=np.zeros(0, np.int64),
                              max_query_len=1)
            input_ids, positions, meta, _, _ = buffers.load(dummy, size, size, buffers.max_blocks)
            with set_forward_context(ForwardContext(meta, kv_caches)):
                if i == 0 or size in warm:
                    forward_fn(input_ids, positions)
                    torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                self.stream.wait_stream(torch.cuda.current_stream())  # the inputs' copies
                with torch.cuda.stream(self.stream):
                    graph.capture_begin(pool=self.pool)
                    try:
                        out = forward_fn(input_ids, positions)
                    finally:
                        graph.capture_end()
            self.graphs[size] = (graph, out)
            used = free_before - torch.cuda.mem_get_info()[0]
            bar.set_postfix_str(f"{used / 2**20:.0f} MiB, {time.perf_counter() - t0:.1f} s")
        torch.cuda.synchronize()
        self.memory_bytes = free_before - torch.cuda.mem_get_info()[0]
        logger.info("captured %d full CUDA graphs (decode batch sizes %d..%d) in %.1f s, using %.0f MiB",
                    len(self.graphs), self.sizes[0], self.sizes[-1], time.perf_counter() - t0,
                    self.memory_bytes / 2**20)

    def replay(self, size: int) -> torch.Tensor:
        """Replays the graph of `size` on the values now in the input buffers; returns its output
        (what `forward_fn` returned at capture, valid until the next replay)."""
        graph, out = self.graphs[size]
        graph.replay()
        return out
