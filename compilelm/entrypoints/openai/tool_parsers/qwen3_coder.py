"""`qwen3_coder`: Qwen3-Coder's XML calls, each argument its own tag, typed by the tool's schema:

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    </function>
    </tool_call>
"""

from __future__ import annotations

import json
import re

from compilelm.entrypoints.openai.tool_parsers.abstract import ParsedCall, TaggedToolParser

_FUNCTION = re.compile(r"<function=([^>\n]+)>(.*?)(?:</function>|$)", re.DOTALL)
_PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)(?:</parameter>|(?=<parameter=)|$)", re.DOTALL)


class Qwen3CoderToolParser(TaggedToolParser):
    name = "qwen3_coder"
    start = "<tool_call>"
    end = "</tool_call>"

    def read_block(self, body: str, closed: bool) -> ParsedCall | None:
        m = _FUNCTION.search(body)
        if m is None:
            return None
        name, params = m.group(1).strip(), m.group(2)
        schema = self.tools[name].parameters if name in self.tools else None
        properties = (schema or {}).get("properties", {}) if isinstance(schema, dict) else {}
        args = {}
        for p in _PARAMETER.finditer(params):
            if not closed and p.end() == len(params) and not p.group(0).endswith("</parameter>"):
                break  # its value may still grow
            key, value = p.group(1).strip(), p.group(2)
            value = value[1:] if value.startswith("\n") else value
            value = value[:-1] if value.endswith("\n") else value
            args.setdefault(key, _typed(value, properties.get(key, {})))  # (a repeated key: the first)
        text = json.dumps(args, ensure_ascii=False)
        # while open, the object without its closing brace: each parameter read extends it
        return ParsedCall(name, text if closed else text[:-1])


def _typed(value: str, schema: dict):
    """A parameter's text as the type its schema names (text when it does not convert)."""
    kind = schema.get("type") if isinstance(schema, dict) else None
    kind = kind[0] if isinstance(kind, list) and kind else kind
    try:
        if kind == "string":
            return value
        if kind == "integer":
            return int(value.strip())
        if kind == "number":
            number = float(value.strip())
            return int(number) if number.is_integer() and "." not in value and "e" not in value.lower() else number
        if kind == "boolean":
            return value.strip().lower() == "true"
        if kind == "null" and value.strip().lower() in ("null", "none"):
            return None
        return json.loads(value)  # object, array, or a schema that names no type
    except ValueError:
        return value
