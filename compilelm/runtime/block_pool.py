"""The pool of fixed-size KV-cache blocks: allocation, reference counts and the prefix cache.

A block holds the keys/values of `block_size` consecutive tokens of one sequence. A full block
is identified by a chained hash of (parent block's hash, its own token ids), so equal hashes
mean equal prefixes, not just equal blocks. A block whose ref count drops to zero goes to the
tail of the free queue but keeps its hash: until it reaches the head and is handed out again,
a later request with the same prefix can take it back (`touch`) instead of recomputing it.

Blocks are made on first use. The free queue starts as every block but the null block, in id
order, and a freed block joins its tail, behind all the never-used ones: so the never-used blocks
(ids `_fresh` and up) are handed out first, in id order, and only they need no object yet: a
GPU's KV cache has so many blocks that making every object up front lengthens startup
(docs/perf.md, "Compile and warm start").
"""

from __future__ import annotations

import array
import hashlib
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass


def hash_block_tokens(parent_hash: bytes | None, token_ids: Sequence[int]) -> bytes:
    """Chained block hash: sha256 over the parent block's digest and this block's token ids."""
    h = hashlib.sha256(parent_hash or b"")
    h.update(array.array("q", token_ids).tobytes())
    return h.digest()


@dataclass(eq=False)
class KVCacheBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: bytes | None = None  # set while the block is in the prefix cache


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True):
        if num_blocks < 2:
            raise ValueError(f"num_blocks must be >= 2 (block 0 is reserved), got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(0)]  # the blocks made so far: block i is blocks[i]
        # Block 0 pads block tables; it is never handed out and never freed.
        self.null_block = self.blocks[0]
        self._fresh = 1  # ids _fresh.. have never been handed out: the head of the free queue
        # The freed blocks, behind the never-used ones (head = next to hand out, least recently
        # freed). OrderedDict gives O(1) removal from the middle when a cache hit takes a free
        # block back.
        self.free_block_queue: OrderedDict[int, KVCacheBlock] = OrderedDict()
        self.cached_block_hash_to_block: dict[bytes, KVCacheBlock] = {}

    def free_block_ids(self) -> list[int]:
        """The free queue, head first: the never-used blocks, then the freed ones."""
        return [*range(self._fresh, self.num_blocks), *self.free_block_queue]

    def get_num_free_blocks(self) -> int:
        """Blocks that can be handed out now, counting cached blocks that would be evicted."""
        return self.num_blocks - self._fresh + len(self.free_block_queue)

    @property
    def usage(self) -> float:
        """Fraction of the usable (non-null) blocks held by some request."""
        return 1.0 - self.get_num_free_blocks() / (self.num_blocks - 1)

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        if num_blocks > self.get_num_free_blocks():
            raise ValueError(f"cannot get {num_blocks} blocks, {self.get_num_free_blocks()} free")
        fresh = min(num_blocks, self.num_blocks - self._fresh)
        blocks = [KVCacheBlock(i, ref_cnt=1) for i in range(self._fresh, self._fresh + fresh)]
        self.blocks += blocks
        self._fresh += fresh
        for _ in range(num_blocks - fresh):
            _, block = self.free_block_queue.popitem(last=False)
            self._evict(block)
            block.ref_cnt = 1
            blocks.append(block)
        return blocks

    def get_cached_block(self, block_hash: bytes) -> KVCacheBlock | None:
        return self.cached_block_hash_to_block.get(block_hash)

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference on prefix-cache hits; free ones leave the free queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self.free_block_queue[block.block_id]
            block.ref_cnt += 1

    def cache_full_blocks(self, blocks: Sequence[KVCacheBlock], block_hashes: Sequence[bytes]) -> None:
        """Register full blocks under their hashes (zip order). Already cached blocks are kept;
        a hash another block already holds is skipped, that block stays the cached copy."""
        if not self.enable_caching:
            return
        for block, block_hash in zip(blocks, block_hashes):
            if block.block_hash is not None or block_hash in self.cached_block_hash_to_block:
                continue
            block.block_hash = block_hash
            self.cached_block_hash_to_block[block_hash] = block

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference per block; blocks reaching zero join the free queue's tail in the
        given order, so pass a request's blocks tail first to evict its tail before its head."""
        for block in ordered_blocks:
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_block_queue[block.block_id] = block

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash. Only possible while no request holds a block."""
        if self.get_num_free_blocks() != self.num_blocks - 1:
            return False
        for block in self.cached_block_hash_to_block.values():
            block.block_hash = None
        self.cached_block_hash_to_block.clear()
        return True

    def _evict(self, block: KVCacheBlock) -> None:
        if block.block_hash is None:
            return
        del self.cached_block_hash_to_block[block.block_hash]
        block.block_hash = None
