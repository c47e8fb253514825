"""GET /tokenizer_info in vLLM's shape: the tokenizer's configuration (tokenizer_config.json as
loaded, with special_tokens_map.json under it), without file paths, special tokens as their
strings, `tokenizer_class` set to the serving tokenizer's class and `chat_template` to the
template the server renders chats with.

lm-evaluation-harness's remote tokenizer (`tokenizer_backend=remote`) needs it: it reads
`eos_token` (and `bos_token`, `pad_token`, `chat_template`) from here and tokenizes through
/tokenize.
"""

from __future__ import annotations

import json
import os

_PATH_FIELDS = ("vocab_file", "merges_file")
_ADDED_TOKEN_FIELDS = {"__type", "content", "lstrip", "rstrip", "normalized", "single_word",
                       "special"}


def tokenizer_info(tokenizer) -> dict:
    config = dict(getattr(tokenizer, "init_kwargs", None) or _config_files(tokenizer))
    for name in _PATH_FIELDS:
        config.pop(name, None)
    config = _jsonable(config)
    for name, token in (getattr(tokenizer, "special_tokens_map", None) or {}).items():
        if config.get(name) is None:
            config[name] = _jsonable(token)
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):  # several named templates: the one chats are rendered with
        template = template.get("default")
    if isinstance(template, str):
        config["chat_template"] = template
    config["tokenizer_class"] = type(tokenizer).__name__
    return config


def _config_files(tokenizer) -> dict:
    """A tokenizer without transformers' `init_kwargs` (FastTokenizer): its directory's files."""
    path = getattr(tokenizer, "name_or_path", None)
    config: dict = {}
    for name in ("special_tokens_map.json", "tokenizer_config.json"):
        file = os.path.join(path, name) if isinstance(path, str) else None
        if file is not None and os.path.isfile(file):
            with open(file, encoding="utf-8") as f:
                config.update(json.load(f))
    return config


def _jsonable(value):
    if hasattr(value, "content"):  # an AddedToken (object or its serialized dict): its text
        return value.content
    if isinstance(value, dict):
        if isinstance(value.get("content"), str) and set(value) <= _ADDED_TOKEN_FIELDS:
            return value["content"]
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    return str(value)
