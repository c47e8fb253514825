"""Full-model CUDA graphs for pure-decode batches, one per capture size, in one memory pool.

A full graph replays the whole forward at the next capture size, LM head included: every row of a
pure-decode batch is sampled, so the graph writes the logits into the runner's static buffer and
their argmax (greedy sampling) into its own input ids (at batch 1-2 in the LM head's kernel). Rows
past the real batch are padding that the kernels skip (slot -1: no KV write; q_len 0 and seq_len
0: output row zeroed; block table row 0: the null block). Full graphs are instantiated at capture
(every decode step of their size replays one); the sampled ids leave by a copy-engine transfer,
not a kernel (docs/perf.md, "CUDA graphs").
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable

import numpy as np
import torch
from tqdm import tqdm

from compilelm.distributed.parallel_state import get_tp_rank
from compilelm.forward_context import ForwardContext, set_forward_context
from compilelm.graphs.cudagraph.dispatch import next_size
from compilelm.graphs.step_inputs import HostBatch, InputBuffers

logger = logging.getLogger(__name__)


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
        return next_size(tuple(self.sizes), num_tokens)

    @torch.inference_mode()
    def capture(self, forward_fn, buffers: InputBuffers, kv_caches: dict, warm_sizes: Iterable[int] = (),
                kv_scales: dict | None = None) -> None:
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
            with set_forward_context(ForwardContext(meta, kv_caches, kv_scales or {})):
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
