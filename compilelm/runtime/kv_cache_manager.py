"""Maps requests to KV-cache blocks: prefix-cache lookup, slot allocation and freeing.

The scheduler asks two questions per request: how much of it is already cached
(`get_computed_blocks`) and whether there is room for the tokens it wants to run this step
(`allocate_slots`, which either succeeds fully or changes nothing). Blocks are registered in the
prefix cache as soon as they are full, whether prompt or generated tokens filled them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from compilelm.runtime.block_pool import BlockPool, KVCacheBlock, hash_block_tokens
from compilelm.runtime.request import Request


@dataclass
class PrefixCacheStats:
    queries: int = 0  # tokens looked up
    hits: int = 0  # tokens found in the cache

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


class BlockIds:
    """One request's block table as int32 ids, appended in place. `view()` is a snapshot: written
    entries never change (growth writes past them, or into a new buffer), so the scheduler hands
    it to a step without a copy, and the step's table is filled from arrays, not lists
    (docs/perf.md, "Host overhead and async scheduling")."""

    __slots__ = ("_ids", "_n")

    def __init__(self) -> None:
        self._ids = np.empty(16, np.int32)
        self._n = 0

    def extend(self, ids: list[int]) -> None:
        need = self._n + len(ids)
        if need > len(self._ids):
            grown = np.empty(max(need, 2 * len(self._ids)), np.int32)
            grown[:self._n] = self._ids[:self._n]
            self._ids = grown
        self._ids[self._n:need] = ids
        self._n = need

    def view(self) -> np.ndarray:
        return self._ids[:self._n]


_NO_BLOCKS = np.empty(0, np.int32)


class KVCacheManager:
    def __init__(self, block_size: int, num_blocks: int, enable_prefix_caching: bool = True):
        self.block_size = block_size
        self.enable_caching = enable_prefix_caching
        self.block_pool = BlockPool(num_blocks, enable_prefix_caching)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        self.req_to_block_ids: dict[str, BlockIds] = {}  # the same tables as ids, grown in step
        # How many of a request's leading blocks are already registered in the prefix cache.
        self.num_cached_blocks: dict[str, int] = {}
        self.prefix_cache_stats = PrefixCacheStats()

    @property
    def usage(self) -> float:
        return self.block_pool.usage

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """Longest cached prefix of the request, in whole blocks: (blocks, num_tokens).
        Has no side effect on the pool; `allocate_slots` takes the references.
        A request that wants prompt logprobs must compute every prompt token: no hit for it."""
        if not self.enable_caching or request.sampling_params.prompt_logprobs is not None:
            return [], 0
        self._update_block_hashes(request)
        # The last token must run through the model to produce logits, so a full hit is cut
        # back to the block boundary at or below num_tokens - 1.
        max_hit_blocks = (request.num_tokens - 1) // self.block_size
        blocks = []
        for block_hash in request.block_hashes[:max_hit_blocks]:
            block = self.block_pool.get_cached_block(block_hash)
            if block is None:
                break
            blocks.append(block)
        num_tokens = len(blocks) * self.block_size
        self.prefix_cache_stats.queries += request.num_tokens
        self.prefix_cache_stats.hits += num_tokens
        return blocks, num_tokens

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: Sequence[KVCacheBlock] = (),
    ) -> list[KVCacheBlock] | None:
        """Make room for `num_new_tokens` after the request's computed tokens (plus the prefix
        hit `new_computed_blocks`, first schedule only). Returns the newly allocated blocks
        (maybe empty), or None without touching anything when the pool is too small."""
        rid = request.request_id
        req_blocks = self.req_to_blocks.get(rid)
        if req_blocks is not None and not new_computed_blocks:  # a running request: most steps fit
            num_total = request.num_computed_tokens + num_new_tokens
            if num_total <= len(req_blocks) * self.block_size:
                num_written = min(num_total, request.num_tokens)
                # (_cache_full_blocks's own test, made here: most steps fill no block)
                if self.enable_caching and num_written // self.block_size > self.num_cached_blocks.get(rid, 0):
                    self._cache_full_blocks(request, req_blocks, num_written)
                return []
        req_blocks = req_blocks if req_blocks is not None else []
        num_total = request.num_computed_tokens + len(new_computed_blocks) * self.block_size + num_new_tokens
        num_new_blocks = max(-(-num_total // self.block_size) - len(req_blocks) - len(new_computed_blocks), 0)
        new_blocks = []
        if new_computed_blocks or num_new_blocks:  # (most decode steps fit in the blocks they have)
            # Hits that sit in the free queue stop being free once touched.
            num_free_hits = sum(1 for b in new_computed_blocks if b.ref_cnt == 0)
            if num_new_blocks > self.block_pool.get_num_free_blocks() - num_free_hits:
                return None
            self.block_pool.touch(new_computed_blocks)  # before taking new blocks from the free queue
            new_blocks = self.block_pool.get_new_blocks(num_new_blocks)
            added = [*new_computed_blocks, *new_blocks]
            if rid not in self.req_to_blocks:
                self.req_to_blocks[rid], self.req_to_block_ids[rid] = req_blocks, BlockIds()
            req_blocks.extend(added)  # in place: a long table is not copied every step
            self.req_to_block_ids[rid].extend([b.block_id for b in added])
        if self.enable_caching:
            self._cache_full_blocks(request, req_blocks, min(num_total, request.num_tokens))
        return new_blocks

    def free(self, request: Request) -> None:
        """Release a finished or preempted request's blocks, tail first so that its head
        blocks, the ones other requests are likeliest to share, stay cached longest."""
        blocks = self.req_to_blocks.pop(request.request_id, [])
        self.req_to_block_ids.pop(request.request_id, None)
        self.num_cached_blocks.pop(request.request_id, None)
        self.block_pool.free_blocks(reversed(blocks))

    def get_block_ids(self, request_id: str) -> np.ndarray:
        """The request's block table (int32 ids [num_blocks]), a snapshot (see BlockIds)."""
        table = self.req_to_block_ids.get(request_id)
        return _NO_BLOCKS if table is None else table.view()

    def reset_prefix_cache(self) -> bool:
        return self.block_pool.reset_prefix_cache()

    def _update_block_hashes(self, request: Request) -> None:
        """Extend request.block_hashes over the full blocks of all_token_ids seen since last time."""
        bs = self.block_size
        hashes = request.block_hashes
        for i in range(len(hashes), request.num_tokens // bs):
            parent = hashes[-1] if hashes else None
            hashes.append(hash_block_tokens(parent, request.all_token_ids[i * bs : (i + 1) * bs]))

    def _cache_full_blocks(self, request: Request, blocks: list[KVCacheBlock], num_tokens: int) -> None:
        """Register the blocks that the first `num_tokens` tokens fill completely."""
        num_full = num_tokens // self.block_size
        start = self.num_cached_blocks.get(request.request_id, 0)
        if num_full <= start:
            return
        self._update_block_hashes(request)
        self.block_pool.cache_full_blocks(blocks[start:num_full], request.block_hashes[start:num_full])
        self.num_cached_blocks[request.request_id] = num_full
