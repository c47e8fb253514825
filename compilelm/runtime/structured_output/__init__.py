"""Structured outputs: grammars (JSON schema, regex, choice, Lark/GBNF, structural tags) enforced
with a token mask per step, on llguidance (docs/structured_outputs.md says why that library)."""

from compilelm.runtime.structured_output.backend import GrammarError, GuidanceBackend
from compilelm.runtime.structured_output.bitmask import MaskFiller, fill_token_bitmask
from compilelm.runtime.structured_output.request_grammar import RequestGrammar

__all__ = ["GrammarError", "GuidanceBackend", "RequestGrammar", "MaskFiller", "fill_token_bitmask"]
