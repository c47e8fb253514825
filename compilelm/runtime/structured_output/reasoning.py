"""The reasoning gate: with a reasoning parser (`--reasoning-parser`), a constrained request's
grammar holds after its reasoning, as in vLLM: the tokens up to `</think>` are free.

A gated request is in one of three states:
- "open" (qwen3, whose output reasons only if it opens with `<think>`): the first token is one
  the grammar allows, or `<think>`;
- "reasoning": no mask, until `</think>` is sampled;
- "grammar": the grammar's mask from then on.
The prompt decides the first: a think block it closes (a template with thinking off) -> "grammar";
one it opens (DeepSeek-R1's template) -> "reasoning"; neither -> "open" for qwen3, "reasoning"
for deepseek_r1. The tags must be single tokens of the tokenizer (both families' are); else the
gate is off and the grammar holds from the first token (logged once).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

logger = logging.getLogger("compilelm")

# parser -> (opening tag, closing tag, whether the output reasons only if it opens with the tag)
REASONING_TAGS: dict[str, tuple[str, str, bool]] = {
    "qwen3": ("<think>", "</think>", True),
    "deepseek_r1": ("<think>", "</think>", False),
}


@dataclass(frozen=True)
class ReasoningGate:
    start_id: int  # the opening tag's token
    end_id: int  # the closing tag's token
    needs_start: bool

    def first_state(self, prompt_ids: Sequence[int]) -> str:
        last_start, last_end = _last_index(prompt_ids, self.start_id), _last_index(prompt_ids, self.end_id)
        if last_end > last_start:
            return "grammar"  # the prompt closed the think block
        if last_start > last_end:
            return "reasoning"  # the prompt opened it
        return "open" if self.needs_start else "reasoning"


def reasoning_gate(parser: str | None, tokenizer) -> ReasoningGate | None:
    """The gate of `parser` for `tokenizer` (None: no parser, or tags that are not single tokens)."""
    if parser is None:
        return None
    start, end, needs_start = REASONING_TAGS[parser]
    ids = [tokenizer.encode(tag, add_special_tokens=False) for tag in (start, end)]
    if any(len(i) != 1 for i in ids):
        logger.warning("reasoning parser %s: %s / %s are not single tokens of this tokenizer; constrained "
                       "outputs follow their grammar from the first token (no reasoning part)", parser, start, end)
        return None
    return ReasoningGate(ids[0][0], ids[1][0], needs_start)


def _last_index(ids: Sequence[int], token: int) -> int:
    for i in range(len(ids) - 1, -1, -1):
        if ids[i] == token:
            return i
    return -1
