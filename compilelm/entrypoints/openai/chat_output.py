"""One choice's text -> the assistant message's `reasoning_content`, `content` and `tool_calls`,
whole (non-streaming) or as the OpenAI streaming deltas.

The reasoning parser splits the text first (--reasoning-parser); the content part then goes to
the tool-call reader: the --tool-call-parser for `tool_choice: auto`, or the reader of a named /
required choice's constrained output. Every reader answers with what is certain about the text
so far, each answer extending the previous one, so `ChoiceOutput.delta` sends differences: new
reasoning and content text, a tool call's first delta (index, id, type, name, its arguments so
far), then more of its arguments as the model writes them. A stream's deltas add up to the
non-streamed message.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field

from compilelm.entrypoints.openai.protocol import FunctionCall, ToolCall


def tool_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


@dataclass
class ParsedMessage:
    reasoning: str | None
    content: str | None
    tool_calls: list[ToolCall] = field(default_factory=list)


class ChoiceOutput:
    """`reasoning`: a ReasoningParser or None; `tools`: a tool parser / NamedToolOutput /
    RequiredToolOutput, or None (plain content); `single_call`: keep only the first call
    (`parallel_tool_calls: false` with a parser)."""

    def __init__(self, reasoning=None, tools=None, single_call: bool = False):
        self.reasoning = reasoning
        self.tools = tools
        self.single_call = single_call
        self._ids: list[str] = []
        self._sent_reasoning = 0
        self._sent_content = 0
        self._sent_args: list[int] = []  # per call: arguments characters sent

    def parse(self, text: str, final: bool = True) -> ParsedMessage:
        reasoning, content = (None, text) if self.reasoning is None else self.reasoning.split(text, final)
        calls = []
        if self.tools is not None:
            parsed = self.tools.parse(content, final)
            content, calls = parsed.content, parsed.calls[:1] if self.single_call else parsed.calls
        while len(self._ids) < len(calls):
            self._ids.append(tool_call_id())
        if not content.strip() and (not final or calls or reasoning is not None):
            content = ""  # whitespace alone: held back, and dropped beside reasoning or calls
        return ParsedMessage(reasoning, content, [
            ToolCall(id=i, function=FunctionCall(name=c.name, arguments=c.arguments))
            for i, c in zip(self._ids, calls)])

    def message(self, text: str) -> ParsedMessage:
        """The whole message: empty content is None when there is reasoning or a tool call."""
        m = self.parse(text, final=True)
        if not m.content and (m.tool_calls or m.reasoning is not None):
            m.content = None
        return m

    def delta(self, text: str, final: bool) -> dict:
        """The delta since the last call (`text`: everything so far), {} if nothing is new."""
        m = self.parse(text, final)
        delta = {}
        if m.reasoning and len(m.reasoning) > self._sent_reasoning:
            delta["reasoning_content"] = delta["reasoning"] = m.reasoning[self._sent_reasoning:]
            self._sent_reasoning = len(m.reasoning)
        if m.content and len(m.content) > self._sent_content:
            delta["content"] = m.content[self._sent_content:]
            self._sent_content = len(m.content)
        calls = []
        for i, call in enumerate(m.tool_calls):
            args = call.function.arguments
            if i == len(self._sent_args):
                calls.append({"index": i, "id": call.id, "type": "function",
                              "function": {"name": call.function.name, "arguments": args}})
                self._sent_args.append(len(args))
            elif len(args) > self._sent_args[i]:
                calls.append({"index": i, "function": {"arguments": args[self._sent_args[i]:]}})
                self._sent_args[i] = len(args)
        if calls:
            delta["tool_calls"] = calls
        return delta

    @property
    def called_tools(self) -> bool:
        return bool(self._ids)
