"""Per-request sampling parameters (vLLM's names and defaults, checked when built).

A plain mutable dataclass so callers can tweak a copy (`clone()`), but every value is checked
in `__post_init__`: a bad value raises ValueError naming the field, never an assert.
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass

_SAMPLING_EPS = 1e-5  # a temperature below this means greedy
_MAX_LOGPROBS = 20


class SamplingType(enum.IntEnum):
    GREEDY = 0
    RANDOM = 1
    RANDOM_SEED = 2  # random, from the request's seed (runtime/sampler.py: keyed noise or its own generator)


@dataclass(frozen=True)
class StructuredOutputsParams:
    """A constraint on the output (vLLM's `structured_outputs`): exactly one of `json` (a JSON
    schema, as a dict or its text), `regex`, `choice` (the output is one of the strings),
    `grammar` (Lark or GBNF), `json_object` (any JSON object) or `structural_tag` (JSON text:
    tagged regions of free text, `{"structures": [{"begin", "schema", "end"}], "triggers": [...]}`).

    Whitespace inside JSON: at most `_JSON_WHITESPACE` between tokens by default (a model cannot
    loop on whitespace), none with `disable_any_whitespace`, or `whitespace_pattern` (a regex).
    `disable_additional_properties` closes every object schema that does not say otherwise.
    Only the shape is checked here; whether a schema or grammar compiles is the structured-output
    backend's check (runtime/structured_output/)."""

    json: str | dict | None = None
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None

    def __post_init__(self) -> None:
        if self.choice is not None:
            if isinstance(self.choice, str) or not all(isinstance(c, str) for c in self.choice):
                raise ValueError(f"structured_outputs.choice must be a list of strings, got {self.choice!r}")
            if not self.choice:
                raise ValueError("structured_outputs.choice must not be empty")
            object.__setattr__(self, "choice", tuple(self.choice))
        if self.json is not None and not isinstance(self.json, (str, dict)):
            raise ValueError(f"structured_outputs.json must be a JSON schema (object or text), got {self.json!r}")
        for name in ("regex", "grammar", "structural_tag", "whitespace_pattern"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                raise ValueError(f"structured_outputs.{name} must be a string, got {value!r}")
        kinds = self.kinds
        if len(kinds) != 1:
            raise ValueError("structured_outputs must set exactly one of json, regex, choice, grammar, "
                             f"json_object, structural_tag; got {', '.join(kinds) or 'none'}")

    @property
    def kinds(self) -> list[str]:
        """The constraint fields that are set (one, once validated)."""
        return [k for k in ("json", "regex", "choice", "grammar", "structural_tag")
                if getattr(self, k) is not None] + (["json_object"] if self.json_object else [])

    @property
    def kind(self) -> str:
        return self.kinds[0]


class RequestOutputKind(enum.IntEnum):
    """Which RequestOutputs `LLMEngine.step()` returns for a request (vLLM's names)."""

    CUMULATIVE = 0  # every step that changed it, with everything so far (streaming reads these)
    FINAL_ONLY = 2  # only the finished one: `LLM.generate` (saves copying growing outputs per step)


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None  # normalized to list[str]
    stop_token_ids: list[int] | None = None  # normalized to list[int]
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    max_tokens: int | None = 16  # None: until max_model_len
    min_tokens: int = 0
    logprobs: int | None = None  # top logprobs returned besides the sampled token's
    prompt_logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0  # 1.0: off
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    # Each is called as fn(output_token_ids, logits_row) -> logits_row before sampling
    # (e.g. the server's logit_bias); they make the request's steps synchronous.
    logits_processors: list | None = None
    # a grammar the output must follow, enforced with a token mask every step
    structured_outputs: StructuredOutputsParams | None = None
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE

    def __post_init__(self) -> None:
        self.stop = _normalize_stop(self.stop)
        self.stop_token_ids = _normalize_stop_token_ids(self.stop_token_ids)

        self.logits_processors = list(self.logits_processors or [])
        if not all(callable(f) for f in self.logits_processors):
            raise ValueError("logits_processors must be a list of callables")
        if self.structured_outputs is not None and not isinstance(self.structured_outputs,
                                                                  StructuredOutputsParams):
            raise ValueError("structured_outputs must be a StructuredOutputsParams, got "
                             f"{type(self.structured_outputs).__name__}")
        if not isinstance(self.output_kind, RequestOutputKind):
            raise ValueError(f"output_kind must be a RequestOutputKind, got {self.output_kind!r}")
        _check_int("n", self.n, lo=1)
        _check_number("temperature", self.temperature, lo=0)
        _check_number("top_p", self.top_p)
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        _check_int("top_k", self.top_k)
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1 or 0 (disabled) or at least 1, got {self.top_k}")
        _check_number("min_p", self.min_p, lo=0, hi=1)
        if self.seed is not None:
            _check_int("seed", self.seed)
        if self.max_tokens is not None:
            _check_int("max_tokens", self.max_tokens, lo=1)
        _check_int("min_tokens", self.min_tokens, lo=0)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}"
            )
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None:
                _check_int(name, value, lo=0, hi=_MAX_LOGPROBS)
        _check_number("presence_penalty", self.presence_penalty, lo=-2, hi=2)
        _check_number("frequency_penalty", self.frequency_penalty, lo=-2, hi=2)
        _check_number("repetition_penalty", self.repetition_penalty)
        if not self.repetition_penalty > 0.0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")

    @property
    def is_greedy(self) -> bool:
        return self.temperature < _SAMPLING_EPS

    @property
    def sampling_type(self) -> SamplingType:
        if self.is_greedy:
            return SamplingType.GREEDY
        return SamplingType.RANDOM if self.seed is None else SamplingType.RANDOM_SEED

    @property
    def has_penalties(self) -> bool:
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )

    def clone(self) -> SamplingParams:
        """A validated copy with its own stop lists."""
        return dataclasses.replace(self)


def _normalize_stop(stop) -> list[str]:
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else list(stop)
    for s in stops:
        if not isinstance(s, str):
            raise ValueError(f"stop must be a string or a list of strings, got {stop!r}")
        if not s:
            raise ValueError("stop must not contain an empty string")
    return stops


def _normalize_stop_token_ids(ids) -> list[int]:
    ids = [] if ids is None else list(ids)
    for t in ids:
        if isinstance(t, bool) or not isinstance(t, int) or t < 0:
            raise ValueError(f"stop_token_ids must be non-negative ints, got {ids!r}")
    return ids


def _check_int(name: str, value, lo: int | None = None, hi: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an int, got {value!r}")
    _check_range(name, value, lo, hi)


def _check_number(name: str, value, lo: float | None = None, hi: float | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
        raise ValueError(f"{name} must be a number, got {value!r}")
    _check_range(name, value, lo, hi)


def _check_range(name: str, value, lo, hi) -> None:
    if lo is not None and hi is not None:
        if not lo <= value <= hi:
            raise ValueError(f"{name} must be in [{lo}, {hi}], got {value}")
    elif lo is not None and value < lo:
        raise ValueError(f"{name} must be >= {lo}, got {value}")
    elif hi is not None and value > hi:
        raise ValueError(f"{name} must be <= {hi}, got {value}")
