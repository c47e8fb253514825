"""Read a GGUF file: its architecture from the metadata, its tensors dequantized to float32.

llama.cpp stores Llama q/k projections permuted for its interleaved RoPE; we undo that so that the
weights match the Hugging Face (rotate-half) layout that our model uses.

RoPE scaling: llama.cpp's converter stores Llama 3.1 / 3.2's "llama3" scaling as the tensor
`rope_freqs` (one divisor per rotary frequency) and no metadata; it becomes the rope type
`freq_factors` (layers/rotary_embedding.py divides the base frequencies by it, as llama.cpp
does). `<arch>.rope.scaling.type` linear (with `.factor`) is read too; other types (yarn, ...)
are refused rather than run unscaled. transformers' GGUF reader drops both (its Llama config
mapping has no rope-scaling keys).

Quantized tensors are dequantized at load (compilelm has no kernel that reads GGUF quant types):
`dequantization_cost` says what that costs in memory, and the loader logs it.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterator

import numpy as np
import torch

from compilelm.models.config import ModelConfig

# GGUF general.architecture -> Hugging Face architecture class name
GGUF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                      "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}

_LAYER_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


@functools.lru_cache(maxsize=2)
def open_gguf(path: str):
    """Parsing a GGUF header is slow (~seconds for a 49k-token vocab): do it once per file."""
    from gguf import GGUFReader
    return GGUFReader(path)


def _field(reader, key, default=None):
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def _rope_scaling(reader, arch: str, head_dim: int) -> dict | None:
    kind = _field(reader, f"{arch}.rope.scaling.type")
    freqs = next((t for t in reader.tensors if t.name == "rope_freqs.weight"), None)
    if freqs is not None:
        factors = np.asarray(freqs.data, dtype=np.float32).reshape(-1)
        if factors.size != head_dim // 2:
            raise ValueError(f"GGUF rope_freqs has {factors.size} factors, expected head_dim / 2 = {head_dim // 2}")
        return {"rope_type": "freq_factors", "factors": [float(f) for f in factors]}
    if kind in (None, "none"):
        return None
    if kind == "linear":
        return {"rope_type": "linear", "factor": float(_field(reader, f"{arch}.rope.scaling.factor"))}
    raise ValueError(f"GGUF rope scaling type {kind!r} is not supported (supported: linear, llama3 via rope_freqs)")


def gguf_model_config(reader) -> ModelConfig:
    arch = _field(reader, "general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise ValueError(f"unsupported GGUF architecture {arch!r}; supported: {', '.join(GGUF_ARCHITECTURES)}")
    p = lambda k, d=None: _field(reader, f"{arch}.{k}", d)  # noqa: E731
    heads = p("attention.head_count")
    hidden = p("embedding_length")
    names = {t.name for t in reader.tensors}
    vocab = p("vocab_size") or len(reader.fields["tokenizer.ggml.tokens"].data)
    eos = _field(reader, "tokenizer.ggml.eos_token_id")
    head_dim = p("attention.key_length") or p("rope.dimension_count") or hidden // heads
    cfg = {
        "architectures": [GGUF_ARCHITECTURES[arch]],
        "vocab_size": vocab, "hidden_size": hidden,
        "intermediate_size": p("feed_forward_length"),
        "num_hidden_layers": p("block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": p("attention.head_count_kv", heads),
        "head_dim": head_dim,
        "rms_norm_eps": float(p("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(p("rope.freq_base", 10000.0)),
        "max_position_embeddings": p("context_length", 4096),
        "tie_word_embeddings": "output.weight" not in names,
        "attention_bias": "blk.0.attn_q.bias" in names,
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": eos,
        "rope_scaling": _rope_scaling(reader, arch, head_dim),
    }
    return ModelConfig.from_hf_config(cfg)


def dequantization_cost(reader, dtype_bytes: int) -> str | None:
    """What dequantizing the file's quantized tensors costs, in words (None if none are)."""
    from gguf import GGMLQuantizationType

    plain = {GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16}
    quantized = [t for t in reader.tensors if t.tensor_type not in plain]
    if not quantized:
        return None
    kinds = sorted({GGMLQuantizationType(t.tensor_type).name for t in quantized})
    on_disk = sum(int(t.n_bytes) for t in quantized)
    in_memory = sum(int(t.n_elements) for t in quantized) * dtype_bytes
    return (f"{len(quantized)} of {len(reader.tensors)} GGUF tensors are quantized ({', '.join(kinds)}); compilelm "
            f"has no kernel for GGUF quantization and dequantizes them at load: {on_disk / 2**20:.0f} MiB in the "
            f"file -> {in_memory / 2**20:.0f} MiB in memory ({in_memory / max(on_disk, 1):.1f}x)")


def _reverse_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    # inverse of llama.cpp's convert permute(): (n_head, 2, d/2, ...) -> (n_head, d/2, 2, ...)
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_hf_name(name: str) -> str | None:
    m = re.fullmatch(r"blk\.(\d+)\.(\w+)\.(weight|bias)", name)
    if m:
        inner = _LAYER_NAMES.get(m.group(2))
        return None if inner is None else f"model.layers.{m.group(1)}.{inner}.{m.group(3)}"
    base, _, kind = name.rpartition(".")
    return f"{_GLOBAL_NAMES[base]}.{kind}" if base in _GLOBAL_NAMES else None


def iterate_gguf_weights(reader, config: ModelConfig) -> Iterator[tuple[str, torch.Tensor]]:
    """Yields (Hugging Face parameter name, float32 tensor) for every tensor in the file."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    permute = reader.fields.get("general.architecture").contents() in ("llama", "mistral")
    for t in reader.tensors:
        hf_name = gguf_hf_name(t.name)
        if hf_name is None:
            continue  # e.g. rope_freqs: in the config's rope_scaling (gguf_model_config)
        try:
            arr = dequantize(t.data, t.tensor_type)
        except NotImplementedError as e:
            kind = GGMLQuantizationType(t.tensor_type).name
            raise ValueError(f"unsupported GGUF tensor type {kind} for tensor {t.name!r}") from e
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        arr = np.ascontiguousarray(np.asarray(arr, dtype=np.float32).reshape(shape))
        if permute and hf_name.endswith("q_proj.weight"):
            arr = _reverse_permute(arr, config.num_attention_heads)
        elif permute and hf_name.endswith("k_proj.weight"):
            arr = _reverse_permute(arr, config.num_key_value_heads)
        yield hf_name, torch.from_numpy(arr if arr.flags.writeable else arr.copy())
