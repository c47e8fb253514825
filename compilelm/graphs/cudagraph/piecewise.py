"""Piecewise CUDA graphs: every compiled piece captured per padded batch size, attention eager.

A compiled model is N + 1 Inductor pieces with an attention op between each two
(graphs/split.py). Attention takes per-step metadata of any shape (how many sequences, how long
each is), so it cannot be recorded once per batch size; the pieces can, since their shapes depend
on the token count only. So each piece call site gets one graph per capture size, and a batch of
N tokens (prefill chunks and decodes mixed) is padded to the next size S: its pieces replay their
size-S graphs and its attention ops run eagerly on S rows. Padding rows are harmless: slot -1
writes no KV, and the attention kernels zero the rows past cu_seqlens_q[-1].

Addresses. A graph reads and writes the addresses it was captured with. Piece inputs are weights,
the runner's static input buffers and outputs of earlier piece graphs (all at fixed addresses),
and the attention outputs, which the eager attention op allocates anew each step. Those are copied
into a static buffer of the call site before each replay (vLLM avoids the copy with an attention
op that writes into an output buffer allocated by the previous piece). With DEBUG logging on,
every replay checks that the other tensor inputs are at their captured addresses.

Memory. Graphs share one pool and are captured largest size first; a graph's outputs are kept as
weak references (tensors over pool memory that do not keep it allocated, like vLLM's
`weak_ref_tensors`), so each smaller capture reuses the memory of the larger ones: the pool holds
about one eager step of the largest size, not one per size.

Instantiation. A piece graph is instantiated (cudaGraphInstantiate) on its first replay, not at
capture (`keep_graph=True`): instantiating all of them (pieces x sizes) slows every warm start,
while a workload replays the few sizes its mixed batches pad to (docs/perf.md, "CUDA graphs").
The first step at a size pays for instantiating its pieces once; the device memory an
instantiated graph takes (memory.PIECE_GRAPH_BYTES) is kept free by the worker's reserve either
way. Full decode graphs (full.py) are instantiated at capture: every decode step of their size
replays one.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import torch
from tqdm import tqdm

from compilelm.distributed.parallel_state import get_tp_rank
from compilelm.forward_context import ForwardContext, set_forward_context
from compilelm.graphs.step_inputs import HostBatch, InputBuffers

logger = logging.getLogger(__name__)


def weak_ref(x):
    """A tensor over `x`'s memory that does not keep it allocated (non-tensors pass through)."""
    if not isinstance(x, torch.Tensor):
        return x
    s = x.untyped_storage()
    storage = torch._C._construct_storage_from_data_pointer(s.data_ptr(), x.device, s.nbytes())
    return torch.empty((), dtype=x.dtype, device=x.device).set_(storage, x.storage_offset(), x.shape, x.stride())


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    output: tuple  # the piece's outputs, weak references
    copies: list  # [(argument index, static buffer)]: eager-made inputs, copied in before replay
    inputs: list  # per argument: data_ptr of a tensor read in place, a non-tensor's value, None if copied


class PieceGraphs:
    """One piece call site's graphs, one per capture size: what `CompiledModel.wrap_pieces`
    installs. Outside a piecewise step (`PiecewiseGraphs.size` None) it calls the piece itself."""

    def __init__(self, site: str, runner, owner: PiecewiseGraphs):
        self.site, self.runner, self.owner = site, runner, owner
        self.graphs: dict[int, _Graph] = {}
        self.buffers: dict[int, torch.Tensor] = {}  # argument index -> static buffer, largest size

    def __call__(self, *args):
        size = self.owner.size
        if size is None:
            return self.runner(*args)
        g = self.graphs.get(size)
        if g is None:
            if not self.owner.capturing:
                raise RuntimeError(f"piece {self.site} has no CUDA graph of {size} tokens "
                                   f"(captured: {sorted(self.graphs)})")
            return self._capture(size, list(args))
        for i, buf in g.copies:
            buf.copy_(args[i])
        if self.owner.debug:
            self._check(size, g, args)
        g.graph.replay()
        self.owner.num_replays += 1
        return g.output

    def _capture(self, size: int, args: list):
        owner, copies, inputs = self.owner, [], []
        for i, a in enumerate(args):
            if isinstance(a, torch.Tensor) and a.untyped_storage().data_ptr() not in owner.stable:
                args[i] = self._static_input(i, a).copy_(a)
                copies.append((i, args[i]))
                inputs.append(None)
            else:
                inputs.append(a.data_ptr() if isinstance(a, torch.Tensor) else a)
        graph = torch.cuda.CUDAGraph(keep_graph=True)  # instantiated on first replay (module docstring)
        with torch.cuda.stream(owner.stream):  # the legacy default stream cannot be captured
            graph.capture_begin(pool=owner.pool)
            try:
                out = self.runner(*args)
            finally:
                graph.capture_end()
        owner.stable.update(o.untyped_storage().data_ptr() for o in out if isinstance(o, torch.Tensor))
        self.graphs[size] = _Graph(graph, type(out)(weak_ref(o) for o in out), copies, inputs)
        return out  # strong references: the memory stays ours for the rest of this forward

    def _static_input(self, i: int, a: torch.Tensor) -> torch.Tensor:
        """A buffer shaped like `a` at a fixed address: a slice of the one made at the largest size."""
        buf = self.buffers.get(i)
        if (buf is not None and a.is_contiguous() and buf.dtype == a.dtype and buf.shape[1:] == a.shape[1:]
                and buf.shape[0] >= a.shape[0]):
            return buf[:a.shape[0]]
        self.buffers[i] = torch.empty_strided(a.shape, a.stride(), dtype=a.dtype, device=a.device)
        return self.buffers[i]

    def _check(self, size: int, g: _Graph, args) -> None:
        copied = {i for i, _ in g.copies}
        for i, (a, captured) in enumerate(zip(args, g.inputs)):
            if i in copied:
                continue
            got = a.data_ptr() if isinstance(a, torch.Tensor) else a
            if got != captured:
                raise RuntimeError(f"piece {self.site}, {size} tokens: input {i} is {got!r}, "
                                   f"the graph was captured with {captured!r}")


class PiecewiseGraphs:
    """Every piece call site's graphs, their shared pool, and the size of the running step."""

    def __init__(self, sizes: list[int], pool=None):
        self.sizes = sorted(sizes)
        self.pool = pool
        self.size: int | None = None  # padded token count of the running step; None: pieces run uncaptured
        self.capturing = False
        self.debug = False  # check input addresses on every replay (DEBUG logging at capture)
        self.sites: dict[str, PieceGraphs] = {}
        self.stable: set[int] = set()  # storage addresses that never move: weights, buffers, graph outputs
        self.stream: torch.cuda.Stream | None = None
        self.num_replays = 0  # piece graph replays so far
        self.memory_bytes = 0

    def wrap(self, site: str, runner) -> PieceGraphs:
        self.sites[site] = PieceGraphs(site, runner, self)
        return self.sites[site]

    @contextlib.contextmanager
    def at_size(self, size: int | None):
        """Run the forward inside with its pieces at `size` tokens (None: no graphs)."""
        prev, self.size = self.size, size
        try:
            yield
        finally:
            self.size = prev

    def begin(self, static_tensors) -> None:
        """Set up for capture: the pool, the capture stream, and the tensors (weights, input
        buffers) that pieces may read in place."""
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        self.stream = torch.cuda.Stream()
        self.stable.update(t.untyped_storage().data_ptr() for t in static_tensors)
        self.debug = logger.isEnabledFor(logging.DEBUG)

    @torch.inference_mode()
    def capture(self, forward_fn, buffers: InputBuffers, kv_caches: dict, static_tensors,
                warm_sizes: Iterable[int] = (),
                kv_scales: dict | None = None) -> None:
        """Captures every piece at every size, largest first, by running `forward_fn(input_ids,
        positions)` once per size. An uncaptured warm-up run comes first (lazy initialisation,
        loading and autotuning Triton kernels), then again only before the sizes in `warm_sizes`
        (sizes that run other code: static compile sizes): every other size runs the kernels the
        first one loaded. The dummy batch is one decode row of the null block plus padding rows."""
        self.begin(static_tensors)
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        free_before, t0 = torch.cuda.mem_get_info()[0], time.perf_counter()
        dummy = HostBatch(input_ids=np.zeros(1, np.int64), positions=np.zeros(1, np.int64),
                          slot_mapping=-np.ones(1, np.int64), cu_seqlens_q=np.array([0, 1], np.int32),
                          seq_lens=np.ones(1, np.int32), block_tables=np.zeros((1, 1), np.int32),
                          logits_idx=np.zeros(0, np.int64), max_query_len=1)
        bar = tqdm(sorted(self.sizes, reverse=True), desc="compilelm: capturing piecewise CUDA graphs",
                   unit="size", disable=True if get_tp_rank() > 0 else None)  # one bar: rank 0's
        warm = set(warm_sizes)
        for i, size in enumerate(bar):
            input_ids, positions, meta, _, _ = buffers.load(dummy, size, 1, 1)
            with set_forward_context(ForwardContext(meta, kv_caches, kv_scales or {})):
                if i == 0 or size in warm:
                    forward_fn(input_ids, positions)
                    torch.cuda.synchronize()
                self.capturing = True
                try:
                    with self.at_size(size):
                        forward_fn(input_ids, positions)
                finally:
                    self.capturing = False
            used = free_before - torch.cuda.mem_get_info()[0]
            bar.set_postfix_str(f"{used / 2**20:.0f} MiB, {time.perf_counter() - t0:.1f} s")
        torch.cuda.synchronize()
        self.memory_bytes = free_before - torch.cuda.mem_get_info()[0]
        logger.info("captured piecewise CUDA graphs (%d pieces x %d sizes, %d..%d tokens) in %.1f s, using %.0f MiB",
                    len(self.sites), len(self.sizes), self.sizes[0], self.sizes[-1], time.perf_counter() - t0,
                    self.memory_bytes / 2**20)
