"""Small Hugging Face checkpoints built inside a test (no download): a tiny random Llama written by
transformers, a word-level tokenizer, and a Hugging Face cache laid out as huggingface_hub lays it
(`models--org--name/{blobs,refs,snapshots}` with the snapshot's files as links to blobs)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

WORDS = ["hello", "world", "the", "cat", "sat", "on", "mat", "a", "dog", "ran", "user", "assistant", ":"]
SPECIALS = ["<unk>", "<s>", "</s>", "<|eot|>"]


def tiny_llama(path: Path, vocab_size: int = 64, **config) -> Path:
    """A 2-layer Llama (hidden 32) with random weights, saved as safetensors by transformers;
    `config` overrides LlamaConfig fields (torch_dtype, max_shard_size=..., rope_scaling, ...)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    shard = config.pop("max_shard_size", None)
    dtype = config.pop("torch_dtype", "float32")
    cfg = LlamaConfig(**{**dict(vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                initializer_range=0.2, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2),
                         **config})
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).eval()
    kw = {"max_shard_size": shard} if shard else {}
    model.save_pretrained(path, **kw)
    data = json.loads((path / "config.json").read_text())
    data["torch_dtype"] = dtype  # what the checkpoint says it is (vLLM's --dtype auto reads it)
    (path / "config.json").write_text(json.dumps(data))
    return path


def word_tokenizer(path: Path) -> Path:
    """tokenizer.json (word level: SPECIALS then WORDS, split on whitespace) + tokenizer_config."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {w: i for i, w in enumerate([*SPECIALS, *WORDS])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
         "additional_special_tokens": ["<|eot|>"]}))
    return path


def hf_cache_repo(hub: Path, repo_id: str, src: Path, commit: str = "a" * 40, ref: str | None = "main",
                  skip: tuple[str, ...] = ()) -> Path:
    """Puts the files of `src` into the cache `hub` as snapshot `commit` of `repo_id` (files as
    links to content-addressed blobs, `refs/<ref>` naming the commit); returns the snapshot."""
    repo = hub / ("models--" + repo_id.replace("/", "--"))
    snap = repo / "snapshots" / commit
    snap.mkdir(parents=True, exist_ok=True)
    (repo / "blobs").mkdir(exist_ok=True)
    for f in sorted(src.rglob("*")):
        if f.is_dir() or f.name in skip:
            continue
        blob = repo / "blobs" / hashlib.sha256(f.read_bytes()).hexdigest()
        if not blob.exists():
            shutil.copyfile(f, blob)
        link = snap / f.relative_to(src)
        link.parent.mkdir(parents=True, exist_ok=True)
        os.symlink(os.path.relpath(blob, link.parent), link)
    if ref is not None:
        (repo / "refs").mkdir(exist_ok=True)
        (repo / "refs" / ref).write_text(commit)
    return snap


def scripted_llama(path: Path, words: list[str], script: dict[str, str]) -> Path:
    """A Llama whose greedy next token depends only on the current one: `script[word]` follows
    `word` (EOS `</s>` follows any word the script does not name), with a word-level tokenizer
    over SPECIALS + `words`. Built by hand: one-hot embeddings, every layer's projections zero
    (attention and MLP add nothing to the residual stream), an LM head that maps each one-hot
    to its successor, so that text comes out exactly as scripted, on any backend."""
    import torch
    from safetensors.torch import save_file
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = [*SPECIALS, *words]
    index = {w: i for i, w in enumerate(vocab)}
    v = len(vocab)
    hidden = max(32, -(-v // 8) * 8)
    layers, heads, kv_heads, inter = 1, 4, 2, 64
    head_dim = hidden // heads
    lm_head = torch.zeros(v, hidden)
    for i, w in enumerate(vocab):
        lm_head[index[script.get(w, "</s>")], i] = 1.0
    tensors = {"model.embed_tokens.weight": torch.eye(v, hidden), "model.norm.weight": torch.ones(hidden),
               "lm_head.weight": lm_head}
    shapes = {"self_attn.q_proj": (heads * head_dim, hidden), "self_attn.k_proj": (kv_heads * head_dim, hidden),
              "self_attn.v_proj": (kv_heads * head_dim, hidden), "self_attn.o_proj": (hidden, heads * head_dim),
              "mlp.gate_proj": (inter, hidden), "mlp.up_proj": (inter, hidden), "mlp.down_proj": (hidden, inter)}
    for layer in range(layers):
        for name, shape in shapes.items():
            tensors[f"model.layers.{layer}.{name}.weight"] = torch.zeros(shape)
        for norm in ("input_layernorm", "post_attention_layernorm"):
            tensors[f"model.layers.{layer}.{norm}.weight"] = torch.ones(hidden)
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": v, "hidden_size": hidden,
        "intermediate_size": inter, "num_hidden_layers": layers, "num_attention_heads": heads,
        "num_key_value_heads": kv_heads, "max_position_embeddings": 512, "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0, "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2,
        "torch_dtype": "float32"}))
    tok = Tokenizer(models.WordLevel(index, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "additional_special_tokens": ["<|eot|>"]}))
    return path
