"""Engine configuration: small frozen dataclasses, validated on construction.

Each `__post_init__` raises ValueError naming the offending field, so a bad CLI flag or
`LLM(...)` keyword fails at once with a message the user can act on.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16  # tokens per KV-cache block
    num_kv_blocks: int | None = None  # fixed block count; None = size from memory
    kv_cache_memory_gb: float = 2.0  # KV-cache budget on CPU
    gpu_memory_utilization: float = 0.9  # fraction of GPU memory the engine may use in total
    enable_prefix_caching: bool = True

    def __post_init__(self):
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


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 256  # requests running at once
    max_num_batched_tokens: int = 8192  # token budget of one step
    max_model_len: int = 8192  # prompt + output tokens of one request
    enable_chunked_prefill: bool = True

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


# --- model / engine config below ---
