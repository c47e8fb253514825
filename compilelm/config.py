"""Engine configuration: small frozen dataclasses, validated on construction.

Each `__post_init__` raises ValueError naming the offending field, so a bad CLI flag or
`LLM(...)` keyword fails at once with a message the user can act on.
"""

from __future__ import annotations

from dataclasses import dataclass

# --kv-cache-dtype as vLLM spells it: auto = the model's dtype; fp8 = fp8_e4m3 (float8_e4m3fn, one
# fp32 scale per layer for keys and one for values: the checkpoint's, else 1.0).
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16  # tokens per KV-cache block
    num_kv_blocks: int | None = None  # fixed block count; None = size from memory
    kv_cache_memory_gb: float = 2.0  # KV-cache budget on CPU
    gpu_memory_utilization: float = 0.9  # fraction of GPU memory the engine may use in total
    enable_prefix_caching: bool = True
    kv_cache_dtype: str = "auto"  # KV_CACHE_DTYPES (--kv-cache-dtype)

    def __post_init__(self):
        if self.kv_cache_dtype == "fp8_e5m2":
            raise ValueError("kv_cache_dtype fp8_e5m2 is not supported (float8_e5m2 KV caches have no kernels here); "
                             "use fp8 / fp8_e4m3 (float8_e4m3fn with per-layer scales) or auto")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}")
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 2:
            raise ValueError(
                f"num_kv_blocks must be >= 2 (block 0 is reserved), got {self.num_kv_blocks}"
            )
        if self.kv_cache_memory_gb <= 0:
            raise ValueError(f"kv_cache_memory_gb must be > 0, got {self.kv_cache_memory_gb}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}"
            )

    @property
    def fp8(self) -> bool:
        """Whether the KV cache is float8_e4m3fn (else the model's dtype)."""
        return self.kv_cache_dtype != "auto"

    def torch_cache_dtype(self, model_dtype):
        """The KV-cache tensors' dtype for a model of `model_dtype`."""
        import torch
        return torch.float8_e4m3fn if self.fp8 else model_dtype


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 256  # requests running at once
    max_num_batched_tokens: int = 8192  # token budget of one step
    max_model_len: int = 8192  # prompt + output tokens of one request
    enable_chunked_prefill: bool = True
    # Schedule and launch step N+1 before step N's sampled tokens reach the host (runtime/async_step.py).
    # None = on where it helps (CUDA, any tensor_parallel_size), off otherwise.
    async_scheduling: bool | None = None

    def __post_init__(self):
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        # Without chunking a prompt runs in one step, so the budget must hold the longest one.
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= max_model_len "
                f"({self.max_model_len}) when enable_chunked_prefill is False"
            )


USAGE_CONTEXTS = ("llm_class", "openai_api_server")  # vLLM's names for the two entry points
REASONING_PARSERS = ("qwen3", "deepseek_r1")  # the reasoning parsers (both of vLLM's <think> ones)


def scheduler_defaults(device, usage_context: str = "llm_class") -> dict[str, int]:
    """max_num_batched_tokens and max_num_seqs for a user who gave neither: vLLM's defaults for
    the same hardware and entry point (its EngineArgs), so a step packs what a vLLM user's step
    packs. A GPU of >= 70 GiB other than an A100 (H100, H200): 16384 tokens a step from `LLM`,
    8192 from the server, 1024 sequences; smaller GPUs: 8192 / 2048 tokens, 256 sequences; the
    CPU: 2048 tokens, 256 sequences. `device`: a torch.device."""
    if usage_context not in USAGE_CONTEXTS:
        raise ValueError(f"usage_context must be one of {', '.join(USAGE_CONTEXTS)}, got {usage_context!r}")
    if device.type != "cuda":
        return {"max_num_batched_tokens": 2048, "max_num_seqs": 256}
    import torch

    props = torch.cuda.get_device_properties(device.index if device.index is not None else torch.cuda.current_device())
    large = props.total_memory >= 70 * 2**30 and "a100" not in props.name.lower()
    server = usage_context == "openai_api_server"
    if large:
        return {"max_num_batched_tokens": 8192 if server else 16384, "max_num_seqs": 1024}
    return {"max_num_batched_tokens": 2048 if server else 8192, "max_num_seqs": 256}


# --- model / engine config below ---

_DTYPES = {"float32": "float32", "fp32": "float32", "float": "float32", "bfloat16": "bfloat16",
           "bf16": "bfloat16", "float16": "float16", "fp16": "float16", "half": "float16"}


@dataclass(frozen=True)
class EngineConfig:
    """Everything an engine is built from. `model=None` is the default model."""

    model: str | None = None  # folder, .gguf file, Hugging Face repo id, dummy:<preset>; None = default
    revision: str | None = None  # a repo id's branch, tag or commit (None: main)
    download_dir: str | None = None  # the Hugging Face cache to read / download into (None: HF_HOME's)
    tokenizer: str | None = None  # None = the model's; else a folder, .gguf file or repo id
    tokenizer_revision: str | None = None  # None = `revision`
    chat_template: str | None = None  # a file or the template itself, replacing the tokenizer's
    # default sampling: "auto" = the model's generation_config.json, "vllm" = none, else a folder
    # holding a generation_config.json
    generation_config: str = "auto"
    override_generation_config: tuple[tuple[str, object], ...] = ()  # on top of generation_config
    # auto = the checkpoint's torch_dtype on GPU (float32 checkpoints in bfloat16); float32 on CPU
    dtype: str = "auto"
    device: str = "auto"
    seed: int = 0
    max_model_len: int | None = None  # None = the model's context length
    cache: CacheConfig = CacheConfig()
    scheduler: SchedulerConfig | None = None  # None = scheduler_defaults, max_model_len resolved
    usage_context: str = "llm_class"  # or "openai_api_server": picks scheduler_defaults' budget
    compilation: object | None = None  # compilelm.graphs.CompileConfig; None = eager
    model_overrides: tuple[tuple[str, object], ...] = ()  # e.g. (("num_hidden_layers", 2),) for dummy
    # "fp8": W8A8 linears of an unquantized checkpoint (compilelm/layers/quantization); FP8
    # checkpoints are detected from their config.json and served as FP8 with or without it
    quantization: str | None = None
    tensor_parallel_size: int = 1  # ranks, one process each (compilelm/runtime/executor.py)
    # TP on CUDA: the smallest all-reduce (bytes) that takes the one-shot peer-memory kernel;
    # None = 1 MiB (below it NCCL is faster: docs/perf.md, "Tensor parallel all-reduce"),
    # 0 = every size it takes, -1 = NCCL only.
    custom_all_reduce_min_bytes: int | None = None
    # qwen3 / deepseek_r1 (vLLM's --reasoning-parser): a constrained output's grammar holds after
    # its <think>...</think> (compilelm/runtime/structured_output/reasoning.py)
    reasoning_parser: str | None = None

    def __post_init__(self):
        if not self.generation_config:
            raise ValueError("generation_config must be auto, vllm or a folder, got ''")
        if self.dtype != "auto" and self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of auto, {', '.join(sorted(set(_DTYPES)))}; got {self.dtype!r}")
        if self.device not in ("auto", "cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ValueError(f"device must be auto, cpu or cuda[:N], got {self.device!r}")
        if self.quantization not in (None, "fp8"):
            raise ValueError(f"quantization must be None or 'fp8', got {self.quantization!r}")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if self.tensor_parallel_size > 1 and self.device.startswith("cuda:"):
            raise ValueError(f"device {self.device!r}: with tensor_parallel_size > 1 rank r uses cuda:r; "
                             "pass device='cuda'")
        if self.custom_all_reduce_min_bytes is not None and self.custom_all_reduce_min_bytes < -1:
            raise ValueError("custom_all_reduce_min_bytes must be None, -1 (off) or >= 0, "
                             f"got {self.custom_all_reduce_min_bytes}")
        if self.reasoning_parser is not None and self.reasoning_parser not in REASONING_PARSERS:
            raise ValueError(f"reasoning_parser must be one of {', '.join(REASONING_PARSERS)}, "
                             f"got {self.reasoning_parser!r}")
        if self.usage_context not in USAGE_CONTEXTS:
            raise ValueError(f"usage_context must be one of {', '.join(USAGE_CONTEXTS)}, got {self.usage_context!r}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")

    def torch_device(self):
        import torch
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    def torch_dtype(self):
        """The model's dtype; "auto" is settled by the engine from the checkpoint
        (compilelm/models/dtype.py) before anything is built, this is its fallback."""
        import torch
        if self.dtype == "auto":
            return torch.bfloat16 if self.torch_device().type == "cuda" else torch.float32
        return getattr(torch, _DTYPES[self.dtype])

    def cache_key_factors(self, model_config) -> dict:
        """What can change the compiled code of this engine's model: the compile cache key's
        engine and model part (`compilelm compile` and the engine must compute it the same way)."""
        factors = {"dtype": str(self.torch_dtype()), "device": self.torch_device().type,
                   "block_size": self.cache.block_size, "model": model_config.to_dict()}
        if self.quantization is not None:  # absent when None: unquantized keys stay as they were
            factors["quantization"] = self.quantization
        if self.tensor_parallel_size > 1:  # each rank's graph has its own shapes and vocab range
            from compilelm.distributed.parallel_state import get_tp_rank
            factors["tensor_parallel"] = {"size": self.tensor_parallel_size, "rank": get_tp_rank()}
        return factors
