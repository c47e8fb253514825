"""StructuredOutputsParams -> an llguidance grammar (its serialized form, not yet compiled).

Every check of the request's text happens here or in the compile (backend.py): a schema that is
not JSON, an unknown schema keyword's type, a regex or grammar that does not parse -> GrammarError
(a ValueError whose message the server returns as a 400)."""

from __future__ import annotations

import json

from compilelm.sampling_params import StructuredOutputsParams

# JSON whitespace allowed between two tokens of the value: a few spaces, or one line break and an
# indent (pretty-printing up to 5 levels of 4), never an endless run (a small model at temperature
# 0 otherwise loops on "\n" until max_tokens)
JSON_WHITESPACE = r"(?:[\x20\x09]{0,4}|\x0A[\x20\x09]{0,20})"


class GrammarError(ValueError):
    """A constraint the backend cannot compile (the message says why)."""


def grammar_text(params: StructuredOutputsParams) -> str:
    """The llguidance grammar of the constraint (raises GrammarError)."""
    import llguidance

    kind = params.kind
    if kind in ("json", "json_object"):
        schema = {"type": "object"} if kind == "json_object" else _load_json(params.json, "json schema")
        if not isinstance(schema, (dict, bool)):
            raise GrammarError(f"a JSON schema must be an object or a boolean, got {type(schema).__name__}")
        if params.disable_additional_properties and isinstance(schema, dict):
            schema = _closed(schema)
        return _json_grammar(schema, params)
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(params.regex)
    if kind == "choice":
        return llguidance.LLMatcher.grammar_from_lark(
            "start: " + " | ".join(json.dumps(c, ensure_ascii=False) for c in params.choice))
    if kind == "grammar":
        from llguidance.gbnf_to_lark import any_to_lark
        try:
            lark = any_to_lark(params.grammar)  # GBNF (llama.cpp, "root ::= ...") or Lark as is
        except Exception as e:  # noqa: BLE001 - the converter's errors are the grammar's fault
            raise GrammarError(f"cannot read the grammar as Lark or GBNF: {e}") from e
        return llguidance.LLMatcher.grammar_from_lark(lark)
    return structural_tag_grammar(_load_json(params.structural_tag, "structural_tag"), params)


def _json_grammar(schema: dict | bool, params: StructuredOutputsParams) -> str:
    import llguidance

    if params.disable_any_whitespace:
        options = {"whitespace_flexible": False}
    else:
        options = {"whitespace_pattern": params.whitespace_pattern or JSON_WHITESPACE}
    try:
        return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=options)
    except ValueError as e:
        raise GrammarError(f"invalid JSON schema: {e}") from e


def structural_tag_grammar(tag: dict, params: StructuredOutputsParams) -> str:
    """vLLM's structural tag, `{"type": "structural_tag", "structures": [{"begin", "schema",
    "end"}], "triggers": [...]}`: free text, in which each region that starts with a trigger
    must be one of the structures (its begin text, JSON following its schema, its end text)."""
    import llguidance

    if not isinstance(tag, dict) or not isinstance(tag.get("structures"), list) or not tag["structures"]:
        raise GrammarError('a structural tag needs a non-empty "structures" list')
    triggers = tag.get("triggers")
    if not isinstance(triggers, list) or not triggers or not all(isinstance(t, str) and t for t in triggers):
        raise GrammarError('a structural tag needs "triggers": a list of non-empty strings')
    tags = []
    for i, s in enumerate(tag["structures"]):
        if not isinstance(s, dict) or not isinstance(s.get("begin"), str) or not isinstance(s.get("end"), str):
            raise GrammarError(f'structures[{i}] needs "begin" and "end" strings')
        trigger = next((t for t in triggers if s["begin"].startswith(t)), None)
        if trigger is None:
            raise GrammarError(f"structures[{i}]: its begin {s['begin']!r} starts with none of the triggers")
        schema = s.get("schema", s.get("parameters", {"type": "object"}))
        if not isinstance(schema, (dict, bool)):
            raise GrammarError(f"structures[{i}].schema must be a JSON schema object")
        if params.disable_additional_properties and isinstance(schema, dict):
            schema = _closed(schema)
        tags.append(llguidance.StructTag(trigger=trigger, begin=s["begin"], grammar=schema, end=s["end"]))
    return llguidance.StructTag.to_grammar(tags)


def _load_json(value, what: str):
    if not isinstance(value, str):
        return value
    try:
        return json.loads(value)
    except ValueError as e:
        raise GrammarError(f"the {what} is not valid JSON: {e}") from e


def _closed(schema: dict) -> dict:
    """`additionalProperties: false` on every object schema that does not set it."""
    def walk(node):
        if isinstance(node, list):
            return [walk(x) for x in node]
        if not isinstance(node, dict):
            return node
        node = {k: walk(v) for k, v in node.items()}
        if (node.get("type") == "object" or "properties" in node) and "additionalProperties" not in node:
            node["additionalProperties"] = False
        return node
    return walk(schema)
