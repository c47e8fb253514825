"""One generation request as the scheduler sees it: tokens so far, progress, and status.

`all_token_ids` (prompt + outputs) is what the KV cache must hold; `num_computed_tokens` is how
many of them already are (or are being computed by a step in flight). A preempted request drops its
cache and recomputes all of them.
"""

from __future__ import annotations

import enum
import time


class RequestStatus(enum.IntEnum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    # Everything from here on is finished (see `is_finished`).
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH = enum.auto()
    FINISHED_ABORTED = enum.auto()

    @staticmethod
    def is_finished(status: RequestStatus) -> bool:
        return status > RequestStatus.PREEMPTED


_PREEMPTED = RequestStatus.PREEMPTED

# OpenAI-style finish reasons.
_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
}


class Request:
    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params,
        eos_token_id: int | None = None,
        arrival_time: float | None = None,
    ):
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.eos_token_id = eos_token_id
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time

        self.output_token_ids: list[int] = []
        self.all_token_ids: list[int] = list(self.prompt_token_ids)
        self.num_computed_tokens = 0  # advanced when scheduled: includes the tokens of steps in flight
        # Sampled tokens still on the device (async scheduling: 0 or 1 between steps). The pending
        # token sits at position num_tokens; it is never in all_token_ids, so never hashed.
        self.num_output_placeholders = 0
        self.num_cached_tokens = 0  # prefix-cache hit when first scheduled
        self.num_preemptions = 0
        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None  # the stop token id or stop string that ended it

        # Chained hashes of the full blocks of all_token_ids, extended by the KV-cache manager.
        self.block_hashes: list[bytes] = []

        # greedy with nothing that reads or edits the logits row but a grammar's mask: the
        # sampler's argmax-only path (a masked row's argmax is taken after its mask)
        self.argmax_only = bool(sampling_params.is_greedy and sampling_params.logprobs is None
                                and not sampling_params.has_penalties and not sampling_params.min_tokens
                                and not sampling_params.logits_processors)
        # ... and no grammar either: every rank can take the argmax of the same logits (TP)
        self.plain_greedy = self.argmax_only and sampling_params.structured_outputs is None
        # the sampler's per-row constants, read every step: 1 / temperature (0: greedy), the filters
        # (top-k: 0 = off, top-p, min-p; none for greedy rows), penalties, min_tokens
        p = sampling_params
        self.inv_temperature = 0.0 if p.is_greedy else 1.0 / p.temperature
        self.filters = (0, 1.0, 0.0) if p.is_greedy else (max(p.top_k, 0), p.top_p, p.min_p)
        self.has_penalties = p.has_penalties
        self.min_tokens = p.min_tokens
        # greedy, or sampled from the temperature alone (no top-k/top-p/min-p), with nothing after
        # the logits processors and a grammar's mask that reads or edits the row: the sampler's
        # one-kernel path (compilelm/ops/sampling.py, sample_rows)
        self.plain_sample = bool(p.logprobs is None and not self.has_penalties and not self.min_tokens
                                 and self.filters == (0, 1.0, 0.0))
        # the RequestGrammar of a structured output (set by the engine), advanced by each sampled token
        self.grammar = None

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status > _PREEMPTED

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASONS.get(self.status)

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, status={self.status.name}, "
            f"tokens={self.num_tokens}, computed={self.num_computed_tokens})"
        )
