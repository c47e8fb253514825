"""`llama3_json`: Llama 3.1-3.3's JSON tool calls: the whole output is `{"name": ..., "parameters":
{...}}` objects (separated by `;`), optionally after `<|python_tag|>`. Any other output is
content."""

from __future__ import annotations

import json

from compilelm.entrypoints.openai.tool_parsers.abstract import ParsedCall, ParsedOutput, ToolParser, arguments_text

_TAG = "<|python_tag|>"


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"

    def parse(self, text: str, final: bool) -> ParsedOutput:
        body = text.lstrip()
        tagged = body.startswith(_TAG)
        if tagged:
            body = body[len(_TAG):].lstrip()
        elif not final and (not body or _TAG.startswith(body)):
            return ParsedOutput("")  # undecided yet
        if not tagged and not body.startswith("{"):
            return ParsedOutput(text)
        if not body:
            return ParsedOutput(text if final else "")
        calls, pos, decoder = [], 0, json.JSONDecoder()
        while pos < len(body):
            try:
                obj, end = decoder.raw_decode(body, pos)
            except ValueError:
                break  # an object still being written (or not JSON)
            if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
                break
            calls.append(ParsedCall(obj["name"], arguments_text(obj.get("parameters", obj.get("arguments", {})))))
            pos = end
            while pos < len(body) and body[pos] in " \t\r\n;,":
                pos += 1
        if final and (not calls or body[pos:].strip()):
            return ParsedOutput(text)  # not (only) calls: vLLM answers the whole text as content
        return ParsedOutput("", calls)
