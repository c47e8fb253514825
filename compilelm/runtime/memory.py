"""How much device memory things take: a KV block, a step's activations, the CUDA graphs.

The worker sizes the KV cache before any graph is captured, so on a GPU it keeps free an
estimate of what comes after (`cuda_memory_reserve`); the model runner logs the estimate beside
the measured graph memory once the graphs are captured.
"""

from __future__ import annotations

import torch

from compilelm.distributed.parallel_state import kv_heads_per_rank
from compilelm.graphs.cudagraph.dispatch import graph_sizes

# Device memory of a captured graph beyond the pool it allocates from (the instantiated graph),
# rounded up from what SmolLM2-135M's graphs took (docs/perf.md, "CUDA graphs"). Piece graphs are
# instantiated on first replay (graphs/cudagraph/piecewise.py), after the KV cache is sized: the
# reserve keeps their memory free all the same.
PIECE_GRAPH_BYTES = 256 * 2**10
FULL_GRAPH_BYTES = 2 * 2**20


def kv_bytes_per_block(model_config, block_size: int, dtype: torch.dtype, tp_size: int = 1) -> int:
    """Bytes of one KV block on one rank; `dtype`: the cache's (1 byte an element for float8_e4m3fn)."""
    kv_heads = kv_heads_per_rank(model_config.num_key_value_heads, tp_size)
    per_token = 2 * model_config.num_hidden_layers * kv_heads * model_config.head_dim
    return per_token * block_size * dtype.itemsize


def activation_bytes_per_token(model_config, dtype: torch.dtype) -> int:
    """About twice the live activations of one token in one layer (with headroom for the
    allocator's rounding)."""
    mc = model_config
    per_token = (4 * mc.hidden_size + 2 * (mc.num_attention_heads + 2 * mc.num_key_value_heads) * mc.head_dim
                 + 3 * mc.intermediate_size) * dtype.itemsize
    return 2 * per_token


def graph_memory_estimate(model_config, dtype: torch.dtype, full: list[int], piecewise: list[int]) -> int:
    """The graphs' memory: their shared pool (the largest size's activations: smaller sizes
    reuse it), the piecewise call sites' static copies of the attention outputs
    ([largest piecewise size, num_heads * head_dim] each), the graphs themselves, and the full
    graphs' logits (the static buffer in the model dtype, which the LM head writes, and under
    tensor parallelism the gathered logits in the pool)."""
    mc = model_config
    pool = activation_bytes_per_token(mc, dtype) * max(full + piecewise, default=0)
    attn_copies = (max(piecewise, default=0) * mc.num_hidden_layers * mc.num_attention_heads * mc.head_dim
                   * dtype.itemsize)
    graphs = FULL_GRAPH_BYTES * len(full) + PIECE_GRAPH_BYTES * len(piecewise) * (mc.num_hidden_layers + 1)
    logits = max(full, default=0) * mc.vocab_size * 2 * dtype.itemsize  # the static buffer (+ gathered, under TP)
    return pool + attn_copies + graphs + logits


def engine_graph_sizes(config) -> tuple[list[int], list[int]]:
    """(full, piecewise) capture sizes of an EngineConfig."""
    sched = config.scheduler
    return graph_sizes(getattr(config, "compilation", None), sched.max_num_seqs, sched.max_num_batched_tokens)


def cuda_memory_reserve(model_config, config, dtype: torch.dtype) -> int:
    """Bytes to keep free when the KV cache is sized on a GPU: an eager step of
    max_num_batched_tokens, the CUDA graphs (`graph_memory_estimate`), and the sampler's
    fp32 logits. An estimate, logged at startup beside the measured graph memory."""
    mc, sched = model_config, config.scheduler
    full, piecewise = engine_graph_sizes(config)
    logits = 3 * sched.max_num_seqs * mc.vocab_size * 4
    return (activation_bytes_per_token(mc, dtype) * sched.max_num_batched_tokens + logits
            + graph_memory_estimate(mc, dtype, full, piecewise))
