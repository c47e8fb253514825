"""`tool_choice` "required" and a named function, enforced with a grammar (as vLLM does):

- named: the output is the function's arguments, a JSON value of its `parameters` schema;
- required: the output is a JSON array of `{"name": ..., "parameters": {...}}` objects, one of
  the tools each (one at most when `parallel_tool_calls` is false).
Their texts are parsed back into calls by `NamedToolOutput` / `RequiredToolOutput`, which answer
like the tool parsers (tool_parsers/abstract.py) so the chat code treats all three alike."""

from __future__ import annotations

from compilelm.entrypoints.openai.tool_parsers.abstract import ParsedCall, ParsedOutput, read_json_calls
from compilelm.sampling_params import StructuredOutputsParams

_NO_ARGUMENTS = {"type": "object", "properties": {}}


def named_tool_constraint(function) -> StructuredOutputsParams:
    return StructuredOutputsParams(json=function.parameters or _NO_ARGUMENTS)


def required_tools_constraint(tools: list, parallel: bool) -> StructuredOutputsParams:
    items = [{"type": "object", "properties": {"name": {"type": "string", "enum": [t.function.name]},
                                               "parameters": t.function.parameters or _NO_ARGUMENTS},
              "required": ["name", "parameters"], "additionalProperties": False} for t in tools]
    schema = {"type": "array", "minItems": 1, "items": items[0] if len(items) == 1 else {"anyOf": items}}
    if not parallel:
        schema["maxItems"] = 1
    return StructuredOutputsParams(json=schema)


class NamedToolOutput:
    """The whole output is the arguments of one call (they grow as they stream)."""

    def __init__(self, name: str):
        self.name = name

    def parse(self, text: str, final: bool) -> ParsedOutput:
        return ParsedOutput("", [ParsedCall(self.name, text)])


class RequiredToolOutput:
    """`[{"name": ..., "parameters": ...}, ...]`: each element once its name is written, its
    parameters as they are written."""

    def parse(self, text: str, final: bool) -> ParsedOutput:
        start = text.find("[")
        calls = [] if start < 0 else read_json_calls(text, start + 1, " \t\r\n,")[0]
        if final and not calls:
            return ParsedOutput(text)  # cut before the first call was begun
        return ParsedOutput("", calls)
