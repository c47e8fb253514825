"""LLM: the offline Python API. `LLM().generate(prompts, params)` and `LLM().chat(messages)`."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from tqdm.auto import tqdm

from compilelm.config import CacheConfig, EngineConfig, SchedulerConfig, scheduler_defaults
from compilelm.inputs import PromptType, is_single_prompt
from compilelm.models.tokenizer import apply_chat_template
from compilelm.outputs import RequestOutput
from compilelm.runtime.engine import LLMEngine
from compilelm.sampling_params import RequestOutputKind, SamplingParams

_CACHE_FIELDS = {f.name for f in dataclasses.fields(CacheConfig)}
_SCHED_FIELDS = {f.name for f in dataclasses.fields(SchedulerConfig)} - {"max_model_len"}
_ENGINE_FIELDS = {f.name for f in dataclasses.fields(EngineConfig)} - {"cache", "scheduler", "compilation"}


def make_engine_config(model: str | None = None, *, compilation_config=None, enforce_eager: bool = False,
                       optimization_level: int | None = None, **kwargs) -> EngineConfig:
    """Flat keyword arguments (vLLM style) -> EngineConfig; unknown names are a ValueError."""
    unknown = set(kwargs) - _CACHE_FIELDS - _SCHED_FIELDS - _ENGINE_FIELDS
    if unknown:
        raise ValueError(f"unknown engine argument(s): {', '.join(sorted(unknown))}")
    cache = CacheConfig(**{k: v for k, v in kwargs.items() if k in _CACHE_FIELDS})
    sched_kw = {k: v for k, v in kwargs.items() if k in _SCHED_FIELDS}
    engine_kw = {k: v for k, v in kwargs.items() if k in _ENGINE_FIELDS}
    if isinstance(engine_kw.get("model_overrides"), dict):
        engine_kw["model_overrides"] = tuple(engine_kw["model_overrides"].items())
    config = EngineConfig(model=model, cache=cache,
                          compilation=_compile_config(compilation_config, enforce_eager, optimization_level),
                          **engine_kw)
    if not sched_kw:  # the engine picks scheduler_defaults
        return config
    defaults = scheduler_defaults(config.torch_device(), config.usage_context)
    if not sched_kw.get("enable_chunked_prefill", True):  # a whole prompt is one step: the budget holds the longest
        defaults["max_num_batched_tokens"] = max(defaults["max_num_batched_tokens"], kwargs.get("max_model_len") or 0)
    # max_model_len is re-resolved (and re-validated) by the engine once the model is known
    scheduler = SchedulerConfig(max_model_len=kwargs.get("max_model_len") or 1, **{**defaults, **sched_kw})
    return dataclasses.replace(config, scheduler=scheduler)


def _compile_config(compilation_config, enforce_eager: bool, level: int | None):
    try:
        from compilelm.graphs.config import CompileConfig
    except ImportError:  # compiler not available: eager
        return None
    if isinstance(compilation_config, CompileConfig):
        return compilation_config
    if isinstance(compilation_config, dict):
        import json
        compilation_config = json.dumps(compilation_config)
    return CompileConfig.from_cli(level, compilation_config, enforce_eager)


class LLM:
    def __init__(self, model: str | None = None, *, engine_config: EngineConfig | None = None, **kwargs):
        self.engine = LLMEngine(engine_config or make_engine_config(model, **kwargs))
        self.tokenizer = self.engine.tokenizer

    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Outputs in the prompts' order. A prompt: text, token ids, or vLLM's TextPrompt /
        TokensPrompt dict; one prompt or a list of them; one SamplingParams or one per prompt."""
        if is_single_prompt(prompts):
            prompts = [prompts]
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params or self.get_default_sampling_params()] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError(f"sampling_params has {len(sampling_params)} entries for {len(prompts)} prompts")
        # only finished outputs are kept: the engine need not build the others every step
        final_only = [dataclasses.replace(sp or SamplingParams(), output_kind=RequestOutputKind.FINAL_ONLY)
                      for sp in sampling_params]
        ids = [self.engine.add_request(None, p, sp) for p, sp in zip(prompts, final_only)]
        order = {rid: i for i, rid in enumerate(ids)}
        results: list[RequestOutput | None] = [None] * len(ids)
        with tqdm(total=len(ids), desc="Generating", unit="req", disable=not use_tqdm, leave=False) as bar:
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    if out.finished:
                        results[order[out.request_id]] = out
                        bar.update(1)
        return results

    def get_default_sampling_params(self) -> SamplingParams:
        """What `generate` / `chat` use when given no SamplingParams: the model's generation config
        (--generation-config; vLLM's rule), else SamplingParams()."""
        return SamplingParams(**self.engine.default_sampling_params())

    def get_tokenizer(self):
        return self.tokenizer

    def chat(self, messages: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, use_tqdm: bool = True,
             chat_template: str | None = None, add_generation_prompt: bool = True,
             continue_final_message: bool = False, tools: list[dict] | None = None,
             chat_template_kwargs: dict | None = None) -> list[RequestOutput]:
        """One conversation or a list of them, rendered with the model's chat template (or
        `chat_template`, a template string) and generated; vLLM's arguments."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        kwargs = dict(chat_template_kwargs or {})
        if chat_template is not None:
            kwargs["chat_template"] = chat_template
        if tools is not None:
            kwargs["tools"] = tools
        if continue_final_message:
            kwargs["continue_final_message"] = True
        prompts = [self.apply_chat_template(c, add_generation_prompt=add_generation_prompt, **kwargs)
                   for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm)

    def apply_chat_template(self, messages: list[dict], **kwargs) -> list[int]:
        """A conversation's prompt token ids (kwargs: as `chat`'s)."""
        return apply_chat_template(self.tokenizer, messages, **kwargs)
