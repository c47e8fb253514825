"""`python -m tests.server.faulty_serve serve ARGS`: `compilelm serve` whose engine step raises
once a request whose prompt starts with POISON is in the engine (a fault injected into a real
server process; the step fails as a broken forward would)."""

from __future__ import annotations

import sys

from compilelm.entrypoints.cli import main
from compilelm.runtime.engine import LLMEngine

POISON = [13, 13, 13, 13, 13, 13, 13]
_step = LLMEngine.step


def _poisoned_step(self):
    if any(r.prompt_token_ids[:len(POISON)] == POISON for r in self.scheduler.requests.values()):
        raise RuntimeError("injected step failure")
    return _step(self)


if __name__ == "__main__":
    LLMEngine.step = _poisoned_step
    sys.exit(main())
