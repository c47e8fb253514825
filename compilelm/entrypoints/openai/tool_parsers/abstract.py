"""What a tool-call parser returns, the reader of JSON call objects the parsers share, and the
shape of the parsers whose calls sit between a start and an end tag (hermes, qwen3_coder).

A parser sees the choice's text so far (`final`: the whole of it). It returns only what is
certain: content that can no longer turn out to be part of a call (a partial start tag at the end
is held back), and the calls begun so far: a call appears once its name is written, and its
arguments grow as the model writes them (as OpenAI streams them). Each later answer extends the
previous one, so a stream sends the differences, and streaming and non-streaming give the same
message. A call cut short (max_tokens) keeps the arguments written, as OpenAI's do.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field


@dataclass
class ParsedCall:
    name: str
    arguments: str  # JSON text; while the call is being written, a prefix of its final text


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


# `{"name": NAME, "arguments" | "parameters": ` : the head after which a call's arguments stream
_CALL_HEAD = re.compile(r'\s*(\{)\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"(?:arguments|parameters)"\s*:\s*')
_DECODER = json.JSONDecoder()


def _bracketed_end(text: str, start: int) -> int | None:
    """The end (past the closing bracket) of the JSON object or array opening at text[start],
    None while it is unfinished. Brackets inside strings do not count."""
    depth, in_string, escaped = 0, False, False
    for i in range(start, len(text)):
        c = text[i]
        if in_string:
            if escaped:
                escaped = False
            elif c == "\\":
                escaped = True
            elif c == '"':
                in_string = False
        elif c == '"':
            in_string = True
        elif c in "{[":
            depth += 1
        elif c in "}]":
            depth -= 1
            if depth == 0:
                return i + 1
    return None


def read_json_call(text: str, pos: int = 0) -> tuple[ParsedCall, int | None] | None:
    """The call object `{"name": NAME, "arguments" | "parameters": VALUE, ...}` at text[pos:]
    (after whitespace), as far as it is written: (call, the end of the whole object, or None while
    it is unfinished). The arguments are VALUE's text as the model wrote it: while unfinished, what
    is written of an object or array, nothing of a scalar. None: the head (name, then the
    arguments key) is not all written yet, or the object is laid out otherwise."""
    head = _CALL_HEAD.match(text, pos)
    if head is None:
        return None
    name, start = json.loads(head.group(2)), head.end()
    if start < len(text) and text[start] in "{[":
        end = _bracketed_end(text, start)
    else:  # a scalar: certain only once something follows it
        try:
            _, end = _DECODER.raw_decode(text, start)
        except ValueError:
            end = None
        if end is not None and end == len(text):
            end = None
    if end is None:
        written = text[start:] if start < len(text) and text[start] in "{[" else ""
        return ParsedCall(name, written), None
    call = ParsedCall(name, text[start:end])
    try:  # the rest of the object: more keys, then its closing brace
        _, obj_end = _DECODER.raw_decode(text, head.start(1))
    except ValueError:
        return call, None
    return call, obj_end


def read_json_calls(text: str, pos: int, separators: str) -> tuple[list[ParsedCall], int, bool]:
    """Call objects one after another from text[pos], `separators` between them: (the calls
    begun, where reading stopped, whether the last call is still unfinished). An object laid out
    otherwise (name after the arguments) counts once it is complete; reading stops at anything
    that is not a call object."""
    calls = []
    while pos < len(text):
        read = read_json_call(text, pos)
        if read is not None:
            call, end = read
            calls.append(call)
            if end is None:
                return calls, len(text), True
        else:
            try:
                obj, end = _DECODER.raw_decode(text, pos)
            except ValueError:
                break
            if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
                break
            calls.append(ParsedCall(obj["name"], arguments_text(obj.get("parameters", obj.get("arguments", {})))))
        pos = end
        while pos < len(text) and text[pos] in separators:
            pos += 1
    return calls, pos, False


class ToolParser:
    """Finds the model's tool calls in its text (`--tool-call-parser`). `tools`: the request's
    (ChatCompletionTool models), for parsers that type arguments by the schema."""

    name = ""

    def __init__(self, tools: list):
        self.tools = {t.function.name: t.function for t in tools}

    def parse(self, text: str, final: bool) -> ParsedOutput:
        raise NotImplementedError


class TaggedToolParser(ToolParser):
    """Calls are `START body END` blocks after some content; `read_block(body, closed)` reads
    one: `closed` once its end tag (or the end of the output) came, when None means malformed
    (the block stays content); while open, the call as far as it is certain, None if not even its
    name is. A block read as a call while open must read as one when closed."""

    start = ""
    end = ""

    def read_block(self, body: str, closed: bool) -> ParsedCall | None:
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
            if e < 0:  # unterminated: a call still being written, or one cut short (max_tokens)
                body = text[s + len(self.start):]
                if final:
                    self._add(out, body, text[s:])
                else:
                    call = self.read_block(body, closed=False)
                    if call is not None:
                        out.calls.append(call)
                return out
            self._add(out, text[s + len(self.start):e], text[s:e + len(self.end)])
            pos = e + len(self.end)
        if final and text[pos:].strip():
            out.content += text[pos:]
        return out

    def _add(self, out: ParsedOutput, body: str, raw: str) -> None:
        call = self.read_block(body, closed=True)
        if call is None:
            out.content += raw
        else:
            out.calls.append(call)
