"""BlockPool: allocation, reference counts, the prefix-cache map and LRU eviction order."""

import hashlib

import pytest

from compilelm.runtime.block_pool import BlockPool, hash_block_tokens


def free_queue_ids(pool):
    return pool.free_block_ids()


def test_allocation_never_hands_out_null_block():
    pool = BlockPool(5, enable_caching=True)
    assert pool.get_num_free_blocks() == 4
    blocks = pool.get_new_blocks(4)
    assert [b.block_id for b in blocks] == [1, 2, 3, 4]
    assert all(b.ref_cnt == 1 for b in blocks)
    assert pool.null_block.block_id == 0 and pool.null_block.ref_cnt == 0
    assert pool.usage == 1.0
    with pytest.raises(ValueError):
        pool.get_new_blocks(1)


def test_ref_counts_and_free():
    pool = BlockPool(4)
    a, b = pool.get_new_blocks(2)
    pool.touch([a])  # a second request shares block a
    assert a.ref_cnt == 2
    pool.free_blocks([a, b])
    assert (a.ref_cnt, b.ref_cnt) == (1, 0)
    assert free_queue_ids(pool) == [3, b.block_id]
    assert pool.usage == pytest.approx(1 / 3)
    pool.free_blocks([a])
    assert free_queue_ids(pool) == [3, b.block_id, a.block_id]
    assert pool.usage == 0.0


def test_hash_is_chained_sha256_over_parent_and_tokens():
    root = hash_block_tokens(None, [1, 2, 3, 4])
    child = hash_block_tokens(root, [5, 6, 7, 8])
    expected_root = hashlib.sha256((1).to_bytes(8, "little") + (2).to_bytes(8, "little")
                                   + (3).to_bytes(8, "little") + (4).to_bytes(8, "little")).digest()
    assert root == expected_root  # token ids as int64 little-endian (x86 / arm64 byte order)
    assert hash_block_tokens(None, [1, 2, 3, 4]) == root
    assert hash_block_tokens(None, [5, 6, 7, 8]) != child  # same tokens, other prefix
    assert hash_block_tokens(root, [5, 6, 8, 7]) != child


def test_cached_free_block_found_until_evicted():
    pool = BlockPool(4)
    blocks = pool.get_new_blocks(2)  # ids 1, 2
    h1 = hash_block_tokens(None, [1, 2])
    h2 = hash_block_tokens(h1, [3, 4])
    pool.cache_full_blocks(blocks, [h1, h2])
    pool.free_blocks(reversed(blocks))
    assert free_queue_ids(pool) == [3, 2, 1]
    # Freed but still cached: a hit takes block 1 back out of the middle of the queue.
    hit = pool.get_cached_block(h1)
    assert hit is blocks[0]
    pool.touch([hit])
    assert hit.ref_cnt == 1 and free_queue_ids(pool) == [3, 2]
    # Fresh allocations take 3 (never cached) and then evict block 2's hash.
    assert [b.block_id for b in pool.get_new_blocks(2)] == [3, 2]
    assert pool.get_cached_block(h2) is None and blocks[1].block_hash is None
    assert pool.get_cached_block(h1) is blocks[0]


def test_lru_eviction_order():
    pool = BlockPool(7)
    a = pool.get_new_blocks(3)  # 1, 2, 3
    b = pool.get_new_blocks(2)  # 4, 5
    pool.free_blocks(reversed(a))  # tail first
    pool.free_blocks(reversed(b))
    assert free_queue_ids(pool) == [6, 3, 2, 1, 5, 4]
    # A hit on block 2 removes it; freeing it again sends it to the back (most recently used).
    pool.touch([pool.blocks[2]])
    pool.free_blocks([pool.blocks[2]])
    assert free_queue_ids(pool) == [6, 3, 1, 5, 4, 2]
    assert [pool.get_new_blocks(1)[0].block_id for _ in range(6)] == [6, 3, 1, 5, 4, 2]


def test_duplicate_hash_keeps_first_block():
    pool = BlockPool(4)
    a, b = pool.get_new_blocks(2)
    h = hash_block_tokens(None, [9, 9])
    pool.cache_full_blocks([a], [h])
    pool.cache_full_blocks([b], [h])  # same content computed twice
    assert pool.get_cached_block(h) is a and b.block_hash is None
    pool.free_blocks([a, b])
    pool.get_new_blocks(2)  # 3 then a: evicting a drops the hash
    assert pool.get_cached_block(h) is None


def test_reset_prefix_cache():
    pool = BlockPool(4)
    blocks = pool.get_new_blocks(2)
    hashes = [hash_block_tokens(None, [1]), hash_block_tokens(None, [2])]
    pool.cache_full_blocks(blocks, hashes)
    assert not pool.reset_prefix_cache()  # blocks still in use
    assert pool.get_cached_block(hashes[0]) is blocks[0]
    pool.free_blocks(blocks)
    assert pool.reset_prefix_cache()
    assert pool.get_cached_block(hashes[0]) is None and pool.get_cached_block(hashes[1]) is None
    assert all(b.block_hash is None for b in pool.blocks)
    assert pool.get_num_free_blocks() == 3


def test_caching_disabled_registers_nothing():
    pool = BlockPool(3, enable_caching=False)
    (block,) = pool.get_new_blocks(1)
    h = hash_block_tokens(None, [1])
    pool.cache_full_blocks([block], [h])
    assert pool.get_cached_block(h) is None and block.block_hash is None


def test_blocks_are_made_on_first_use():
    """A large pool makes no block objects up front; never-used blocks are handed out first, in
    id order, ahead of freed ones, and each block id gets one object for good."""
    pool = BlockPool(131072)
    assert len(pool.blocks) == 1 and pool.get_num_free_blocks() == 131071
    a = pool.get_new_blocks(3)
    assert [b.block_id for b in a] == [1, 2, 3] and pool.blocks[1:] == a
    pool.free_blocks([a[1]])
    assert pool.free_block_ids()[:2] == [4, 5] and pool.free_block_ids()[-1] == 2
    assert pool.get_num_free_blocks() == 131069
    rest = pool.get_new_blocks(131069)  # every never-used block, then block 2 again
    assert rest[0].block_id == 4 and rest[-1] is a[1] and len(pool.blocks) == 131072
    assert pool.usage == 1.0
