"""The prompt forms `LLM.generate` and `LLMEngine.add_request` take, as vLLM names them.

A prompt is a string, a list of token ids, a `TextPrompt` (`{"prompt": "..."}`) or a
`TokensPrompt` (`{"prompt_token_ids": [...]}`, optionally with the `prompt` text it came from).
`parse_prompt` turns any of them into (text or None, token ids or None) and refuses the others
(multimodal data, prompt embeddings, encoder-decoder pairs) with an error that names the key.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import TypedDict

from typing_extensions import NotRequired  # (typing has it from 3.11)


class TextPrompt(TypedDict):
    prompt: str


class TokensPrompt(TypedDict):
    prompt_token_ids: list[int]
    prompt: NotRequired[str]  # the text the ids came from, echoed in RequestOutput.prompt


PromptType = str | Sequence[int] | TextPrompt | TokensPrompt

# vLLM keys that only its multimodal, embedding or encoder-decoder paths read
_UNSUPPORTED = {"multi_modal_data": "multimodal inputs", "mm_processor_kwargs": "multimodal inputs",
                "prompt_embeds": "prompt embeddings", "encoder_prompt": "encoder-decoder prompts",
                "decoder_prompt": "encoder-decoder prompts"}
_KNOWN = {"prompt", "prompt_token_ids", "cache_salt", "token_type_ids"}


def is_single_prompt(prompts) -> bool:
    """One prompt (a string, a dict, or a list of token ids), not a batch of them."""
    return isinstance(prompts, (str, dict)) or (
        isinstance(prompts, Sequence) and len(prompts) > 0 and _is_token_id(prompts[0]))


def parse_prompt(prompt: PromptType) -> tuple[str | None, list[int] | None]:
    """(text, token ids): ids None means the text is still to be tokenized; text None means the
    prompt came as ids only. Raises TypeError/ValueError naming what is wrong."""
    if isinstance(prompt, str):
        return prompt, None
    if isinstance(prompt, dict):
        for key, what in _UNSUPPORTED.items():
            if prompt.get(key) is not None:
                raise ValueError(f"prompt key {key!r}: {what} are not supported (text and token-id prompts only)")
        unknown = set(prompt) - _KNOWN - set(_UNSUPPORTED)
        if unknown:
            raise ValueError(f"unknown prompt key(s) {', '.join(sorted(map(repr, unknown)))}; a prompt dict "
                             f"has 'prompt' (text) or 'prompt_token_ids'")
        text = prompt.get("prompt")
        if text is not None and not isinstance(text, str):
            raise TypeError(f"prompt['prompt'] must be a string, got {type(text).__name__}")
        if "prompt_token_ids" in prompt:
            return text, token_id_list(prompt["prompt_token_ids"], "prompt['prompt_token_ids']")
        if text is None:
            raise ValueError("a prompt dict needs 'prompt' (text) or 'prompt_token_ids'")
        return text, None
    return None, token_id_list(prompt, "prompt")


def token_id_list(ids, what: str) -> list[int]:
    """`ids` as a list of Python ints (numpy and torch integers too); anything else is a TypeError."""
    if isinstance(ids, (str, bytes)) or not isinstance(ids, Sequence) and not hasattr(ids, "tolist"):
        raise TypeError(f"{what} must be a string or a list of token ids, got {type(ids).__name__}")
    if hasattr(ids, "tolist"):  # a numpy array or tensor: one conversion, not one per element
        ids = ids.tolist()
    try:
        return [operator.index(t) for t in ids]
    except TypeError:
        bad = next(t for t in ids if not _is_token_id(t))
        raise TypeError(f"{what} must hold integer token ids, got {bad!r} ({type(bad).__name__})") from None


def _is_token_id(x) -> bool:
    try:
        operator.index(x)
    except TypeError:
        return False
    return True
