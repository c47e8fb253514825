"""LLMEngine: owns the loop. Each `step()` is schedule -> run the model -> update -> detokenize;
with async scheduling (runtime/async_step.py) it launches step N+1 before it processes step N.

The scheduler decides who runs, the model runner owns the tensors, and this file turns tokens into
RequestOutputs: incremental text, stop strings, logprobs, and fan-out of `n > 1` requests into
child requests that share the prompt's KV blocks through prefix caching.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import gc
import itertools
import logging
import time
from dataclasses import dataclass, field, replace

from compilelm.config import EngineConfig, SchedulerConfig, scheduler_defaults
from compilelm.inputs import PromptType, parse_prompt
from compilelm.models.dtype import resolve_dtype
from compilelm.models.generation_config import load_generation_defaults
from compilelm.models.loader import load_model_config, resolve_model
from compilelm.models.tokenizer import load_chat_template, load_tokenizer
from compilelm.outputs import CompletionOutput, Logprob, RequestOutput
from compilelm.runtime.async_step import AsyncStepOutput, needs_host_state
from compilelm.runtime.detokenizer import IncrementalDetokenizer, check_stop_strings, detokenize_logprobs
from compilelm.runtime.executor import Executor
from compilelm.runtime.kv_cache_manager import KVCacheManager
from compilelm.runtime.request import Request, RequestStatus
from compilelm.runtime.scheduler import Scheduler, SchedulerOutput
from compilelm.runtime.structured_output import GuidanceBackend, RequestGrammar
from compilelm.runtime.structured_output.reasoning import ReasoningGate, reasoning_gate
from compilelm.sampling_params import RequestOutputKind, SamplingParams

logger = logging.getLogger("compilelm")


@contextlib.contextmanager
def _no_automatic_gc():
    """No automatic garbage collection inside (explicit `gc.collect()` still runs). An engine's
    startup makes little cyclic garbage but hundreds of thousands of long-lived objects (Dynamo's
    and Inductor's modules, imported on the way, the model, the KV block pool), and each full
    collection walks all of them (docs/perf.md, "Compile and warm start")."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


@dataclass
class _Child:
    """Per-sequence output state of one (child) request."""

    request: Request
    index: int
    detok: IncrementalDetokenizer
    logprobs: list[dict[int, Logprob]] | None
    cumulative_logprob: float = 0.0
    num_detokenized: int = 0
    prompt_logprobs: list | None = None  # [num_prompt_tokens], entry 0 stays None


@dataclass
class _Parent:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    children: list[_Child] = field(default_factory=list)
    prompt_counted: bool = False  # prompt tokens entered the metrics (even if a prefix-cache hit)

    @property
    def finished(self) -> bool:
        return all(c.request.is_finished for c in self.children)


# The engine's gc.freeze() is undone at interpreter exit, so the final collection still frees what
# it froze (extension objects never freed, Triton's among them, report leaks at exit).
atexit.register(gc.unfreeze)


class LLMEngine:
    @_no_automatic_gc()
    def __init__(self, config: EngineConfig):
        t0 = time.perf_counter()
        self.source = resolve_model(config.model, config.revision, config.download_dir)
        config = replace(config, dtype=resolve_dtype(config.dtype, self.source, config.torch_device().type))
        self.model_config = load_model_config(self.source, dict(config.model_overrides))
        self.generation_defaults = load_generation_defaults(self.source, config.generation_config,
                                                            dict(config.override_generation_config))
        if self.generation_defaults.sampling:
            SamplingParams(**self.generation_defaults.sampling_dict())  # a bad value fails now, named
            logger.warning("Default sampling parameters have been overridden by the model's generation config "
                           "(%s): %s; a request's own values still win. If this is not intended, start with "
                           "--generation-config vllm",
                           self.generation_defaults.source or "--override-generation-config",
                           self.generation_defaults.sampling_dict())
        self.model_config.verify_tensor_parallel(config.tensor_parallel_size)  # before starting ranks
        max_len = config.max_model_len or self.model_config.max_position_embeddings
        if max_len > self.model_config.max_position_embeddings:
            raise ValueError(f"max_model_len ({max_len}) exceeds the model's context length "
                             f"({self.model_config.max_position_embeddings})")
        sched = config.scheduler or SchedulerConfig(
            max_model_len=max_len, **scheduler_defaults(config.torch_device(), config.usage_context))
        if not sched.enable_chunked_prefill and sched.max_num_batched_tokens < max_len:
            # a whole prompt runs in one step: the budget holds the longest (vLLM does the same)
            logger.info("chunked prefill off: max_num_batched_tokens %d -> max_model_len %d",
                        sched.max_num_batched_tokens, max_len)
            sched = replace(sched, max_num_batched_tokens=max_len)
        async_scheduling = sched.async_scheduling
        if async_scheduling is None:  # on where the host's work can hide behind the GPU's (any TP size)
            async_scheduling = config.torch_device().type == "cuda"
        self.async_scheduling = async_scheduling
        self.config = config = replace(config, max_model_len=max_len, scheduler=replace(
            sched, max_model_len=max_len, async_scheduling=async_scheduling))
        self.device, self.dtype = config.torch_device(), config.torch_dtype()
        self.tokenizer = load_tokenizer(self.source, config.tokenizer, config.tokenizer_revision or config.revision,
                                        config.download_dir)
        if config.chat_template is not None:
            self.tokenizer.chat_template = load_chat_template(config.chat_template)
        self.executor = Executor(config)  # every rank loads its shard of the weights
        logger.info("weights loaded: %s (%s, %s) in %.1f s", self.source.name, self.dtype, self.device,
                    time.perf_counter() - t0)
        num_blocks = self._check_kv_blocks(self.executor.num_kv_blocks())
        self.executor.init_model_runner(num_blocks)  # KV cache, compile, CUDA graphs
        self.model_runner = self.executor.model_runner
        self.kv_cache_manager = KVCacheManager(config.cache.block_size, num_blocks,
                                               config.cache.enable_prefix_caching)
        self.scheduler = Scheduler(config.scheduler, self.kv_cache_manager)
        logger.info("scheduler: up to %d tokens and %d sequences a step (--max-num-batched-tokens, "
                    "--max-num-seqs; defaults as vLLM's for this device and entry point)",
                    config.scheduler.max_num_batched_tokens, config.scheduler.max_num_seqs)
        kv_dtype = str(config.cache.torch_cache_dtype(self.dtype)).removeprefix("torch.")
        logger.info("KV cache (%s): %d blocks x %d tokens = %d tokens; max concurrency at %d tokens "
                    "per request: %.1fx", kv_dtype, num_blocks - 1, config.cache.block_size,
                    (num_blocks - 1) * config.cache.block_size, max_len,
                    (num_blocks - 1) * config.cache.block_size / max_len)
        self._parents: dict[str, _Parent] = {}
        self._children: dict[str, tuple[_Parent, _Child]] = {}
        self._ids = itertools.count()
        self._in_flight: tuple[SchedulerOutput, AsyncStepOutput] | None = None  # async: the launched step
        # async, constrained rows: a step whose forward is launched and whose grammar masks are filling
        # (SchedulerOutput, launch_forward's (inputs, logits), GrammarMasks); sampled in the next step()
        self._unsampled: tuple | None = None
        self._host_state: dict[str, Request] = {}  # requests that may need `needs_host_state`
        self.eos_token_id = self.tokenizer.eos_token_id
        if self.eos_token_id is None and self.model_config.eos_token_ids:
            self.eos_token_id = self.model_config.eos_token_ids[0]
        # config.json's and generation_config.json's EOS ids (Qwen3, Llama 3 list several) end a request too
        self.extra_eos_ids = [t for t in dict.fromkeys((*self.model_config.eos_token_ids,
                                                        *self.generation_defaults.eos_token_ids))
                              if t != self.eos_token_id]
        self._structured_output: GuidanceBackend | None = None
        self.num_prompt_tokens_total = 0
        self.num_generation_tokens_total = 0
        # Everything alive now (modules, graphs, the model, the block pool) leaves the garbage
        # collector's generations: every step makes garbage (outputs, plans), and each full
        # collection would walk all of it (docs/perf.md, "Host overhead and async scheduling").
        # No collection first: startup garbage is small, and a collection is not free.
        gc.freeze()

    def _check_kv_blocks(self, blocks: int) -> int:
        per_request = -(-self.config.max_model_len // self.config.cache.block_size)
        if blocks - 1 < per_request:  # a full-length request could never finish
            raise ValueError(
                f"the KV cache holds {(blocks - 1) * self.config.cache.block_size} tokens, fewer than "
                f"max_model_len ({self.config.max_model_len}): lower max_model_len or give the cache more "
                "memory (kv_cache_memory_gb / gpu_memory_utilization / num_kv_blocks)")
        return blocks

    def shutdown(self) -> None:
        """Stops the other tensor-parallel ranks (also done at interpreter exit)."""
        if self._structured_output is not None:
            self._structured_output.shutdown()
        self.executor.shutdown()

    # -- requests ------------------------------------------------------------------------------

    def add_request(self, request_id: str | None, prompt: PromptType,
                    params: SamplingParams | None = None, arrival_time: float | None = None) -> str:
        """Queue a prompt (text, token ids, or vLLM's TextPrompt / TokensPrompt dicts); returns its id."""
        params = params or SamplingParams()
        request_id = request_id if request_id is not None else str(next(self._ids))
        if request_id in self._parents:
            raise ValueError(f"request_id {request_id!r} is already in use")
        text, token_ids = parse_prompt(prompt)
        if token_ids is None:
            token_ids = self.tokenizer.encode(text, add_special_tokens=True)
        self.validate_prompt(token_ids, params)
        if params.structured_outputs is not None:  # a GrammarError (ValueError) before anything is added
            self.structured_output.compile(params.structured_outputs)
        parent = _Parent(request_id, text, token_ids, params.output_kind)
        for i in range(params.n):
            child_params = params
            add_eos_ids = bool(self.extra_eos_ids) and not params.ignore_eos
            if params.n > 1 or add_eos_ids:
                child_params = params.clone()
                child_params.n = 1
                if params.n > 1 and params.seed is not None:
                    child_params.seed = params.seed + i
                if add_eos_ids:
                    child_params.stop_token_ids += self.extra_eos_ids
            child_id = request_id if params.n == 1 else f"{request_id}#{i}"
            req = Request(child_id, token_ids, child_params, self.eos_token_id, arrival_time)
            if params.structured_outputs is not None:
                req.grammar = RequestGrammar(self.structured_output.matcher(params.structured_outputs),
                                             self.structured_output, self.reasoning_gate, token_ids)
            detok = IncrementalDetokenizer(self.tokenizer, token_ids, params.skip_special_tokens,
                                           params.spaces_between_special_tokens)
            child = _Child(req, i, detok, [] if params.logprobs is not None else None)
            if params.prompt_logprobs is not None:
                child.prompt_logprobs = [None] * len(token_ids)
            parent.children.append(child)
            self._children[child_id] = (parent, child)
            if needs_host_state(req):
                self._host_state[child_id] = req
        self._parents[request_id] = parent
        for child in parent.children:
            self.scheduler.add_request(child.request)
        return request_id

    @functools.cached_property
    def reasoning_gate(self) -> ReasoningGate | None:
        """With `reasoning_parser`, where a constrained output's grammar starts (after its reasoning)."""
        return reasoning_gate(self.config.reasoning_parser, self.tokenizer)

    @property
    def structured_output(self) -> GuidanceBackend:
        """The grammar backend (made on first use: most engines never constrain an output)."""
        if self._structured_output is None:
            self._structured_output = GuidanceBackend(self.tokenizer, self.model_config.vocab_size,
                                                      [self.eos_token_id, *self.extra_eos_ids])
        return self._structured_output

    def default_sampling_params(self) -> dict:
        """SamplingParams fields from the model's generation config (--generation-config): what a
        request gets for the fields it does not set (vLLM's get_diff_sampling_param)."""
        return self.generation_defaults.sampling_dict()

    def validate_prompt(self, token_ids: list[int], params: SamplingParams) -> None:
        if not token_ids:
            raise ValueError("prompt must not be empty")
        vocab = self.model_config.vocab_size
        bad = [t for t in token_ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token id {bad[0]} is out of vocabulary (size {vocab})")
        max_len = self.config.max_model_len
        if len(token_ids) >= max_len:
            raise ValueError(f"prompt has {len(token_ids)} tokens, but the maximum context length "
                             f"is {max_len} tokens (prompt + at least one output token)")

    def abort_request(self, request_ids: str | list[str]) -> None:
        for rid in [request_ids] if isinstance(request_ids, str) else request_ids:
            parent = self._parents.pop(rid, None)
            if parent is None:
                continue
            ids = [c.request.request_id for c in parent.children]
            self.scheduler.finish_requests(ids, RequestStatus.FINISHED_ABORTED)
            for cid in ids:
                self._children.pop(cid, None)
                self._host_state.pop(cid, None)

    def has_unfinished_requests(self) -> bool:
        """True while a request is unfinished or a step is in flight (`step()` drains it)."""
        return bool(self._parents) or self._in_flight is not None or self._unsampled is not None

    # -- the loop ------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        if not self.async_scheduling:
            sched_out = self.scheduler.schedule()
            if not sched_out.scheduled:
                return []
            return self._process_step(sched_out, self.executor.execute_model(sched_out))
        outputs = []
        if (self._in_flight is not None or self._unsampled is not None) and self._must_sync():
            self._sample_unsampled()
            outputs = self._process_in_flight()  # N's tokens first: N+1's sampling reads them
        sched_out = self.scheduler.schedule()  # (N+1)
        step = None
        if sched_out.scheduled and self._unsampled is not None:
            # N+1's host arrays while N's masks still fill (they need N's rows, not its tokens)
            step = self.executor.prepare_step(sched_out, after=self._unsampled[0])
        self._sample_unsampled()  # N's sampling, once its grammar masks are filled
        launched = None
        if sched_out.scheduled:
            if self._in_flight is not None and _samples_a_grammar(sched_out):
                # N+1's forward runs while N's tokens come back and the grammars accept them; N+1's
                # masks then fill on the mask thread while this one processes N, schedules N+2 and
                # prepares its inputs, and N+1 samples in the next step(), before N+2's forward
                forward = self.executor.launch_forward(sched_out, step)
                self._accept_grammar_tokens(self._in_flight[1].get())
                self._unsampled = (sched_out, forward, self.executor.model_runner.start_masks(sched_out))
            else:
                launched = (sched_out, self.executor.execute_model_async(sched_out, step))
        if self._in_flight is not None:
            outputs = self._process_in_flight()  # N, while N+1 runs
        self._in_flight = launched
        return outputs

    def _sample_unsampled(self) -> None:
        """Launches the sampling of the step whose masks were filling; it becomes the step in flight."""
        if self._unsampled is not None:
            sched_out, forward, masks = self._unsampled
            self._unsampled = None
            self._in_flight = (sched_out, self.executor.sample_async(sched_out, *forward, masks))

    def _must_sync(self) -> bool:
        """A request with a token in flight whose next sample needs that token on the host."""
        return any(r.num_output_placeholders and needs_host_state(r) for r in self._host_state.values())

    @staticmethod
    def _accept_grammar_tokens(step_out) -> None:
        """The constrained requests' tokens of a step, into their grammars (ahead of the scheduler)."""
        if step_out.sampler_output is None:
            return
        for req, token in zip(step_out.sampled, step_out.sampler_output.token_ids):
            if req.grammar is not None and not req.is_finished and not req.grammar.accept(
                    token, req.num_output_tokens, req.request_id):
                req.grammar = None

    def _process_in_flight(self) -> list[RequestOutput]:
        sched_out, launched = self._in_flight
        self._in_flight = None
        return self._process_step(sched_out, launched.get())

    def _process_step(self, sched_out: SchedulerOutput, step_out) -> list[RequestOutput]:
        """Step N's output -> scheduler update, logprobs, detokenized text, RequestOutputs."""
        sampled_reqs, sampler_out = step_out.sampled, step_out.sampler_output
        tokens = {} if sampler_out is None else {
            r.request_id: t for r, t in zip(sampled_reqs, sampler_out.token_ids)}
        for rid, entries in step_out.prompt_logprobs.items():
            if rid in self._children:
                child = self._children[rid][1]
                for pos, lists in entries:
                    child.prompt_logprobs[pos] = detokenize_logprobs(self.tokenizer, lists)
        for sr in sched_out.scheduled:  # a prompt counts once, when its request first runs
            if sr.request.output_token_ids:  # it ran before
                continue
            parent = self._children.get(sr.request.request_id, (None,))[0]
            if parent is not None and not parent.prompt_counted:
                parent.prompt_counted = True
                self.num_prompt_tokens_total += len(parent.prompt_token_ids)
        updated = self.scheduler.update_from_output(sched_out, tokens)
        self.num_generation_tokens_total += len(updated)
        if sampler_out is not None:
            got_token = {id(r) for r in updated}  # not the dropped tokens of finished requests
            for req, lp in zip(sampled_reqs, sampler_out.logprobs):
                if lp is not None and id(req) in got_token and req.request_id in self._children:
                    self._record_logprobs(self._children[req.request_id][1], lp)
        touched: dict[str, _Parent] = {}
        finishing: set[str] = set()  # parents with a child that finished this step (a stop string too)
        for req in updated:
            entry = self._children.get(req.request_id)
            if entry is None:
                continue
            parent, child = entry
            # a final-only output without stop strings is detokenized once, when it finishes
            if parent.output_kind is RequestOutputKind.CUMULATIVE or req.is_finished or req.sampling_params.stop:
                self._detokenize(child)
            touched[parent.request_id] = parent
            if req.is_finished:
                finishing.add(parent.request_id)
        return [self._make_output(p) for rid, p in touched.items()
                if p.output_kind is RequestOutputKind.CUMULATIVE or (rid in finishing and p.finished)]

    def _record_logprobs(self, child: _Child, lp) -> None:
        child.cumulative_logprob += lp.logprobs[0]
        if child.logprobs is not None:
            child.logprobs.append(detokenize_logprobs(self.tokenizer, lp))

    def _detokenize(self, child: _Child) -> None:
        req = child.request
        new_ids = req.output_token_ids[child.num_detokenized:]
        child.num_detokenized = req.num_output_tokens
        params = req.sampling_params
        if new_ids and req.status == RequestStatus.FINISHED_STOPPED and (
                new_ids[-1] in (req.eos_token_id, req.stop_reason)):
            new_ids = new_ids[:-1]  # the EOS / stop token itself is not part of the text
        delta = child.detok.add_tokens(new_ids)
        if params.stop and not req.is_finished:
            hit = check_stop_strings(child.detok.output_text, len(delta), params.stop,
                                     params.include_stop_str_in_output)
            if hit is not None:
                stop_str, truncate_to = hit
                child.detok.truncate(truncate_to)
                self.scheduler.finish_requests([req.request_id], RequestStatus.FINISHED_STOPPED)
                req.stop_reason = stop_str

    def _make_output(self, parent: _Parent) -> RequestOutput:
        outs, finished = [], True
        for c in parent.children:
            r = c.request
            done = r.is_finished
            finished = finished and done
            outs.append(CompletionOutput(
                index=c.index, text=c.detok.output_text, token_ids=list(r.output_token_ids),
                cumulative_logprob=c.cumulative_logprob if c.logprobs is not None else None,
                logprobs=c.logprobs, finish_reason=r.finish_reason if done else None,
                stop_reason=r.stop_reason))
        if finished:
            self._parents.pop(parent.request_id, None)
            for c in parent.children:
                self._children.pop(c.request.request_id, None)
                self._host_state.pop(c.request.request_id, None)
        first = parent.children[0]
        return RequestOutput(parent.request_id, parent.prompt, parent.prompt_token_ids,
                             first.prompt_logprobs, outs, finished, first.request.num_cached_tokens)

    def stats(self) -> dict:
        pool = self.kv_cache_manager
        pc = pool.prefix_cache_stats
        return {
            "num_running": self.scheduler.num_running,
            "num_waiting": self.scheduler.num_waiting,
            "kv_cache_usage": pool.usage,
            "num_preemptions": self.scheduler.num_preemptions,
            "prompt_tokens_total": self.num_prompt_tokens_total,
            "generation_tokens_total": self.num_generation_tokens_total,
            "prefix_cache_queries": pc.queries,
            "prefix_cache_hits": pc.hits,
        }


def _samples_a_grammar(sched_out: SchedulerOutput) -> bool:
    return any(sr.do_sample and sr.request.grammar is not None for sr in sched_out.scheduled)
