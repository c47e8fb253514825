"""`hermes`: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks (Hermes 2/3, and
the format Qwen2.5 and Qwen3 chat templates teach: vLLM serves those with this parser too)."""

from __future__ import annotations

import json

from compilelm.entrypoints.openai.tool_parsers.abstract import (
    ParsedCall,
    TaggedToolParser,
    arguments_text,
    read_json_call,
)


class HermesToolParser(TaggedToolParser):
    name = "hermes"
    start = "<tool_call>"
    end = "</tool_call>"

    def read_block(self, body: str, closed: bool) -> ParsedCall | None:
        read = read_json_call(body)  # name first: the arguments stream as written
        if read is not None:
            return read[0]
        if not closed:
            return None
        try:  # another layout, read once complete
            call = json.loads(body.strip())
        except ValueError:
            return None
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            return None
        return ParsedCall(call["name"], arguments_text(call.get("arguments", call.get("parameters", {}))))
