"""ModelConfig: the architecture of a decoder-only model, independent of where weights come from.

Built from a Hugging Face `config.json`, from GGUF metadata, or from a named preset of a real model's
shape (for `dummy` random weights in benchmarks).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from typing import Any

# Architectures we implement, by their Hugging Face class name -> our model family.
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
    "Qwen2ForCausalLM": "llama",
    "Qwen3ForCausalLM": "qwen3",
}


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: tuple[tuple[str, Any], ...] | None = None  # hashable copy of HF's dict
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    extra: tuple[tuple[str, Any], ...] = field(default=())
    # the checkpoint's FP8 format (compilelm.layers.quantization.Fp8Scheme), None: unquantized
    quantization: Any = None

    def __post_init__(self):
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture {self.architecture!r}; supported: "
                f"{', '.join(sorted(SUPPORTED_ARCHITECTURES))}")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim"):
            if getattr(self, name) <= 0:
                raise ValueError(f"model config field {name} must be > 0, got {getattr(self, name)}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})")

    def verify_tensor_parallel(self, tp: int) -> None:
        """Raises ValueError unless the heads, the MLP and the KV heads split over `tp` ranks."""
        if tp == 1:
            return
        kv = self.num_key_value_heads
        problems = [f"{n} {what}" for what, n in (("attention heads", self.num_attention_heads),
                                                   ("intermediate size", self.intermediate_size))
                    if n % tp]
        if kv % tp and tp % kv:
            problems.append(f"{kv} KV heads (need a divisor or a multiple of {tp})")
        if problems:
            raise ValueError(f"tensor_parallel_size {tp} (--tensor-parallel-size) does not split the model: "
                             + ", ".join(problems))

    @property
    def family(self) -> str:
        return SUPPORTED_ARCHITECTURES[self.architecture]

    @property
    def rope_scaling_dict(self) -> dict | None:
        return dict(self.rope_scaling) if self.rope_scaling else None

    def to_dict(self) -> dict:
        d = asdict(self)
        if self.quantization is None:  # absent: the compile cache keys of unquantized models stay as they were
            del d["quantization"]
        return d

    @classmethod
    def from_hf_config(cls, cfg: dict) -> ModelConfig:
        archs = cfg.get("architectures") or []
        if not archs:
            raise ValueError("config.json has no 'architectures' entry")
        arch = archs[0]
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(f"unsupported architecture {arch!r} in config.json; supported: "
                             f"{', '.join(sorted(SUPPORTED_ARCHITECTURES))}")
        heads = cfg["num_attention_heads"]
        rope_scaling = cfg.get("rope_scaling") or cfg.get("rope_parameters")
        rope_theta = cfg.get("rope_theta")
        if isinstance(rope_scaling, dict):
            rope_theta = rope_theta or rope_scaling.get("rope_theta")
            kind = rope_scaling.get("rope_type", rope_scaling.get("type"))
            rope_scaling = None if kind in (None, "default") else _freeze(rope_scaling)
        eos = cfg.get("eos_token_id")
        eos = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        return cls(
            architecture=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_hidden_layers=cfg["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta or 10000.0),
            rope_scaling=rope_scaling,
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            attention_bias=cfg.get("attention_bias", arch == "Qwen2ForCausalLM"),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos,
        )

    def with_overrides(self, **kw) -> ModelConfig:
        return replace(self, **kw)


def _freeze(d: dict) -> tuple:
    return tuple(sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in d.items()))


_LLAMA3_ROPE = {"rope_type": "llama3", "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192}

# Shapes of real models, for `dummy:<name>` random weights (benchmarks, compile tests).
_LLAMA31_8B = dict(architectures=["LlamaForCausalLM"], vocab_size=128256, hidden_size=4096,
                   intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                   num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-5, rope_theta=500000.0,
                   rope_scaling=dict(_LLAMA3_ROPE, factor=8.0),
                   max_position_embeddings=131072, tie_word_embeddings=False,
                   bos_token_id=128000, eos_token_id=[128001, 128008, 128009])

DUMMY_PRESETS: dict[str, dict] = {
    "smollm2-135m": dict(architectures=["LlamaForCausalLM"], vocab_size=49152, hidden_size=576,
                         intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                         num_key_value_heads=3, rms_norm_eps=1e-5, rope_theta=100000.0,
                         max_position_embeddings=8192, tie_word_embeddings=True,
                         bos_token_id=1, eos_token_id=2),
    "qwen3-0.6b": dict(architectures=["Qwen3ForCausalLM"], vocab_size=151936, hidden_size=1024,
                       intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                       num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-6, rope_theta=1000000.0,
                       max_position_embeddings=40960, tie_word_embeddings=True,
                       bos_token_id=151643, eos_token_id=151645),
    "llama-3.2-1b": dict(architectures=["LlamaForCausalLM"], vocab_size=128256, hidden_size=2048,
                         intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                         num_key_value_heads=8, head_dim=64, rms_norm_eps=1e-5, rope_theta=500000.0,
                         rope_scaling=dict(_LLAMA3_ROPE, factor=32.0),
                         max_position_embeddings=131072, tie_word_embeddings=True,
                         bos_token_id=128000, eos_token_id=[128001, 128008, 128009]),
    "llama-3.1-8b": _LLAMA31_8B,
    # the 8B's config at 70B sizes; 140 GB of bf16 weights: tensor parallel (issue 35's TP=4 rows)
    "llama-3.1-70b": dict(_LLAMA31_8B, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                          num_attention_heads=64),
}


def dummy_config(name: str, **overrides) -> ModelConfig:
    """A preset's ModelConfig; `overrides` (e.g. num_hidden_layers=2) shrink it for tests."""
    if name not in DUMMY_PRESETS:
        raise ValueError(f"unknown dummy model {name!r}; known: {', '.join(DUMMY_PRESETS)}")
    return ModelConfig.from_hf_config({**DUMMY_PRESETS[name], **overrides})
