"""ModelRunner: owns the device tensors — weights, the paged KV cache — and runs one step.

Each step turns the scheduler's plan into flat tensors (every scheduled token of every request,
prefill chunks and decodes mixed), runs ONE forward, and samples one token for each request whose
step reached the end of its known tokens.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from compilelm.forward_context import AttentionMetadata, ForwardContext, set_forward_context
from compilelm.runtime.sampler import Sampler, SamplerOutput, gather_logprobs
from compilelm.runtime.scheduler import SchedulerOutput

logger = logging.getLogger(__name__)


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
        dtype = next(model.parameters()).dtype
        shape = (num_blocks, self.block_size, mc.num_key_value_heads, mc.head_dim)
        # kv_caches: layer name -> (key_cache, value_cache), each [num_blocks, block_size, num_kv_heads, head_dim]
        self.kv_caches = {name: (torch.zeros(shape, dtype=dtype, device=device),
                                 torch.zeros(shape, dtype=dtype, device=device))
                          for name in model.attention_layer_names()}
        self.sampler = Sampler()
        self.forward_fn = self._build_forward(config)

    def _build_forward(self, config):
        compilation = getattr(config, "compilation", None)
        if compilation is None or compilation.level == 0:
            return self.model
        from compilelm.graphs import compile_model
        t0 = time.perf_counter()
        fn = compile_model(self.model, compilation, config.cache_key_factors(self.model.config))
        from compilelm.graphs import compile_counters, default_cache_dir
        c = compile_counters
        logger.info("compiled (-O%d) in %.1f s: %d pieces, %d Inductor compiles, %d loaded from the "
                    "compile cache at %s", compilation.level, time.perf_counter() - t0, c.pieces,
                    c.inductor_compiles, c.artifacts_loaded, compilation.cache_dir or default_cache_dir())
        return fn

    @staticmethod
    def kv_bytes_per_block(model_config, block_size: int, dtype: torch.dtype) -> int:
        per_token = 2 * model_config.num_hidden_layers * model_config.num_key_value_heads * model_config.head_dim
        return per_token * block_size * torch.empty((), dtype=dtype).element_size()

    def prepare_inputs(self, sched: SchedulerOutput):
        ids, pos, slots, cu, seq_lens, sample_idx, tables = [], [], [], [0], [], [], []
        bs = self.block_size
        for sr in sched.scheduled:
            start, n = sr.num_computed_tokens, sr.num_new_tokens
            p = np.arange(start, start + n, dtype=np.int64)
            blocks = np.asarray(sr.block_ids, dtype=np.int64)
            ids.append(np.asarray(sr.request.all_token_ids[start:start + n], dtype=np.int64))
            pos.append(p)
            slots.append(blocks[p // bs] * bs + p % bs)
            cu.append(cu[-1] + n)
            seq_lens.append(start + n)
            tables.append(sr.block_ids)
            if sr.do_sample:
                sample_idx.append(cu[-1] - 1)
        max_blocks = max(len(t) for t in tables)
        block_tables = np.zeros((len(tables), max_blocks), dtype=np.int32)  # padding -> null block 0
        for i, t in enumerate(tables):
            block_tables[i, :len(t)] = t
        dev = self.device
        as_t = lambda a, dt: torch.from_numpy(np.ascontiguousarray(a)).to(dev, dt)  # noqa: E731
        meta = AttentionMetadata(
            slot_mapping=as_t(np.concatenate(slots), torch.int64),
            cu_seqlens_q=as_t(np.asarray(cu), torch.int32),
            seq_lens=as_t(np.asarray(seq_lens), torch.int32),
            block_tables=as_t(block_tables, torch.int32),
            max_query_len=max(sr.num_new_tokens for sr in sched.scheduled),
            max_seq_len=max(seq_lens),
        )
        return (as_t(np.concatenate(ids), torch.int64), as_t(np.concatenate(pos), torch.int64), meta,
                torch.tensor(sample_idx, dtype=torch.int64, device=dev))

    @torch.inference_mode()
    def execute_model(self, sched: SchedulerOutput) -> StepOutput:
        """Runs one forward for the whole plan, then samples the requests that need a token."""
        input_ids, positions, meta, sample_idx = self.prepare_inputs(sched)
        with set_forward_context(ForwardContext(meta, self.kv_caches)):
            hidden = self.forward_fn(input_ids, positions)
        out = StepOutput([], None, self._prompt_logprobs(sched, hidden))
        out.sampled = [sr.request for sr in sched.scheduled if sr.do_sample]
        if out.sampled:
            logits = self.model.compute_logits(hidden[sample_idx])
            for i, req in enumerate(out.sampled):
                for fn in req.sampling_params.logits_processors:
                    logits[i] = fn(req.output_token_ids, logits[i])
            out.sampler_output = self.sampler(logits, out.sampled)
        return out

    def _prompt_logprobs(self, sched: SchedulerOutput, hidden: torch.Tensor) -> dict:
        """request id -> [(prompt position, LogprobsLists)] for the prompt tokens this step predicts."""
        result, offset = {}, 0
        for sr in sched.scheduled:
            req, start, n = sr.request, sr.num_computed_tokens, sr.num_new_tokens
            k = req.sampling_params.prompt_logprobs
            # position p predicts prompt token p + 1
            end = min(start + n, req.num_prompt_tokens - 1)
            if k is not None and start < end:
                logits = self.model.compute_logits(hidden[offset:offset + end - start])
                targets = torch.tensor(req.prompt_token_ids[start + 1:end + 1], device=logits.device)
                lists = gather_logprobs(torch.log_softmax(logits, dim=-1), targets, [k] * (end - start))
                result[req.request_id] = list(zip(range(start + 1, end + 1), lists))
            offset += n
        return result
