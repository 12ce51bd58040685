"""The eviction order kvhit's adapter sets under enforce (``engine.EvictionTier``), on vLLM 0.33's own
``BlockPool``: a block the reference write side caches beyond what vLLM's would is evicted before any other
cached block, the uncached blocks vLLM takes are the same, a block a lookup hits is no longer extra, and in
shadow and off vLLM's order is untouched. Through the real scheduler: ``test_eviction_under_enforce.py``
and ``test_serving_conditions.py``.
"""

from __future__ import annotations

import pytest
from vllm.v1.core.block_pool import BlockPool
from vllm.v1.core.kv_cache_utils import BlockHash, make_block_hash_with_group_id

import kvhit.adapters.vllm as kvhit_vllm
from kvhit.adapters.vllm import engine, v0_33


@pytest.fixture(autouse=True)
def _off_after():
    yield
    kvhit_vllm.uninstall()


def _cached(pool: BlockPool, block, n: int) -> None:
    pool._insert_block_hash(make_block_hash_with_group_id(BlockHash(bytes([n]) * 32), 0), block, 16 * n)


def _pool(mode: str):
    """A pool of 9 usable blocks, all once allocated: blocks 1-3 freed uncached, then 4-9 freed cached in
    that order (so vLLM's queue is 1, 2, 3, uncached, at the front, then 4, ..., 9), with 7 and 8 marked extra;
    and the tier, registered for the pool."""
    assert kvhit_vllm.install(mode) if mode != "off" else not kvhit_vllm.install(mode)
    pool = BlockPool(num_gpu_blocks=10, enable_caching=True, hash_block_size=16)
    blocks = pool.get_new_blocks(9)
    assert [b.block_id for b in blocks] == list(range(1, 10))
    for b in blocks[3:]:
        _cached(pool, b, b.block_id)
    pool.free_blocks(blocks[:3])
    for b in blocks[3:]:
        pool.free_blocks([b])
    tier = engine.EvictionTier(sparse=(0,), release=v0_33.RELEASE)
    for b in (blocks[6], blocks[7]):
        tier.extra[b.block_id] = b.block_hash
    engine._tiers[pool] = tier
    return pool, tier


def _queue(pool: BlockPool) -> list[int]:
    return [b.block_id for b in pool.free_block_queue.get_all_free_blocks()]


def test_vllm_evicts_cached_blocks_in_the_order_they_were_freed():
    """The setting the tier changes: stock vLLM's queue is the uncached blocks, then the cached ones."""
    pool, _ = _pool("off")
    assert _queue(pool) == [1, 2, 3, 4, 5, 6, 7, 8, 9]
    assert sorted(b.block_id for b in pool.get_new_blocks(5)) == [1, 2, 3, 4, 5]


def test_extra_blocks_are_evicted_before_other_cached_blocks():
    """Five blocks: vLLM takes the three uncached ones and would evict 4 and 5; enforce evicts the extra
    blocks 7 and 8 in their place, and 4, 5 stay cached at the front of the cached blocks."""
    pool, tier = _pool("enforce")
    got = pool.get_new_blocks(5)
    assert sorted(b.block_id for b in got) == [1, 2, 3, 7, 8]
    assert _queue(pool) == [4, 5, 6, 9]
    assert all(pool.blocks[i].block_hash is not None for i in (4, 5, 6, 9))
    assert not tier.extra


def test_when_vllm_evicts_nothing_the_extra_blocks_stay():
    """An allocation vLLM serves from uncached blocks alone is left as vLLM makes it."""
    pool, tier = _pool("enforce")
    assert sorted(b.block_id for b in pool.get_new_blocks(3)) == [1, 2, 3]
    assert _queue(pool) == [4, 5, 6, 7, 8, 9] and set(tier.extra) == {7, 8}


def test_fewer_extra_blocks_than_evictions_spare_the_most_recently_freed():
    """Seven blocks: vLLM would evict 4, 5, 6, 7; 7 is extra, 8 is the only one further back: it replaces
    6, the most recently freed of the others."""
    pool, _ = _pool("enforce")
    assert sorted(b.block_id for b in pool.get_new_blocks(7)) == [1, 2, 3, 4, 5, 7, 8]
    assert _queue(pool) == [6, 9]


def test_a_block_a_lookup_hits_is_no_longer_extra():
    """``touch`` (a hit) unmarks the block: when freed again it takes its place in vLLM's order."""
    pool, tier = _pool("enforce")
    pool.touch([pool.blocks[8]])
    assert set(tier.extra) == {7}
    pool.free_blocks([pool.blocks[8]])
    assert sorted(b.block_id for b in pool.get_new_blocks(5)) == [1, 2, 3, 4, 7]


def test_an_evicted_extra_block_cached_again_is_not_extra():
    """The mark is the block's hash: once evicted and cached under another hash the block is not extra."""
    pool, tier = _pool("off")
    kvhit_vllm.install("enforce")
    pool.blocks[7].reset_hash()  # as _maybe_evict_cached_block does
    _cached(pool, pool.blocks[7], 77)
    assert sorted(b.block_id for b in pool.get_new_blocks(5)) == [1, 2, 3, 4, 8]
    assert 7 not in tier.extra


@pytest.mark.parametrize("mode", ["shadow", "off"])
def test_shadow_and_off_keep_vllm_s_order(mode):
    pool, tier = _pool(mode)
    assert sorted(b.block_id for b in pool.get_new_blocks(5)) == [1, 2, 3, 4, 5]
    assert set(tier.extra) == {7, 8}


def test_a_failing_tier_step_leaves_vllm_s_order_and_never_raises_inside_vllm(monkeypatch, caplog):
    """A bug of kvhit's in the tier (here: its eviction step raises) must not reach vLLM's allocator: the
    pool gets vLLM's own blocks, the tier is dropped for that pool, and the failure is logged."""
    pool, tier = _pool("enforce")

    def broken(*args, **kwargs):
        raise RuntimeError("boom")

    monkeypatch.setattr(tier, "evict_extra_first", broken)
    with caplog.at_level("ERROR"):
        got = pool.get_new_blocks(5)
    assert sorted(b.block_id for b in got) == [1, 2, 3, 4, 5]  # vLLM's order, as stock
    assert pool not in engine._tiers
    assert "eviction order evict_extra_first failed (RuntimeError: boom)" in caplog.text
