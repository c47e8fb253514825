"""Continuous-batching scheduler: which requests run this step, and how many tokens each.

Every step is one flat batch under a token budget. Running requests go first, in arrival
order: a decode takes one token, an unfinished prefill its next chunk. When the KV cache has no
room, the latest-arrived running request is preempted (its blocks freed, to be recomputed
later) until the allocation fits. Then waiting requests are admitted first come, first served,
their prompts chunked to the budget that is left. There is no separate prefill or decode phase.

`schedule()` advances each request's `num_computed_tokens` at once, so the next step can be
scheduled before this one's output is back (async scheduling, runtime/async_step.py): a request
whose sampled token is still on the device has a placeholder (`num_output_placeholders`) and is
scheduled as a decode of that token; `update_from_output` later turns the placeholder into the
real token. Without async scheduling every update comes before the next schedule and no
placeholder is ever pending when scheduling.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from compilelm.config import SchedulerConfig
from compilelm.runtime.kv_cache_manager import KVCacheManager
from compilelm.runtime.request import Request, RequestStatus


@dataclass
class ScheduledRequest:
    request: Request
    num_new_tokens: int  # tokens to run: all_token_ids[num_computed_tokens : + num_new_tokens]
    num_computed_tokens: int  # tokens already in the KV cache (position of the first new token)
    block_ids: np.ndarray  # int32: the request's whole block table after allocation (a snapshot)
    do_sample: bool  # this step reaches the last known token, so sample the next one


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest]
    preempted_request_ids: list[str]

    @property
    def num_scheduled_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv_cache_manager: KVCacheManager):
        self.config = config
        self.kv_cache_manager = kv_cache_manager
        self.requests: dict[str, Request] = {}  # every unfinished request
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # in arrival order; the tail is preempted first
        self.num_preemptions = 0

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def has_unfinished_requests(self) -> bool:
        return bool(self.running or self.waiting)

    def add_request(self, request: Request) -> None:
        if not request.prompt_token_ids:
            raise ValueError(f"request {request.request_id!r}: prompt_token_ids is empty")
        if request.request_id in self.requests:
            raise ValueError(f"request_id {request.request_id!r} is already in use")
        request.status = RequestStatus.WAITING
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        scheduled: list[ScheduledRequest] = []
        preempted: list[Request] = []

        # running: decodes and the next chunks of partial prefills (every request, every step:
        # attributes and bound methods read once)
        running, allocate, plan = self.running, self.kv_cache_manager.allocate_slots, self._scheduled
        i = 0
        while i < len(running) and budget > 0:
            request = running[i]
            pending = request.num_output_placeholders
            if pending and self._will_finish_by_length(request):
                i += 1  # its last token is in flight: nothing left to run
                continue
            num_new = min(len(request.all_token_ids) + pending - request.num_computed_tokens, budget)
            while allocate(request, num_new) is None:
                victim = running.pop()
                self._preempt(victim)
                preempted.append(victim)
                if victim is request:
                    break
            if request.status is RequestStatus.PREEMPTED:
                break
            scheduled.append(plan(request, num_new))
            budget -= num_new
            i += 1

        # waiting: admit in FCFS order; after a preemption the cache is too tight to admit more
        max_num_seqs = self.config.max_num_seqs
        while self.waiting and not preempted and budget > 0 and len(self.running) < max_num_seqs:
            request = self.waiting[0]
            if request.num_output_placeholders:  # preempted with a token in flight: wait for it
                break
            computed_blocks, num_cached = self.kv_cache_manager.get_computed_blocks(request)
            num_new = request.num_tokens - num_cached
            if num_new > budget:
                if not self.config.enable_chunked_prefill:
                    break
                num_new = budget
            if self.kv_cache_manager.allocate_slots(request, num_new, computed_blocks) is None:
                break
            self.waiting.popleft()
            if request.status is RequestStatus.WAITING:
                request.num_cached_tokens = num_cached
            request.num_computed_tokens = num_cached
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            scheduled.append(self._scheduled(request, num_new))
            budget -= num_new

        return SchedulerOutput(scheduled, [r.request_id for r in preempted])

    def update_from_output(self, output: SchedulerOutput, sampled: dict[str, int]) -> list[Request]:
        """Append the sampled tokens (progress advanced in `schedule()`), finish stopped requests.
        Returns the requests that got a new token this step (finished ones included)."""
        got_token = []
        for s in output.scheduled:
            request = s.request
            if not s.do_sample:
                continue
            request.num_output_placeholders -= 1
            if request.is_finished:  # aborted or stopped after this step was scheduled: discarded
                continue
            # (a request preempted after this step was scheduled still gets its token)
            token = sampled[request.request_id]
            if request.grammar is not None and not request.grammar.accept(token, request.num_output_tokens,
                                                                          request.request_id):
                request.grammar = None  # refused (logged): unconstrained from here on
            request.append_output_token(token)
            got_token.append(request)
            status = self._check_stop(request)
            if status is not None:
                self._finish(request, status)
        if any(r.is_finished for r in got_token):
            self.running = [r for r in self.running if not r.is_finished]
            self.waiting = deque(r for r in self.waiting if not r.is_finished)
        return got_token

    def finish_requests(self, request_ids: str | Iterable[str], status: RequestStatus) -> None:
        """Finish requests from outside the step: aborts, and stop strings the detokenizer found."""
        if not RequestStatus.is_finished(status):
            raise ValueError(f"status must be a finished status, got {status.name}")
        if isinstance(request_ids, str):
            request_ids = (request_ids,)
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is None:
                continue  # unknown or already finished
            if request.status is RequestStatus.RUNNING:
                self.running.remove(request)
            else:
                self.waiting.remove(request)
            self._finish(request, status)

    def _scheduled(self, request: Request, num_new: int) -> ScheduledRequest:
        """The plan entry; the request's progress advances now (its tokens are in flight)."""
        start = request.num_computed_tokens
        do_sample = start + num_new == len(request.all_token_ids) + request.num_output_placeholders
        request.num_computed_tokens = start + num_new
        if do_sample:
            request.num_output_placeholders += 1
        return ScheduledRequest(request, num_new, start, self.kv_cache_manager.get_block_ids(request.request_id),
                                do_sample)

    def _will_finish_by_length(self, request: Request) -> bool:
        """The tokens in flight reach max_tokens or max_model_len: the request stops there."""
        params, pending = request.sampling_params, request.num_output_placeholders
        return ((params.max_tokens is not None and len(request.output_token_ids) + pending >= params.max_tokens)
                or len(request.all_token_ids) + pending >= self.config.max_model_len)

    def _preempt(self, request: Request) -> None:
        """Preempt by recompute: drop the cache, go back to the front of the queue."""
        self.kv_cache_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    def _check_stop(self, request: Request) -> RequestStatus | None:
        # (every request, every step: plain attribute reads, no properties)
        params, outputs = request.sampling_params, request.output_token_ids
        num_outputs = len(outputs)
        # EOS and stop ids only count once min_tokens are out; lengths always do.
        if num_outputs >= params.min_tokens:
            token = outputs[-1]
            if token == request.eos_token_id and not params.ignore_eos:
                return RequestStatus.FINISHED_STOPPED
            if params.stop_token_ids and token in params.stop_token_ids:
                request.stop_reason = token
                return RequestStatus.FINISHED_STOPPED
        if request.grammar is not None and request.grammar.is_terminated:
            return RequestStatus.FINISHED_STOPPED  # the constrained value is complete
        if params.max_tokens is not None and num_outputs >= params.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        if len(request.all_token_ids) >= self.config.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def _finish(self, request: Request, status: RequestStatus) -> None:
        request.status = status
        self.kv_cache_manager.free(request)
        del self.requests[request.request_id]
