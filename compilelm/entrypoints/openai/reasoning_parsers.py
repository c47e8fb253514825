"""`--reasoning-parser`: a reasoning model's `<think>...</think>` as `reasoning_content`, the rest
as `content` (vLLM's `qwen3` and `deepseek_r1`).

- qwen3: the output reasons only if it opens with `<think>` (Qwen3 writes the tag itself; with
  `enable_thinking: false` its template pre-fills an empty think block and the output is content).
- deepseek_r1: everything up to `</think>` is reasoning, opening tag or not (DeepSeek-R1's
  template puts `<think>` in the prompt).
Reasoning that never closes (cut by max_tokens) stays reasoning, streamed or not.

The engine gates a constrained output's grammar by the same tags (runtime/structured_output/
reasoning.py). Like the tool parsers, `split` sees the text so far and returns only what is
certain (a partial tag at the end is held back until it completes or the output ends).
"""

from __future__ import annotations

from compilelm.entrypoints.openai.tool_parsers.abstract import partial_suffix
from compilelm.runtime.structured_output.reasoning import REASONING_TAGS


class ReasoningParser:
    name = ""
    start = "<think>"
    end = "</think>"
    needs_start = False  # qwen3: no opening tag, no reasoning

    def split(self, text: str, final: bool) -> tuple[str | None, str]:
        """(reasoning, content) of the text so far; reasoning None: the output does not reason."""
        stripped = text.lstrip()
        if stripped.startswith(self.start):
            body = stripped[len(self.start):]
        elif not final and self.start.startswith(stripped):
            return "", ""  # whitespace, or the opening tag so far: undecided
        elif self.needs_start:
            return None, text
        else:
            body = text
        e = body.find(self.end)
        if e < 0:
            return (body if final else body[:len(body) - partial_suffix(body, self.end)]), ""
        return body[:e], body[e + len(self.end):]


class Qwen3ReasoningParser(ReasoningParser):
    name = "qwen3"
    start, end, needs_start = REASONING_TAGS[name]


class DeepSeekR1ReasoningParser(ReasoningParser):
    name = "deepseek_r1"
    start, end, needs_start = REASONING_TAGS[name]


REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    p.name: p for p in (Qwen3ReasoningParser, DeepSeekR1ReasoningParser)}
