"""KVCacheManager: prefix-hit lengths, all-or-nothing allocation, caching of filled blocks, free."""

import numpy as np
import pytest

from compilelm.config import CacheConfig
from compilelm.runtime.kv_cache_manager import KVCacheManager
from compilelm.runtime.request import Request
from compilelm.sampling_params import SamplingParams

BS = 4  # block size used throughout


def make_request(rid, prompt):
    return Request(rid, prompt, SamplingParams(max_tokens=100))


def prefill(manager, request):
    """What the scheduler does for a new request: look up, allocate, account the hit."""
    blocks, num_hit = manager.get_computed_blocks(request)
    assert manager.allocate_slots(request, request.num_tokens - num_hit, blocks) is not None
    request.num_computed_tokens = request.num_tokens
    return num_hit


def decode(manager, request, token):
    request.append_output_token(token)
    assert manager.allocate_slots(request, 1) is not None
    request.num_computed_tokens += 1


def pool_state(manager):
    pool = manager.block_pool
    return (
        pool.free_block_ids(),
        [(b.ref_cnt, b.block_hash) for b in pool.blocks],
        dict(pool.cached_block_hash_to_block),
        {k: list(v) for k, v in manager.req_to_blocks.items()},
        dict(manager.num_cached_blocks),
    )


def test_prefix_hit_lengths():
    m = KVCacheManager(BS, num_blocks=32)
    a = make_request("a", list(range(10)))  # blocks [0:4] [4:8] full, [8:10] partial
    assert prefill(m, a) == 0
    hit = lambda prompt: m.get_computed_blocks(make_request("q", prompt))[1]  # noqa: E731
    assert hit(list(range(9)) + [99]) == 8
    assert hit(list(range(6)) + [99, 99]) == 4  # second block differs
    assert hit([99] + list(range(1, 10))) == 0  # chained: a different first block breaks all
    assert hit(list(range(12))) == 8  # a's partial third block is not cached
    assert hit(list(range(9))) == 8
    assert hit(list(range(8))) == 4  # full hit would leave nothing to compute: one block less
    assert hit(list(range(4))) == 0


def test_hit_shares_blocks_and_counts_stats():
    m = KVCacheManager(BS, num_blocks=32)
    a = make_request("a", list(range(10)))
    prefill(m, a)
    b = make_request("b", list(range(8)) + [50, 51, 52])
    assert prefill(m, b) == 8
    assert m.get_block_ids("b")[:2].tolist() == m.get_block_ids("a")[:2].tolist()
    assert m.get_block_ids("b")[2] not in m.get_block_ids("a")
    assert [m.block_pool.blocks[i].ref_cnt for i in m.get_block_ids("b")] == [2, 2, 1]
    assert (m.prefix_cache_stats.queries, m.prefix_cache_stats.hits) == (21, 8)
    assert m.prefix_cache_stats.hit_rate == pytest.approx(8 / 21)


def test_decode_tokens_fill_and_cache_blocks():
    m = KVCacheManager(BS, num_blocks=32)
    a = make_request("a", list(range(10)))
    prefill(m, a)
    assert len(m.get_block_ids("a")) == 3
    decode(m, a, 10)  # KV for token 10 lands in block 2; token 11 is not computed yet
    assert m.get_computed_blocks(make_request("q", list(range(12)) + [7]))[1] == 8
    decode(m, a, 11)  # block 2 now full -> cached
    assert m.get_computed_blocks(make_request("q", list(range(12)) + [7]))[1] == 12
    assert m.allocate_slots(a, 0) == []  # nothing new needed
    decode(m, a, 12)
    assert len(m.get_block_ids("a")) == 4


def test_allocate_returns_only_new_blocks():
    m = KVCacheManager(BS, num_blocks=8)
    r = make_request("r", list(range(6)))
    new = m.allocate_slots(r, 3)  # a first chunk
    assert [b.block_id for b in new] == [1]
    r.num_computed_tokens = 3
    new = m.allocate_slots(r, 3)
    assert [b.block_id for b in new] == [2]
    assert m.get_block_ids("r").tolist() == [1, 2]


def test_allocate_failure_leaves_state_unchanged():
    m = KVCacheManager(BS, num_blocks=5)  # 4 usable blocks
    a = make_request("a", list(range(8)))
    prefill(m, a)
    m.free(a)  # both blocks stay cached, and free
    b = make_request("b", list(range(8)) + list(range(100, 109)))  # 17 tokens
    blocks, num_hit = m.get_computed_blocks(b)
    assert num_hit == 8
    # 5 blocks needed, 2 of them hits: the 4 free blocks include both hits, so only 2 are
    # really available for the 3 new ones.
    before = pool_state(m)
    assert m.allocate_slots(b, 9, blocks) is None
    assert pool_state(m) == before
    # Without the hit blocks, 5 fresh blocks do not fit either.
    assert m.allocate_slots(b, 17) is None
    assert pool_state(m) == before
    # 13 tokens: 2 hits + 2 new blocks fit exactly.
    c = make_request("c", list(range(8)) + [100] * 5)
    blocks, num_hit = m.get_computed_blocks(c)
    assert m.allocate_slots(c, 5, blocks) is not None
    assert m.usage == 1.0


def test_free_returns_blocks_tail_first():
    m = KVCacheManager(BS, num_blocks=6)  # ids 1..5
    a = make_request("a", list(range(9)))
    prefill(m, a)
    assert m.get_block_ids("a").tolist() == [1, 2, 3]
    m.free(a)
    assert m.get_block_ids("a").tolist() == []
    assert m.usage == 0.0
    assert m.block_pool.free_block_ids() == [4, 5, 3, 2, 1]
    m.free(a)  # freeing twice is harmless
    assert m.usage == 0.0


def test_preempted_request_hits_its_own_blocks():
    m = KVCacheManager(BS, num_blocks=16)
    r = make_request("r", list(range(6)))
    prefill(m, r)
    for t in (6, 7, 8):
        decode(m, r, t)  # 9 tokens, 8 computed: two full blocks cached
    m.free(r)
    r.num_computed_tokens = 0
    blocks, num_hit = m.get_computed_blocks(r)
    assert num_hit == 8
    assert [b.block_id for b in blocks] == [1, 2]


def test_prefix_caching_disabled():
    m = KVCacheManager(BS, num_blocks=16, enable_prefix_caching=False)
    a = make_request("a", list(range(10)))
    prefill(m, a)
    assert m.get_computed_blocks(make_request("b", list(range(10)))) == ([], 0)
    assert m.block_pool.cached_block_hash_to_block == {}
    assert a.block_hashes == []


def test_reset_prefix_cache():
    m = KVCacheManager(BS, num_blocks=16)
    a = make_request("a", list(range(10)))
    prefill(m, a)
    assert not m.reset_prefix_cache()
    m.free(a)
    assert m.reset_prefix_cache()
    assert m.get_computed_blocks(make_request("b", list(range(10))))[1] == 0


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"block_size": 0}, "block_size"),
        ({"num_kv_blocks": 1}, "num_kv_blocks"),
        ({"kv_cache_memory_gb": 0}, "kv_cache_memory_gb"),
        ({"gpu_memory_utilization": 1.5}, "gpu_memory_utilization"),
        ({"gpu_memory_utilization": 0.0}, "gpu_memory_utilization"),
    ],
)
def test_cache_config_validation(kwargs, field):
    with pytest.raises(ValueError, match=field):
        CacheConfig(**kwargs)
    assert CacheConfig().block_size == 16


def test_block_table_views_are_snapshots():
    """A step keeps its view of a table while the request grows past the buffer and is freed."""
    m = KVCacheManager(BS, num_blocks=64)
    a = make_request("a", list(range(BS * 15 + 1)))
    prefill(m, a)
    first = m.get_block_ids("a")
    assert first.dtype == np.int32 and first.tolist() == list(range(1, 17))
    for t in range(a.num_tokens, a.num_tokens + 3 * BS):  # past the 16-entry buffer
        decode(m, a, t)
    assert m.get_block_ids("a").tolist() == list(range(1, 20)) and first.tolist() == list(range(1, 17))
    m.free(a)
    assert first.tolist() == list(range(1, 17))
