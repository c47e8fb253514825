"""Tool-call parsers by their `--tool-call-parser` name (vLLM's names)."""

from __future__ import annotations

from compilelm.entrypoints.openai.tool_parsers.abstract import ParsedCall, ParsedOutput, ToolParser
from compilelm.entrypoints.openai.tool_parsers.hermes import HermesToolParser
from compilelm.entrypoints.openai.tool_parsers.llama3_json import Llama3JsonToolParser
from compilelm.entrypoints.openai.tool_parsers.qwen3_coder import Qwen3CoderToolParser

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    p.name: p for p in (HermesToolParser, Llama3JsonToolParser, Qwen3CoderToolParser)}

__all__ = ["TOOL_PARSERS", "ParsedCall", "ParsedOutput", "ToolParser"]
