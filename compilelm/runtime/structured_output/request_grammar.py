"""RequestGrammar: one request's matcher, advanced by the tokens it samples.

The mask of step N+1 needs the token of step N accepted first. Synchronous steps accept it in
`Scheduler.update_from_output`, before the next schedule. Under async scheduling the engine
launches step N+1's forward, waits for step N's sampled ids (ready before that forward starts),
accepts the constrained requests' tokens and starts N+1's masks on the mask thread; it processes
step N's output and schedules N+2 while they fill, then masks and samples N+1 before N+2's
inputs are prepared (engine.py). A constrained row waits for its own previous token, never for
anything else, and unconstrained requests keep running ahead. While a mask fills, only the mask
thread touches the matcher: the state the engine reads (`is_terminated`, `failed`) is kept from
the last `accept`.
"""

from __future__ import annotations

import logging

logger = logging.getLogger("compilelm")


class RequestGrammar:
    """`backend`: the GuidanceBackend that compiled `matcher` (its mask threads and width)."""

    def __init__(self, matcher, backend):
        self.matcher = matcher
        self.backend = backend
        self.num_accepted = 0
        self.is_terminated = matcher.is_stopped()  # the value is complete: the request stops here
        self.failed = matcher.is_error()

    def accept(self, token_id: int, index: int, request_id: str) -> bool:
        """Advance by the request's output token number `index` (a token already accepted is
        skipped: async scheduling accepts a step's tokens before the scheduler sees them). A token
        the grammar refuses (only possible if it was not masked) leaves the matcher in error:
        logged, and the request is no longer constrained."""
        if index < self.num_accepted:
            return True
        if self.matcher.consume_token(token_id):
            self.num_accepted += 1
            self.is_terminated = self.matcher.is_stopped()
            return True
        self.failed = True
        logger.error("request %s: the grammar refused token %d: %s", request_id, token_id,
                     self.matcher.get_error().splitlines()[0] if self.matcher.get_error() else "")
        return False
