"""What a tool-call parser returns, and the shape shared by the parsers whose calls sit between
a start and an end tag (hermes, qwen3_coder).

A parser sees the choice's text so far (`final`: the whole of it). It returns only what is
certain: content that can no longer turn out to be part of a call (a partial start tag at the end
is held back), and the calls that are complete. Each later answer extends the previous one, so a
stream sends the differences, and streaming and non-streaming give the same message.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field


@dataclass
class ParsedCall:
    name: str
    arguments: str  # JSON text (a named tool_choice's may still grow while streaming)


@dataclass
class ParsedOutput:
    content: str
    calls: list[ParsedCall] = field(default_factory=list)


def partial_suffix(text: str, tag: str) -> int:
    """The length of the longest end of `text` that is a proper start of `tag` (held back)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


def arguments_text(arguments) -> str:
    return arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)


class ToolParser:
    """Finds the model's tool calls in its text (`--tool-call-parser`). `tools`: the request's
    (ChatCompletionTool models), for parsers that type arguments by the schema."""

    name = ""

    def __init__(self, tools: list):
        self.tools = {t.function.name: t.function for t in tools}

    def parse(self, text: str, final: bool) -> ParsedOutput:
        raise NotImplementedError


class TaggedToolParser(ToolParser):
    """Calls are `START body END` blocks after some content; `parse_block(body)` reads one (None:
    malformed, kept as content)."""

    start = ""
    end = ""

    def parse_block(self, body: str) -> ParsedCall | None:
        raise NotImplementedError

    def parse(self, text: str, final: bool) -> ParsedOutput:
        first = text.find(self.start)
        if first < 0:
            return ParsedOutput(text if final else text[:len(text) - partial_suffix(text, self.start)])
        out, pos = ParsedOutput(text[:first]), first
        while True:
            s = text.find(self.start, pos)
            if s < 0:
                break
            e = text.find(self.end, s)
            if e < 0:  # unterminated: a call cut short (max_tokens) or one still coming
                if final:
                    self._add(out, text[s + len(self.start):], text[s:])
                return out
            self._add(out, text[s + len(self.start):e], text[s:e + len(self.end)])
            pos = e + len(self.end)
        if final and text[pos:].strip():
            out.content += text[pos:]
        return out

    def _add(self, out: ParsedOutput, body: str, raw: str) -> None:
        call = self.parse_block(body)
        if call is None:
            out.content += raw
        else:
            out.calls.append(call)
