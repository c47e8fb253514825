"""ModelRunner: owns the device tensors — weights, the paged KV cache — and runs one step.

Each step turns the scheduler's plan into flat tensors (every scheduled token of every request,
prefill chunks and decodes mixed), runs ONE forward, and samples one token for each request whose
step reached the end of its known tokens.

A step has three parts, so that tensor-parallel ranks can share the middle one:
`prepare_step` (driver: the plan as host arrays, `StepInputs`), `run_step` (every rank: forward
and the logits of the rows that need them; under TP the forward's all-reduces and the LM head's
all-gather are collectives), `make_output` (driver: sampling and prompt logprobs).

With async scheduling (`execute_model_async`) a step is launched before the previous step's
sampled tokens reach the host: the rows that decode such a pending token take their input id from
the previous step's sampled-token tensor on the device (`StepInputs.pending_rows`). Under TP the
other ranks keep that tensor too (`receive_sampled`, as `StepInputs.share_sampled` says).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import gc
import logging
import time
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from compilelm.distributed.parallel_state import get_tp_size, kv_heads_per_rank
from compilelm.forward_context import AttentionMetadata, ForwardContext, set_forward_context
from compilelm.graphs.cudagraph.dispatch import CudaGraphDispatcher
from compilelm.graphs.cudagraph.full import CUDAGraphRunner
from compilelm.graphs.cudagraph.piecewise import PiecewiseGraphs
from compilelm.graphs.step_inputs import HostBatch, InputBuffers
from compilelm.layers.attention import kv_cache_scales
from compilelm.ops import prefill_attention, token_bitmask
from compilelm.ops.collectives import tensor_model_parallel_broadcast
from compilelm.runtime.async_step import AsyncStepOutput
from compilelm.runtime.memory import engine_graph_sizes, graph_memory_estimate
from compilelm.runtime.sampler import SampledTensors, Sampler, SamplerOutput, argmax_rows, gather_logprobs
from compilelm.runtime.scheduler import SchedulerOutput

logger = logging.getLogger(__name__)

@dataclass
class StepInputs:
    """What every rank needs to run one step (host arrays only: cheap to send to other ranks)."""

    batch: HostBatch  # batch.logits_idx: sampled rows first, then the prompt-logprob rows
    graph_mode: str  # "full" (a decode graph), "piecewise" (piece graphs, attention eager) or "none"
    graph_size: int | None  # the padded token count of the graph(s) to replay, else None
    num_sampled: int
    # Rows whose input id is the previous step's sampled token, still on the device (async
    # scheduling): input_ids[pending_rows[i]] = previous sampled[pending_src[i]].
    pending_rows: np.ndarray | None = None  # int64 [num_pending]
    pending_src: np.ndarray | None = None  # int64 [num_pending]
    # Async scheduling under TP: how the other ranks get this step's sampled ids on their device
    # (the next step's pending rows read them): "argmax" (every sampled request is plain greedy:
    # each rank takes the argmax of its logits, identical on every rank after the all-gather),
    # "broadcast" (rank 0 broadcasts what it sampled), None (they are not needed).
    share_sampled: str | None = None


@dataclass
class StepOutput:
    sampled: list  # the requests that got a token, in sampler-row order
    sampler_output: SamplerOutput | None
    prompt_logprobs: dict  # request id -> [(prompt position, LogprobsLists)]


class ModelRunner:
    def __init__(self, model: nn.Module, config, device: torch.device, num_blocks: int):
        self.model = model
        self.config = config
        self.device = device
        mc = model.config
        self.block_size = config.cache.block_size
        self.num_blocks = num_blocks
        dtype = config.cache.torch_cache_dtype(next(model.parameters()).dtype)  # float8_e4m3fn with fp8
        shape = (num_blocks, self.block_size, kv_heads_per_rank(mc.num_key_value_heads, get_tp_size()), mc.head_dim)
        # kv_caches: layer name -> (key_cache, value_cache), each [num_blocks, block_size, num_kv_heads, head_dim]
        self.kv_caches = {name: (torch.zeros(shape, dtype=dtype, device=device),
                                 torch.zeros(shape, dtype=dtype, device=device))
                          for name in model.attention_layer_names()}
        # kv_scales: layer name -> (k_scale, v_scale) of an fp8 cache (forward_context.py); empty otherwise
        self.kv_scales = kv_cache_scales(model) if config.cache.fp8 else {}
        self.sampler = Sampler()
        # The last async step's sampled ids (int64 [num_sampled], on the device) and each sampled
        # request's row in them: where the next step's pending rows read their input ids.
        self.last_sampled: tuple[torch.Tensor, dict[str, int]] | None = None
        self.greedy_ids: torch.Tensor | None = None  # int64 [rows]: the last full graph's argmax of its logits rows
        self.compiled = None  # the CompiledModel (-O1 and up): its pieces are what piecewise graphs capture
        self.forward_fn = self._build_forward(config)
        # On CUDA, step inputs go through static buffers (pinned host -> device, no sync), which
        # the graphs read; on CPU each step makes fresh tensors.
        self.buffers, self.cuda_graphs, self.piecewise_graphs = None, None, None
        self.logits_buffer = None  # [largest full graph, vocab], model dtype: the full graphs' output
        self.dispatcher = CudaGraphDispatcher()  # no graphs: every step eager
        if device.type == "cuda":
            t0 = time.perf_counter()
            prefill_attention.warm_up(*next(iter(self.kv_caches.values())),
                                      mc.num_attention_heads // get_tp_size(), next(model.parameters()).dtype)
            logger.info("prefill attention kernel ready in %.1f s", time.perf_counter() - t0)
            sched = config.scheduler
            full, piecewise = engine_graph_sizes(config)
            max_blocks = -(-config.max_model_len // self.block_size)
            self.buffers = InputBuffers(max(sched.max_num_batched_tokens, max(full + piecewise, default=0)),
                                        sched.max_num_seqs, max_blocks, device)
            self._capture_graphs(full, piecewise if self.compiled is not None else [])

    def _capture_graphs(self, full: list[int], piecewise: list[int]) -> None:
        """Piecewise graphs first, then full ones, each largest size first, all in one pool."""
        if not full and not piecewise:
            return
        pool, stream = torch.cuda.graph_pool_handle(), None
        # sizes with code of their own (static compile sizes) get a warm-up run before capture;
        # eager steps: every size
        warm = self.compiled.config.compile_sizes if self.compiled is not None else full
        if piecewise:
            self.piecewise_graphs = PiecewiseGraphs(piecewise, pool)
            self.compiled.wrap_pieces(self.piecewise_graphs.wrap)
            static = [*self.model.parameters(), *self.model.buffers(), self.buffers.dev]
            self.piecewise_graphs.capture(self.forward_fn, self.buffers, self.kv_caches, static, warm,
                                          kv_scales=self.kv_scales)
            stream = self.piecewise_graphs.stream
        if full:
            self.logits_buffer = torch.empty(max(full), self.model.config.vocab_size, device=self.device,
                                             dtype=next(self.model.parameters()).dtype)
            self.cuda_graphs = CUDAGraphRunner(full, pool, stream)
            self.cuda_graphs.capture(self._forward_logits, self.buffers, self.kv_caches, warm, kv_scales=self.kv_scales)
        self.dispatcher = CudaGraphDispatcher(tuple(full), tuple(piecewise))
        measured = sum(g.memory_bytes for g in (self.piecewise_graphs, self.cuda_graphs) if g is not None)
        estimate = graph_memory_estimate(self.model.config, next(self.model.parameters()).dtype, full, piecewise)
        logger.info("CUDA graph memory: %.0f MiB measured, %.0f MiB estimated (reserved before sizing the KV cache)",
                    measured / 2**20, estimate / 2**20)

    def _forward_logits(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """What a full decode graph runs: the forward, then the LM head over every row (each row
        of a pure-decode batch is sampled) into the static logits buffer, and each row's argmax
        into input_ids (greedy sampling done in the graph; the embedding read them long before):
        a next step that decodes those tokens row for row finds its input ids in place."""
        hidden = self.forward_fn(input_ids, positions)  # [size, hidden]
        return self.model.compute_logits(hidden, out=self.logits_buffer[:hidden.shape[0]], argmax_out=input_ids)

    def release_graphs(self) -> None:
        """Drops the CUDA graphs; later steps run eagerly. A tensor-parallel rank does this before
        it leaves its NCCL group: destroying a communicator while graphs that captured its
        collectives are alive hangs (pytorch/pytorch#115388; seen at TP=2)."""
        if self.piecewise_graphs is not None:
            for site in self.piecewise_graphs.sites.values():
                site.graphs.clear()
        if self.cuda_graphs is not None:
            self.cuda_graphs.graphs.clear()
        self.cuda_graphs = self.piecewise_graphs = None
        self.dispatcher = CudaGraphDispatcher()
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _build_forward(self, config):
        compilation = getattr(config, "compilation", None)
        if compilation is None or compilation.level == 0:
            return self.model
        from compilelm.graphs import CompiledModel, compile_counters, default_cache_dir
        t0 = time.perf_counter()
        self.compiled = CompiledModel(self.model, compilation, config.cache_key_factors(self.model.config))
        fn = self.compiled.compile()
        c = compile_counters
        logger.info("compiled (-O%d) in %.1f s: %d Inductor compiles, %d artifacts loaded from the "
                    "compile cache at %s", compilation.level, time.perf_counter() - t0,
                    c.inductor_compiles, c.artifacts_loaded, compilation.cache_dir or default_cache_dir())
        return fn

    def prepare_step(self, sched: SchedulerOutput, share_sampled: bool = False,
                     after: SchedulerOutput | None = None) -> StepInputs:
        """The plan as flat host arrays: every scheduled token of every request, and the rows whose
        logits are needed (the last row of each sampled request, then prompt-logprob rows). One
        Python pass gathers each request's scalars, ids and block table; positions and slots are
        then computed for all tokens at once (this runs on the host every step). `share_sampled`:
        the other TP ranks will need this step's sampled ids (async scheduling). `after`: the
        step whose tokens are pending, when its sampling is not launched yet (it must be before
        `run_step`); default the last `sample_async`'s."""
        scheduled, bs = sched.scheduled, self.block_size
        num_reqs = len(scheduled)
        starts = np.fromiter((sr.num_computed_tokens for sr in scheduled), np.int64, num_reqs)
        lens = np.fromiter((sr.num_new_tokens for sr in scheduled), np.int64, num_reqs)
        cu = np.zeros(num_reqs + 1, np.int64)
        np.cumsum(lens, out=cu[1:])
        tables = [sr.block_ids for sr in scheduled]
        widths = np.fromiter(map(len, tables), np.int64, num_reqs)
        block_tables = np.zeros((num_reqs, int(widths.max())), np.int32)  # pad: null block
        block_tables[np.arange(block_tables.shape[1]) < widths[:, None]] = np.concatenate(tables)  # row by row
        ids, pending_rows, pending_src, prompt_rows = [], [], [], []
        last_rows = sampled_rows([sr.request for sr in after.scheduled if sr.do_sample]) if after is not None else (
            None if self.last_sampled is None else self.last_sampled[1])
        for i, sr in enumerate(scheduled):
            request, start, n = sr.request, sr.num_computed_tokens, sr.num_new_tokens
            known = request.all_token_ids[start:start + n]
            ids += known
            if len(known) < n:  # the last row decodes the token still on the device
                ids.append(0)
                pending_rows.append(i)  # (the request's index; its last row below)
                # its source: the request's row in the last async step's output
                row = None if last_rows is None else last_rows.get(request.request_id)
                if row is None or start + n - 1 != len(request.all_token_ids) or request.num_output_placeholders < 1:
                    raise RuntimeError(f"request {request.request_id!r}: token {start + n - 1} is neither known "
                                       "nor pending from the previous step")
                pending_src.append(row)
            if request.sampling_params.prompt_logprobs is not None:
                num_prompt_rows = self._num_prompt_logprob_rows(sr)
                if num_prompt_rows:
                    prompt_rows.append(cu[i] + np.arange(num_prompt_rows, dtype=np.int64))
        # token t belongs to request req[t] and sits at position starts[req] + t - cu[req]
        req = np.repeat(np.arange(num_reqs), lens)
        positions = np.arange(cu[-1], dtype=np.int64) - cu[req] + starts[req]
        slots = block_tables[req, positions // bs].astype(np.int64) * bs + positions % bs
        do_sample = np.fromiter((sr.do_sample for sr in scheduled), bool, num_reqs)
        sample_idx = cu[1:][do_sample] - 1
        batch = HostBatch(np.asarray(ids, dtype=np.int64), positions, slots, cu.astype(np.int32),
                          (starts + lens).astype(np.int32), block_tables,
                          np.concatenate([sample_idx, *prompt_rows]), int(lens.max()))
        graph_mode, graph_size = self.dispatcher.dispatch(len(batch.input_ids), num_reqs)
        step = StepInputs(batch, graph_mode, graph_size, len(sample_idx))
        if share_sampled and len(sample_idx):
            greedy = all(sr.request.plain_greedy for sr in scheduled if sr.do_sample)
            step.share_sampled = "argmax" if greedy else "broadcast"
        if pending_rows:
            step.pending_rows = cu[1:][pending_rows] - 1
            step.pending_src = np.asarray(pending_src, dtype=np.int64)
        return step

    @staticmethod
    def _num_prompt_logprob_rows(sr) -> int:
        """Rows of this step that predict a prompt token whose logprob was asked for (position p
        predicts prompt token p + 1)."""
        req, start = sr.request, sr.num_computed_tokens
        if req.sampling_params.prompt_logprobs is None:
            return 0
        return max(0, min(start + sr.num_new_tokens, req.num_prompt_tokens - 1) - start)

    def prepare_inputs(self, b: HostBatch, graph_mode: str = "none", graph_size: int | None = None,
                       pending: tuple[np.ndarray, np.ndarray] | None = None, in_place: int = 0):
        """(input_ids, positions, metadata, logits_idx, pending) on the device, pending = the
        (rows, src) index arrays of `pending` or None. For a full graph the batch is padded to its
        size in tokens and sequences, block tables at full width; for piecewise graphs in tokens
        only (the padding rows belong to no sequence). The first `in_place` input ids are already
        on the device (InputBuffers.load)."""
        if self.buffers is not None:
            if graph_mode == "full":
                return self.buffers.load(b, graph_size, graph_size, self.buffers.max_blocks, pending, in_place)
            num_tokens = graph_size if graph_mode == "piecewise" else len(b.input_ids)
            return self.buffers.load(b, num_tokens, len(b.seq_lens), b.block_tables.shape[1], pending, in_place)
        dev = self.device
        as_t = lambda a, dt: torch.from_numpy(np.ascontiguousarray(a)).to(dev, dt)  # noqa: E731
        meta = AttentionMetadata(
            slot_mapping=as_t(b.slot_mapping, torch.int64),
            cu_seqlens_q=as_t(b.cu_seqlens_q, torch.int32),
            seq_lens=as_t(b.seq_lens, torch.int32),
            block_tables=as_t(b.block_tables, torch.int32),
            max_query_len=b.max_query_len,
            max_seq_len=int(b.seq_lens.max()),
        )
        return (as_t(b.input_ids, torch.int64), as_t(b.positions, torch.int64), meta,
                as_t(b.logits_idx, torch.int64),
                None if pending is None else tuple(as_t(a, torch.int64) for a in pending))

    @torch.inference_mode()
    def execute_model(self, sched: SchedulerOutput) -> StepOutput:
        """One step on this process alone (tensor_parallel_size 1; the executor splits the parts
        otherwise)."""
        step = self.prepare_step(sched)
        return self.make_output(sched, step, self.run_step(step))

    @torch.inference_mode()
    def run_step(self, step: StepInputs) -> torch.Tensor | None:
        """Runs one forward for the whole plan; returns logits [len(logits_idx), vocab] in the model
        dtype, or None if no row needs them. The step runs as `prepare_step` dispatched it: a full
        graph, the piece graphs of its padded size with attention eager between them, or eagerly."""
        b = step.batch
        self.greedy_ids = None
        pending = None if step.pending_rows is None else (step.pending_rows, step.pending_src)
        last, in_place = None if pending is None else self.last_sampled[0], 0
        if last is not None and self.buffers is not None and last.data_ptr() == self.buffers.dev.data_ptr():
            # the last full graph's argmax, still in input_ids: left in place where the rows match,
            # else saved before the host -> device copy overwrites it
            if _in_order(step.pending_rows) and _in_order(step.pending_src):
                in_place = len(step.pending_rows)
            else:
                last = last.clone()
        input_ids, positions, meta, logits_idx, pending = self.prepare_inputs(b, step.graph_mode, step.graph_size,
                                                                              pending, in_place)
        if pending is not None and not in_place:
            # after the host -> device copy, before the forward or graph replay reads input_ids
            # (for graphs, a static buffer): stream-ordered after the previous step's sampler
            self._scatter_pending(input_ids, step, last, *pending)
        num_rows = len(b.logits_idx)
        if step.graph_mode == "full":
            logits = self.cuda_graphs.replay(step.graph_size)  # [graph_size, vocab], LM head included
            if num_rows == 0:
                return None
            if _in_order(b.logits_idx):  # every row sampled, in order
                self.greedy_ids = input_ids[:num_rows]  # the graph's argmax (_forward_logits)
                return logits[:num_rows]
            return logits.index_select(0, logits_idx)
        pieces = (self.piecewise_graphs.at_size(step.graph_size) if step.graph_mode == "piecewise"
                  else contextlib.nullcontext())
        with set_forward_context(ForwardContext(meta, self.kv_caches, self.kv_scales)), pieces:
            hidden = self.forward_fn(input_ids, positions)
        if num_rows == 0:
            return None
        return self.model.compute_logits(hidden[logits_idx])

    @staticmethod
    def _scatter_pending(input_ids: torch.Tensor, step: StepInputs, sampled: torch.Tensor, rows: torch.Tensor,
                         src: torch.Tensor) -> None:
        # input_ids: int64 [>= num_tokens]; sampled: the last step's, int64 [its num_sampled];
        # rows, src: int64 [num_pending] on the device (step.pending_rows / pending_src)
        if _in_order(step.pending_rows) and _in_order(step.pending_src):
            n = len(step.pending_rows)
            input_ids[:n].copy_(sampled[:n])  # steady decode: row i takes the previous row i's token
        else:
            input_ids.index_copy_(0, rows, sampled.index_select(0, src))

    @torch.inference_mode()
    def execute_model_async(self, sched: SchedulerOutput, step: StepInputs | None = None) -> AsyncStepOutput:
        """Launches one step (on this rank alone) and returns before its sampled tokens reach the
        host: they are copied to pinned memory behind the step, and `AsyncStepOutput.get()`
        waits for them. Prompt logprobs (rare) are still gathered synchronously."""
        return self.sample_async(sched, *self.launch_forward(sched, step))

    @torch.inference_mode()
    def launch_forward(self, sched: SchedulerOutput, step: StepInputs | None = None
                       ) -> tuple[StepInputs, torch.Tensor | None]:
        """The first half of `execute_model_async`: the step's forward, launched; (inputs, logits).
        The engine runs the host's work on the previous step in between (grammars accept its
        tokens) before `sample_async` masks and samples these logits. `step`: its
        `prepare_step`, if already made."""
        step = step if step is not None else self.prepare_step(sched)
        return step, self.run_step(step)

    def warm_up_masks(self) -> None:
        """Compiles the grammar-mask kernel now (`serve` calls it at start, off any request's path)."""
        if self.device.type == "cuda":
            dtype = next(self.model.parameters()).dtype
            token_bitmask.warm_up(self.model.config.vocab_size, dtype, self.device)

    def start_masks(self, sched: SchedulerOutput) -> GrammarMasks | None:
        """The grammar masks of the step's constrained rows, started on the mask thread (each grammar
        has accepted the request's tokens so far); None if no row is constrained."""
        sampled = [sr.request for sr in sched.scheduled if sr.do_sample]
        rows = [i for i, req in enumerate(sampled) if req.grammar is not None and req.grammar.masks]
        if not rows:
            return None
        grammars = [sampled[i].grammar for i in rows]
        filler = grammars[0].backend.mask_filler(pin=self.device.type == "cuda")
        return GrammarMasks(len(rows), filler.words, filler.start([g.matcher for g in grammars], rows,
                                                                  [g.also_allowed for g in grammars]))

    @torch.inference_mode()
    def sample_async(self, sched: SchedulerOutput, step: StepInputs, logits: torch.Tensor | None,
                     masks: GrammarMasks | None = None, check=None) -> AsyncStepOutput:
        """The second half: sampling on the device, its ids copied back without waiting. `masks`:
        `start_masks(sched)`, started by the engine while it processed the previous step; `check`:
        see AsyncStepOutput. Under TP a step with share_sampled "broadcast" always broadcasts, even
        when sampling raises: the other ranks are already in the broadcast, and a skipped one
        would pair their next collective with ours."""
        try:
            out, sampled = self._sample(sched, step, logits, masks)
        except BaseException:
            if step.share_sampled == "broadcast":  # placeholder ids; the error ends the engine
                tensor_model_parallel_broadcast(torch.zeros(step.num_sampled, dtype=torch.int64, device=self.device))
            raise
        if step.share_sampled == "broadcast" and sampled is not None:
            sampled.token_ids = sampled.token_ids.contiguous()
            tensor_model_parallel_broadcast(sampled.token_ids)  # to receive_sampled on the other ranks
        self.last_sampled = None if sampled is None else (sampled.token_ids, sampled_rows(out.sampled))
        return AsyncStepOutput(out, sampled, check)

    @torch.inference_mode()
    def receive_sampled(self, step: StepInputs, logits: torch.Tensor | None) -> None:
        """A TP rank > 0 after `run_step` under async scheduling: this step's sampled ids (int64
        [num_sampled], on this rank's device) become `last_sampled`, as rank 0's `sample_async`
        left them there: the argmax of the sampled rows' logits (plain greedy: the same kernel on
        the same all-gathered logits as rank 0's sampler) or rank 0's broadcast."""
        n = step.num_sampled
        if step.share_sampled is None or n == 0 or logits is None:
            self.last_sampled = None
            return
        if step.share_sampled == "argmax":
            ids = self.greedy_ids[:n] if self.greedy_ids is not None else argmax_rows(logits[:n])
        else:
            ids = torch.empty(n, dtype=torch.int64, device=self.device)
            tensor_model_parallel_broadcast(ids)
        self.last_sampled = (ids, None)

    @torch.inference_mode()
    def make_output(self, sched: SchedulerOutput, step: StepInputs, logits: torch.Tensor | None) -> StepOutput:
        """Samples the requests that need a token; gathers the prompt logprobs asked for."""
        out, sampled = self._sample(sched, step, logits)
        if sampled is not None:
            out.sampler_output = sampled.to_output()
        return out

    def _sample(self, sched: SchedulerOutput, step: StepInputs, logits: torch.Tensor | None,
                masks: GrammarMasks | None = None) -> tuple[StepOutput, SampledTensors | None]:
        """Prompt logprobs, then the logits processors, the grammar masks of constrained rows
        (each grammar has accepted the request's tokens so far) and the sampler on the device
        for the requests that need a token (their result still on the device, None if none)."""
        out = StepOutput([], None, {})
        if logits is None:
            return out, None
        if len(logits) > step.num_sampled:  # rows past the sampled ones: prompt logprobs asked for
            out.prompt_logprobs = self._prompt_logprobs(sched, logits[step.num_sampled:])
        out.sampled = [sr.request for sr in sched.scheduled if sr.do_sample]
        if not out.sampled:
            return out, None
        logits = logits[:step.num_sampled]
        for i, req in enumerate(out.sampled):  # user functions of (output token ids, fp32 logits row) -> row
            for fn in req.sampling_params.logits_processors:
                logits = logits.float()  # fp32 rows for the user functions (a copy once, then a no-op)
                logits[i] = fn(req.output_token_ids, logits[i])
        masks = masks or self.start_masks(sched)
        packed = None
        if masks is not None:  # host masks of the constrained rows: one copy, then one kernel
            packed = (masks.packed.result().to(logits.device, non_blocking=True), masks.num_rows, masks.words)
        # a full graph's argmax (its input ids, in place: the next step's ids stay there)
        greedy = None if self.greedy_ids is None else self.greedy_ids[:step.num_sampled]
        positions = [sr.num_computed_tokens + sr.num_new_tokens for sr in sched.scheduled if sr.do_sample]
        return out, self.sampler.sample_tensors(logits, out.sampled, greedy, packed, positions)

    def _prompt_logprobs(self, sched: SchedulerOutput, logits: torch.Tensor) -> dict:
        """request id -> [(prompt position, LogprobsLists)]; `logits` holds the prompt-logprob rows
        of `prepare_step`, request after request."""
        result, offset = {}, 0
        for sr in sched.scheduled:
            n = self._num_prompt_logprob_rows(sr)
            if n == 0:
                continue
            req, start = sr.request, sr.num_computed_tokens
            k = req.sampling_params.prompt_logprobs
            rows = logits[offset:offset + n].float()
            targets = torch.tensor(req.prompt_token_ids[start + 1:start + n + 1], device=rows.device)
            lists = gather_logprobs(torch.log_softmax(rows, dim=-1), targets, [k] * n)
            result[req.request_id] = list(zip(range(start + 1, start + n + 1), lists))
            offset += n
        return result


@dataclass
class GrammarMasks:
    """A step's constrained rows being masked: their number, the mask width in int32 words, and
    the packed masks + row indices being filled (a Future of MaskFiller.start's host array)."""
    num_rows: int
    words: int
    packed: concurrent.futures.Future


def sampled_rows(sampled: list) -> dict[str, int]:
    """request id -> its row among a step's sampled ids (`sampled`: the requests that sample, in order)."""
    return {r.request_id: i for i, r in enumerate(sampled)}


def _in_order(index: np.ndarray) -> bool:
    """index == [0, 1, ..., len - 1]: a gather by it is a slice."""
    return np.array_equal(index, np.arange(len(index)))
