"""RequestGrammar: one request's matcher, advanced by the tokens it samples.

The mask of step N+1 needs the token of step N accepted first. Synchronous steps accept it in
`Scheduler.update_from_output`, before the next schedule. Under async scheduling the engine
launches step N+1's forward, waits for step N's sampled ids (ready before that forward starts),
accepts the constrained requests' tokens and starts N+1's masks on the mask thread; it processes
step N's output, schedules N+2 and prepares its inputs while they fill, then masks and samples
N+1 before N+2's forward (engine.py). A constrained row waits for its own previous token, never for
anything else, and unconstrained requests keep running ahead. While a mask fills, only the mask
thread touches the matcher: the state the engine reads (`is_terminated`, `failed`) is kept from
the last `accept`.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from compilelm.runtime.structured_output.reasoning import ReasoningGate

logger = logging.getLogger("compilelm")


class RequestGrammar:
    """`backend`: the GuidanceBackend that compiled `matcher` (its mask threads and width); `gate`:
    the engine's ReasoningGate (None: the grammar holds from the first token), with the request's
    `prompt_ids` deciding its first state (reasoning.py)."""

    def __init__(self, matcher, backend, gate: ReasoningGate | None = None, prompt_ids: Sequence[int] = ()):
        self.matcher = matcher
        self.backend = backend
        self.gate = gate
        self.state = "grammar" if gate is None else gate.first_state(prompt_ids)
        self.num_accepted = 0
        # the value is complete: the request stops here
        self.is_terminated = self.state == "grammar" and matcher.is_stopped()
        self.failed = matcher.is_error()

    @property
    def masks(self) -> bool:
        """Whether this step's token is masked (not while the request reasons)."""
        return self.state != "reasoning"

    @property
    def also_allowed(self) -> int:
        """A token the mask allows besides the grammar's: the opening tag while the output may
        still open with it ("open"), else -1."""
        return self.gate.start_id if self.state == "open" else -1

    def accept(self, token_id: int, index: int, request_id: str) -> bool:
        """Advance by the request's output token number `index` (a token already accepted is
        skipped: async scheduling accepts a step's tokens before the scheduler sees them). A token
        the grammar refuses (only possible if it was not masked) leaves the matcher in error:
        logged, and the request is no longer constrained."""
        if index < self.num_accepted:
            return True
        if self.state == "reasoning" or (self.state == "open" and token_id == self.gate.start_id):
            self.num_accepted += 1
            self.state = "grammar" if self.state == "reasoning" and token_id == self.gate.end_id else "reasoning"
            return True
        self.state = "grammar"
        if self.matcher.consume_token(token_id):
            self.num_accepted += 1
            self.is_terminated = self.matcher.is_stopped()
            return True
        self.failed = True
        logger.error("request %s: the grammar refused token %d: %s", request_id, token_id,
                     self.matcher.get_error().splitlines()[0] if self.matcher.get_error() else "")
        return False
