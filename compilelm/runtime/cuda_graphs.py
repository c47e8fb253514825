"""CUDA graphs: the static input buffers that graphs read, full-model decode graphs, and the
dispatcher that picks a graph for each step.

A decode step of a small model is a few hundred short kernels; launching them one by one from
Python leaves the GPU idle between them. A CUDA graph records the launches once per batch size
and replays them with one call. Replays read and write fixed addresses, so every per-step input
(token ids, positions, slot mapping, cu_seqlens_q, seq_lens, block tables) lives in a static
device buffer owned by the runner, and a step copies its values into the front of each buffer
from a pinned host twin (non-blocking: preparing a step never waits for the GPU).

Two kinds of graphs, picked per step by `CudaGraphDispatcher` (full -> piecewise -> eager):
- FULL: pure-decode batches (one query token per sequence) replay a whole-model graph captured
  at the next capture size, LM head included (every row of such a batch is sampled; the graph
  writes fp32 logits into the runner's static buffer); the rows past the real batch are padding
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
On an H100, smollm2-135m -O2: piecewise graphs of 1..512 tokens (31 pieces x 51 sizes) in 2.0 s
and 438 MiB, then full graphs of 1..64 in 0.2 s and 12 MiB more (the pool is reused). A mixed
step of 8 decodes + a 128-token prefill chunk: 2.0 ms with piecewise graphs, 6.6 ms without.
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
    """Static device tensors for a step's inputs, each with two pinned host twins used in turn.

    The host -> device copies are queued, not waited for: with async scheduling the host fills
    step N+1's inputs while step N's copies may still be waiting in the stream, so step N+1 writes
    the other twin. Before a twin is rewritten, the event recorded after its last copies is waited
    on (already passed in practice: the engine has waited for step N-1's output by then)."""

    def __init__(self, max_tokens: int, max_seqs: int, max_blocks: int, device: torch.device):
        self.max_blocks = max_blocks  # block-table width of the captured graphs
        pinned = device.type == "cuda"
        self.hosts: list[dict[str, torch.Tensor]] = [{}, {}]
        self.dev: dict[str, torch.Tensor] = {}
        for name, size, dtype in (("input_ids", max_tokens, torch.int64), ("positions", max_tokens, torch.int64),
                                  ("slot_mapping", max_tokens, torch.int64),
                                  ("cu_seqlens_q", max_seqs + 1, torch.int32), ("seq_lens", max_seqs, torch.int32),
                                  ("block_tables", max_seqs * max_blocks, torch.int32),  # flat: any [S, W] view
                                  ("logits_idx", max_tokens, torch.int64)):
            for host in self.hosts:
                host[name] = torch.zeros(size, dtype=dtype, pin_memory=pinned)
            self.dev[name] = torch.zeros(size, dtype=dtype, device=device)
        self.copied = [torch.cuda.Event() if pinned else None for _ in self.hosts]  # each twin's last copies
        self.turn = 0

    def load(self, b: HostBatch, num_tokens: int, num_seqs: int, width: int):
        """Copies `b`, padded to `num_tokens` tokens and `num_seqs` sequences with block tables
        `width` wide, into the buffers; returns (input_ids, positions, metadata, logits_idx),
        views of the device buffers."""
        s = len(b.seq_lens)
        self.turn ^= 1
        host, copied = self.hosts[self.turn], self.copied[self.turn]
        if copied is not None:
            copied.synchronize()  # its previous copies have left this twin (returns at once if never recorded)
        h = {k: v.numpy() for k, v in host.items()}
        fill = {"input_ids": (b.input_ids, 0, num_tokens), "positions": (b.positions, 0, num_tokens),
                "slot_mapping": (b.slot_mapping, -1, num_tokens),
                "cu_seqlens_q": (b.cu_seqlens_q, b.cu_seqlens_q[-1], num_seqs + 1),
                "seq_lens": (b.seq_lens, 0, num_seqs), "logits_idx": (b.logits_idx, 0, len(b.logits_idx))}
        for name, (values, pad, size) in fill.items():
            h[name][:len(values)] = values
            h[name][len(values):size] = pad
        tables = h["block_tables"][:num_seqs * width].reshape(num_seqs, width)
        tables[:] = 0
        tables[:s, :b.block_tables.shape[1]] = b.block_tables
        sizes = {name: size for name, (_, _, size) in fill.items()}
        sizes["block_tables"] = num_seqs * width
        d = {}
        for name, size in sizes.items():  # the copies queue behind the previous step's work
            d[name] = self.dev[name][:size]
            d[name].copy_(host[name][:size], non_blocking=True)
        if copied is not None:
            copied.record()
        meta = AttentionMetadata(slot_mapping=d["slot_mapping"], cu_seqlens_q=d["cu_seqlens_q"],
                                 seq_lens=d["seq_lens"], block_tables=d["block_tables"].view(num_seqs, width),
                                 max_query_len=b.max_query_len, max_seq_len=int(b.seq_lens.max()))
        return d["input_ids"], d["positions"], meta, d["logits_idx"]


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
            input_ids, positions, meta, _ = buffers.load(dummy, size, size, buffers.max_blocks)
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
