"""`llama3_json`: Llama 3.1-3.3's JSON tool calls: the whole output is `{"name": ..., "parameters":
{...}}` objects (separated by `;`), optionally after `<|python_tag|>`. Any other output is
content."""

from __future__ import annotations

from compilelm.entrypoints.openai.tool_parsers.abstract import ParsedOutput, ToolParser, read_json_calls

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
        calls, pos, _ = read_json_calls(body, 0, " \t\r\n;,")
        if final and (not calls or body[pos:].strip()):
            return ParsedOutput(text)  # not (only) calls: vLLM answers the whole text as content
        return ParsedOutput("", calls)
