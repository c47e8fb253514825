"""Tokenizer loading: from a Hugging Face directory, or built from GGUF metadata (vocab, merges,
special tokens and chat template) through transformers' GGUF converter.

Converting a GGUF vocabulary takes seconds, so the converted tokenizer is kept under
`~/.cache/compilelm/tokenizers/` (or `$XDG_CACHE_HOME/compilelm/...`), keyed by the file's name,
size and modification time, and later starts load it directly.

Any directory with tokenizer.json (that cache, most Hugging Face models) loads as a
`FastTokenizer` without importing transformers, which alone costs seconds per start;
transformers is imported only to convert a GGUF vocabulary once and for directories without
tokenizer.json (sentencepiece or tiktoken files need its converters).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile

from compilelm.models.fast_tokenizer import FastTokenizer
from compilelm.models.hub import looks_like_repo_id, snapshot
from compilelm.models.loader import ModelSource, default_model_path


def _cache_root() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "compilelm", "tokenizers")


def _auto_tokenizer():
    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    return AutoTokenizer


def _gguf_tokenizer(path: str):
    st = os.stat(path)
    key = hashlib.sha256(f"{os.path.basename(path)}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:16]
    cached = os.path.join(_cache_root(), key)
    if os.path.isfile(os.path.join(cached, "tokenizer.json")):
        return FastTokenizer(cached)
    tok = _auto_tokenizer().from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
    try:  # write to a temp dir, then rename: concurrent starts never see a half-written cache
        os.makedirs(_cache_root(), exist_ok=True)
        tmp = tempfile.mkdtemp(dir=_cache_root())
        tok.save_pretrained(tmp)
        try:
            os.rename(tmp, cached)
        except OSError:  # another process won the race
            shutil.rmtree(tmp, ignore_errors=True)
    except OSError:
        pass  # a read-only home only costs the conversion next time
    # the same class on the first start as on later ones
    return FastTokenizer(cached) if os.path.isfile(os.path.join(cached, "tokenizer.json")) else tok


_HF_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


class IdTokenizer:
    """Stand-in for a model without a tokenizer (a Hugging Face directory holding only config and
    weights, or a dummy model when the default model is not installed): prompts must be token
    ids; text encodes as UTF-8 bytes and each id decodes to `<id>`."""

    eos_token_id = None
    all_special_ids: list[int] = []
    chat_template = None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, token_ids, **kwargs) -> str:
        return "".join(f"<{int(t)}>" for t in token_ids)

    def batch_decode(self, sequences, **kwargs) -> list[str]:
        return [self.decode(s) for s in sequences]


def load_tokenizer(source: ModelSource, tokenizer: str | None = None, revision: str | None = None,
                   download_dir: str | None = None):
    """The model's tokenizer, or `tokenizer` (--tokenizer: a folder, a .gguf file or a Hugging Face
    repo id, at `revision`) instead."""
    if tokenizer is not None:
        return load_tokenizer(tokenizer_source(tokenizer, revision, download_dir))
    if source.kind == "hf":
        if os.path.isfile(os.path.join(source.path, "tokenizer.json")):
            return FastTokenizer(source.path)
        if not any(os.path.isfile(os.path.join(source.path, f)) for f in _HF_TOKENIZER_FILES):
            return IdTokenizer()
        return _auto_tokenizer().from_pretrained(source.path)
    if source.kind == "gguf":
        return _gguf_tokenizer(source.path)
    # dummy models use the default model's tokenizer: ids beyond its vocab decode to nothing
    try:
        path = default_model_path()
    except FileNotFoundError:
        return IdTokenizer()
    return _gguf_tokenizer(path)


def tokenizer_source(spec: str, revision: str | None = None, download_dir: str | None = None) -> ModelSource:
    """--tokenizer: a folder with tokenizer files, a .gguf file, or a repo id (only its config and
    tokenizer files are fetched)."""
    if os.path.isfile(spec) and spec.endswith(".gguf"):
        return ModelSource("gguf", spec, os.path.basename(spec))
    if os.path.isdir(spec):
        path = spec
    elif looks_like_repo_id(spec):
        path = snapshot(spec, revision, download_dir, weights=False)
    else:
        raise FileNotFoundError(f"tokenizer path does not exist: {spec}")
    if not any(os.path.isfile(os.path.join(path, f)) for f in _HF_TOKENIZER_FILES):
        raise FileNotFoundError(f"no tokenizer files ({', '.join(_HF_TOKENIZER_FILES)}) in {path}")
    return ModelSource("hf", path, spec)


def load_chat_template(spec: str | None) -> str | None:
    """--chat-template: a file's contents, or the template itself (vLLM's rule: a value that names
    no file but holds `{`, `}` or a newline is a template; anything else is a missing file)."""
    if spec is None:
        return None
    if os.path.isfile(spec):
        with open(spec, encoding="utf-8") as f:
            return f.read()
    if any(c in spec for c in "{}\n"):
        return spec.replace("\\n", "\n")  # a shell passes a typed \n as two characters
    raise FileNotFoundError(f"chat template file does not exist: {spec} (an inline template holds "
                            "'{', '}' or a newline)")


def apply_chat_template(tokenizer, messages: list[dict], add_generation_prompt: bool = True,
                        **template_kwargs) -> list[int]:
    """Render a conversation with the model's chat template and tokenize it (the template writes
    the special tokens itself, so none are added again)."""
    if not getattr(tokenizer, "chat_template", None) and not template_kwargs.get("chat_template"):
        raise ValueError("this model has no chat template")
    text = tokenizer.apply_chat_template(messages, tokenize=False,
                                         add_generation_prompt=add_generation_prompt, **template_kwargs)
    return tokenizer.encode(text, add_special_tokens=False)
