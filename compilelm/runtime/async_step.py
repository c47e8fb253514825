"""Async scheduling: the host prepares step N+1 while the GPU runs step N.

A synchronous step leaves the GPU idle while the host schedules, prepares inputs, waits for the
sampled tokens and detokenizes. With async scheduling (any tensor_parallel_size) `LLMEngine.step()`
instead
  1. schedules step N+1 before step N's tokens are on the host: a request sampled in step N has a
     placeholder (`Request.num_output_placeholders`) and is scheduled as a decode of it (KV slot
     at position num_tokens); the model runner takes that row's input id from step N's
     sampled-token tensor on the device (a scatter into input_ids before the forward / replay;
     none in steady greedy decode, where step N's full graph left its argmax in input_ids);
  2. launches step N+1 (forward, sampling on the device, a non-blocking copy of the sampled ids
     and logprobs into pinned host memory, then a CUDA event), and only then
  3. waits for step N's event and processes its output: append tokens, stop checks, detokenize,
     stop strings, RequestOutputs. `step()` returns step N's outputs while N+1 is in flight.
A request that finished in step N (EOS, stop id or string, abort) may already be in step N+1:
that token is dropped by `Scheduler.update_from_output`. Requests whose in-flight tokens reach
max_tokens / max_model_len are not scheduled again (no wasted step).

Sampling that reads host state of the latest token (`needs_host_state`) cannot run ahead: when a
request with a token in flight needs it, the engine first processes step N, then schedules N+1
(a synchronous step). On CPU the same code runs with no copies or events.

Under tensor parallelism only rank 0 schedules and samples; the other ranks get each step's
inputs from the executor (runtime/step_broadcast.py) and keep each step's sampled ids on their
device for the next step's pending rows (`ModelRunner.receive_sampled`): the pending rows and
their sources in the previous step's output are part of the step's inputs, computed by rank 0.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from compilelm.runtime.model_runner import StepOutput
    from compilelm.runtime.request import Request
    from compilelm.runtime.sampler import SampledTensors


def needs_host_state(request: Request) -> bool:
    """Whether sampling this request's next token needs its previous token on the host: logits
    processors and penalties read output_token_ids; the min_tokens mask counts the outputs."""
    params = request.sampling_params
    return bool(params.logits_processors or params.has_penalties
                or request.num_output_tokens < params.min_tokens)


class AsyncStepOutput:
    """A launched step: its StepOutput, whose sampler output is filled in by `get()`. `check`
    (tensor parallel): raises when another rank failed or exited; `get()` then polls the step's
    event (`_poll`) and calls it every CHECK_S instead of blocking, so that a collective that
    will never complete (its peer is gone) is an error, not a hang."""

    CHECK_S = 0.01

    def __init__(self, out: StepOutput, sampled: SampledTensors | None = None,
                 check: Callable[[], None] | None = None):
        self.out, self.check = out, check
        self.host, self.ready = None, None
        if sampled is not None:
            self.host = sampled.to_host_async()  # pinned copies queued behind the step (CPU: as is)
            if sampled.token_ids.is_cuda:
                self.ready = torch.cuda.Event()
                self.ready.record()

    def get(self) -> StepOutput:
        """Waits for the step's sampled tokens (only now) and returns the finished StepOutput."""
        if self.host is not None:
            if self.ready is not None:
                if self.check is None:
                    self.ready.synchronize()
                else:
                    _poll(self.ready, self.check, self.CHECK_S)
            self.out.sampler_output = self.host.to_output()
            self.host = None
        return self.out


def _poll(event: torch.cuda.Event, check: Callable[[], None], check_s: float, spin_s: float = 1e-4,
          sleep_s: float = 5e-5) -> None:
    """Waits for `event`, calling `check()` every `check_s` seconds: queries it back to back for
    `spin_s` (an event about to pass is seen at once), then every `sleep_s`, sleeping in between
    with the GIL released (the server's event loop shares this process). Under async scheduling
    the wait is for the step before the one in flight, so a wake-up late by a sleep delays only
    host work that runs ahead of the GPU."""
    start = last = time.perf_counter()
    while not event.query():
        now = time.perf_counter()
        if now - last >= check_s:
            check()
            last = now
        if now - start < spin_s:
            os.sched_yield()
        else:
            time.sleep(sleep_s)
