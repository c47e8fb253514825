"""reshape_and_cache: writes this step's keys/values into the paged KV cache (csrc/cpu/cache_kernels.cpp)."""

import torch
from torch import Tensor


def reshape_and_cache(
    key: Tensor,  # [num_tokens, num_kv_heads, head_size]
    value: Tensor,  # [num_tokens, num_kv_heads, head_size]
    key_cache: Tensor,  # [num_blocks, block_size, num_kv_heads, head_size], written in place
    value_cache: Tensor,  # [num_blocks, block_size, num_kv_heads, head_size], written in place
    slot_mapping: Tensor,  # int64 [num_tokens]; slot s -> block s // block_size, offset s % block_size; -1 skips
) -> None:
    torch.ops.compilelm.reshape_and_cache.default(key, value, key_cache, value_cache, slot_mapping)


@torch.library.register_fake("compilelm::reshape_and_cache")
def _reshape_and_cache_fake(key, value, key_cache, value_cache, slot_mapping) -> None:
    # Only mutates its caches (declared as Tensor(a!) / Tensor(b!) in the schema); no outputs.
    return None


def reshape_and_cache_ref(
    key: Tensor, value: Tensor, key_cache: Tensor, value_cache: Tensor, slot_mapping: Tensor
) -> None:
    """Plain-torch reference: the same in-place scatter through a flat view of each cache."""
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    # view (not reshape) so that a cache that cannot be flattened in place raises instead of copying
    key_cache.view(-1, *key_cache.shape[2:])[slots] = key[keep]
    value_cache.view(-1, *value_cache.shape[2:])[slots] = value[keep]
