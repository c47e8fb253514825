"""Tokenizer loading: from a Hugging Face directory, or built from GGUF metadata (vocab, merges,
special tokens and chat template) through transformers' GGUF converter."""

from __future__ import annotations

import os

from compilelm.models.loader import ModelSource, default_model_path


def load_tokenizer(source: ModelSource):
    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    if source.kind == "hf":
        return AutoTokenizer.from_pretrained(source.path)
    # dummy models use the default model's tokenizer: ids beyond its vocab decode to nothing
    path = source.path if source.kind == "gguf" else default_model_path()
    return AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
