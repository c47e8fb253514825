"""A request's output constraint, from whichever field carries it: vLLM's `structured_outputs`,
OpenAI's `response_format` (json_object, json_schema, vLLM's structural_tag), or vLLM's older
`guided_json` / `guided_regex` / `guided_choice` / `guided_grammar`. At most one of them; each
problem is a 400 naming the field, and the grammar is compiled here, off the event loop, before
the request is admitted (a grammar that does not compile is a 400, never an engine failure)."""

from __future__ import annotations

import asyncio
import json

from compilelm.entrypoints.openai.errors import bad_request
from compilelm.runtime.structured_output import GrammarError
from compilelm.sampling_params import StructuredOutputsParams

_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}


def requested_constraint(req) -> tuple[StructuredOutputsParams, str] | None:
    """(the constraint, the request field it came from), or None."""
    found = []
    so = req.structured_outputs
    if so is not None:
        found.append(("structured_outputs", lambda: StructuredOutputsParams(
            json=json.dumps(so.json_) if isinstance(so.json_, bool) else so.json_, regex=so.regex,
            choice=so.choice, grammar=so.grammar, json_object=so.json_object,
            structural_tag=json.dumps(so.structural_tag) if isinstance(so.structural_tag, dict) else so.structural_tag,
            disable_any_whitespace=so.disable_any_whitespace,
            disable_additional_properties=so.disable_additional_properties,
            whitespace_pattern=so.whitespace_pattern)))
    rf = req.response_format
    if rf is not None and rf.type != "text":
        found.append(("response_format", lambda: _from_response_format(rf)))
    for name, kind in _GUIDED.items():
        value = getattr(req, name)
        if value is not None:
            found.append((name, lambda kind=kind, value=value: StructuredOutputsParams(
                **{kind: value}, whitespace_pattern=req.guided_whitespace_pattern)))
    if not found:
        return None
    if len(found) > 1:
        raise bad_request(f"only one kind of structured output per request; got {', '.join(f for f, _ in found)}",
                          param=found[1][0])
    field, make = found[0]
    try:
        return make(), field
    except ValueError as e:
        raise bad_request(str(e), param=field) from e


def _from_response_format(rf) -> StructuredOutputsParams:
    if rf.type == "json_object":
        return StructuredOutputsParams(json_object=True)
    if rf.type == "json_schema":
        schema = rf.json_schema.json_schema
        return StructuredOutputsParams(json=json.dumps(schema) if isinstance(schema, bool) else schema)
    return StructuredOutputsParams(structural_tag=json.dumps({"structures": rf.structures, "triggers": rf.triggers}))


async def compile_constraint(engine, params: StructuredOutputsParams, field: str) -> None:
    """Compile on the backend's threads (cached for the engine); GrammarError -> 400 on `field`."""
    try:
        await asyncio.wrap_future(engine.structured_output.compile_async(params))
    except GrammarError as e:
        raise bad_request(f"{field}: {e}", param=field) from e
