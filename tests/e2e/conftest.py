"""Shared fixtures for end-to-end tests on the real default model (SmolLM2-135M-Instruct GGUF)."""

import os

import pytest
import torch

# Prompts of different lengths; the last four share a long prefix (several KV blocks) so that
# prefix caching has something to hit when they run in one batch.
SHARED = ("You are a careful assistant. Answer briefly and precisely, and never invent facts. "
          "The user is curious about science, history and cooking. ")
PROMPTS = [
    "Hello",
    "The capital of France is",
    "Write a haiku about the ocean:",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    SHARED + "The sky looks blue because",
    SHARED + "The pyramids of Giza were built by",
    SHARED + "To make a simple tomato sauce, first",
    SHARED + "Water boils at a lower temperature on a mountain because the air pressure",
]
MAX_NEW_TOKENS = 24


@pytest.fixture(scope="session")
def default_model_path():
    from compilelm.models.loader import default_model_path
    return default_model_path()


@pytest.fixture(scope="session")
def hf_reference(default_model_path):
    """Greedy continuations from Hugging Face transformers on the same GGUF, fp32, one prompt at a time."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    d, f = os.path.dirname(default_model_path), os.path.basename(default_model_path)
    tok = AutoTokenizer.from_pretrained(d, gguf_file=f)
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32).eval()
    prompt_ids, outputs = [], []
    for p in PROMPTS:
        ids = tok(p, return_tensors="pt").input_ids
        with torch.inference_mode():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_NEW_TOKENS,
                                 do_sample=False, pad_token_id=tok.eos_token_id)
        prompt_ids.append(ids[0].tolist())
        outputs.append(out[0, ids.shape[1]:].tolist())
    return {"prompt_ids": prompt_ids, "outputs": outputs, "model": model}
