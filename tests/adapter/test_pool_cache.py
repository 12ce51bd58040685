"""The enforced lookup reads a full-attention group's leading run from vLLM's own walk of it instead of
asking the pool again (``engine.PoolCache``); it must answer every query as the pool itself would.

Two comparisons: the run arithmetic on a made-up pool, against ``refimpl.CacheState``'s loop over the
same boundaries; and on vLLM's real block pool after request streams with eviction, a cache told the
walks of vLLM's ``FullAttentionManager.find_longest_cache_hit`` against one that asks the pool for
everything, query by query and hit by hit. The cache each lookup restarts (``CoordinatorModel.cache``)
must forget the last lookup: its hits are compared with fresh ones as a made-up pool changes under it.
"""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kvhit.adapters.vllm as kvhit_vllm
import kvhit.refimpl as R
from kvhit.adapters.vllm import engine, v0_33
from tests.adapter.layouts import harness_layout, refimpl_layout, speculation
from tests.conformance.vllm_harness import VllmHarness


class _Pool:
    """A block pool holding the hashes in ``cached`` (every KV-cache group alike)."""

    def __init__(self, cached):
        self.cached = cached

    def get_cached_block(self, block_hash, group_ids):
        return [block_hash] * len(group_ids) if block_hash in self.cached else None


@settings(max_examples=600, deadline=None)
@given(data=st.data(), h=st.integers(1, 4), scale=st.integers(1, 4), n_hashes=st.integers(0, 60))
def test_walked_run_answers_run_from_like_the_loop_over_the_pool(data, h, scale, n_hashes):
    """Any boundaries cached, a walk that saw the first ``walked`` blocks: ``run_from`` (from block 0 at
    the walk's block, or anything else) and ``max_query`` equal ``CacheState``'s loop over ``has``."""
    block = h * scale
    cached = set(data.draw(st.lists(st.integers(0, n_hashes), max_size=n_hashes)))
    if data.draw(st.booleans()):  # a long leading run, as the pool holds after a request
        cached |= set(range(data.draw(st.integers(0, n_hashes))))
    hashes = list(range(n_hashes))  # hash j ends at token (j + 1) * h
    truth = R.CacheState(lambda _, x: 0 < x // h <= n_hashes and x // h - 1 in cached)
    n_blocks = n_hashes * h // block
    walked = data.draw(st.integers(0, n_blocks))
    run = truth.run_from(0, 0, block, walked)  # what the finder finds, looking at `walked` blocks
    walks = [engine._Walk([0], block, ([],), run * block, walked)]
    cache = engine.PoolCache(_Pool(cached), h, [[0]], [(0, (0,))]).start(hashes, walks)
    truth = R.CacheState(truth.has)
    for _ in range(8):
        if data.draw(st.booleans()):
            start, unit = 0, block
        else:
            start, unit = data.draw(st.integers(0, 6)), h * data.draw(st.integers(1, 4))
        limit = data.draw(st.integers(-1, n_blocks + 3))
        got, want = cache.run_from(0, start, unit, limit), truth.run_from(0, start, unit, limit)
        assert got == want, (start, unit, limit, got, want)
        assert cache.max_query == truth.max_query


def _qwen3next_on(full_cached, mamba_cached):
    """A coordinator and model of Qwen3-Next-like full 1600 + Mamba 1600 (MTP 2, drop) whose pool holds
    block hash ``j`` for full attention when ``j in full_cached`` and for Mamba when ``j in mamba_cached``
    (the sets as they are at each query), with the staged reference hit and the cache lookups restart."""
    layout, spec = refimpl_layout("qwen3next"), speculation("drop", 2, True)
    sizes = R.derive_sizes(layout, spec)
    full, mamba = (sizes.groups[k].members for k in range(2))
    pool = SimpleNamespace(get_cached_block=lambda j, ids: (
        [j] * len(ids) if j in (full_cached if tuple(ids) == full else mamba_cached) else None))
    walked = ((0, (0,)),)
    model = SimpleNamespace(sizes=sizes, members=(full, mamba), walked=walked,
                            hit_tokens=engine.reference_hit_tokens(layout, spec),
                            cache=engine.PoolCache(pool, sizes.hash_block, (full, mamba), walked))
    return SimpleNamespace(block_pool=pool), model


@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_restarted_cache_is_the_pool_as_it_is_now(data):
    """Qwen3-Next-like full 1600 + Mamba 1600 (MTP drop): lookups of a few prompt lengths while the pool
    gains and loses full-attention blocks and Mamba states between them; every enforced reference hit
    (the model's one cache restarted, the staged hit) equals ``refimpl.hit_tokens`` on a new cache of the
    pool as it is at that lookup (:func:`test_restarted_cache_forgets_the_last_lookup`)."""
    n_hashes = 12
    full_cached = set(range(data.draw(st.integers(0, n_hashes))))  # a leading run of full-attention blocks
    mamba_cached = set(data.draw(st.lists(st.integers(0, n_hashes - 1), max_size=4)))
    coordinator, model = _qwen3next_on(full_cached, mamba_cached)
    sizes, full = model.sizes, model.members[0]
    b = sizes.hash_block
    hashes = list(range(n_hashes))
    for _ in range(12):
        if data.draw(st.booleans()):
            (mamba_cached.symmetric_difference_update if data.draw(st.booleans()) else
             full_cached.symmetric_difference_update)({data.draw(st.integers(0, n_hashes - 1))})
        n = data.draw(st.sampled_from([5 * b + 1, 7 * b + 10, 9 * b, n_hashes * b]))
        hashes_n = hashes[: R.num_hashes(sizes, n)]
        walked = min(n - 1 + sizes.groups[0].margin, len(hashes_n) * b) // b
        run = next(i for i in range(walked + 1) if i == walked or i not in full_cached)
        walks = [engine._Walk(list(full), b, ([],), run * b, walked), None]
        got = engine._reference(coordinator, model, hashes_n, walks, n - 1)
        fresh = engine.pool_cache(coordinator, hashes_n, model, walks=walks)
        want = R.hit_tokens(fresh, sizes, n, R.REFERENCE)[:3]
        assert got == want, (n, sorted(full_cached), sorted(mamba_cached), got, want)


def test_restarted_cache_forgets_the_last_lookup():
    """The property above can fail: the same lookup again after a Mamba state went is answered from the
    pool as it is now, not from the answers the cache memoised during the last lookup."""
    mamba_cached = {4, 6}
    coordinator, model = _qwen3next_on(set(range(12)), mamba_cached)
    b, full = model.sizes.hash_block, model.members[0]
    n = 9 * b + 5
    walks = [engine._Walk(list(full), b, ([],), 9 * b, 9), None]
    hashes = list(range(9))
    assert engine._reference(coordinator, model, hashes, walks, n - 1)[0] == 7 * b  # state 6 ends at 7b
    assert model.cache.asked[(1, 7 * b)] is not None
    mamba_cached.discard(6)
    assert engine._reference(coordinator, model, hashes, walks, n - 1)[0] == 5 * b  # state 4 ends at 5b


# (catalogue layout, DCP, speculative mode, speculative tokens): full-attention groups walked at block
# granularity (full16: the Unitary coordinator), at hash granularity (pmu160, three_kind), merged in the
# spec (dsv4), EAGLE groups walked with their margin, sharded by DCP.
CASES = [
    ("full16", 1, "drop", 1), ("full16", 1, "none", 1), ("llama_eagle", 2, "drop", 1),
    ("gemma", 1, "lookahead", 1), ("qwen3next", 1, "drop", 2), ("qwen3next", 4, "drop", 1),
    ("qwen3next_pmu160", 1, "drop", 1), ("qwen3next_pmu160", 1, "none", 1), ("three_kind", 1, "drop", 1),
    ("dsv4_cuda", 1, "drop", 1), ("dsv4_report", 1, "lookahead", 1),
]


@pytest.mark.parametrize("name, dcp, mode, k", CASES, ids=[f"{c[0]}-dcp{c[1]}-{c[2]}{c[3]}" for c in CASES])
def test_cache_from_vllms_walk_answers_as_the_pool(name, dcp, mode, k):
    """Serve, evict, serve a sibling: for repeats, prefixes, siblings and extensions, the cache that
    knows vLLM's walks gives every leading run, ``max_query`` and the reference hit (also of each spec
    group alone) that the cache asking the pool gives."""
    assert kvhit_vllm.install("enforce")
    layout = refimpl_layout(name, dcp)
    s = R.derive_sizes(layout, speculation("none")).scheduler_block
    n = {"dsv4_report": 40000, "dsv4_cuda": 3000, "full16": 1000, "llama_eagle": 1000, "gemma": 1000}
    n = n.get(name, 11910)
    harness = VllmHarness(harness_layout(name, dcp), mode, num_speculative_tokens=k, multi_module_mtp=k > 1,
                          retention_interval=0, max_model_len=n + 2 * s + 64)
    coordinator = harness.manager.coordinator
    # The layout as the adapter maps it, also where it is left to vLLM (pmu160, three_kind: the spec does not
    # model their write side): the walks and the cache are the read side it will enforce there.
    model = engine.model_coordinator(coordinator, v0_33.RELEASE)
    rng = random.Random(f"{name}/{dcp}/{mode}")
    base = [rng.randrange(1, 50000) for _ in range(n)]
    sibling = base[: n // 2 + 5] + [rng.randrange(1, 50000) for _ in range(n - n // 2)]
    # A prefix ending on a scheduler block: without lookahead its hashes reach one block past vLLM's cap
    # of N - 1, so the reference reads one block past the walk.
    prompts = (base, sibling, base[: n // 3 + 1], base[: n // 2 // s * s],
               base + [rng.randrange(1, 50000) for _ in range(s + 9)])
    harness.serve(base)
    checked = 0
    for step in range(3):
        if step == 1:
            harness.evict(rng.randrange(1, 30))
        if step == 2:
            harness.serve(sibling)
        for tokens in prompts:
            request = harness._new_request(tokens)
            hashes, cap = request.block_hashes, len(tokens) - 1
            walks = engine._walks(model, hashes, cap)
            walked = engine.pool_cache(coordinator, hashes, model, walks=walks)
            asked = engine.pool_cache(coordinator, hashes, model)
            assert walked.sources, "every catalogue layout but chunked has full attention"
            for kk, indices in walked.sources.items():
                block = walks[indices[0]].block
                for limit in range(len(hashes) * model.sizes.hash_block // block + 2):
                    got = walked.run_from(kk, 0, block, limit)
                    want = asked.run_from(kk, 0, block, limit)
                    assert got == want and walked.max_query == asked.max_query, (kk, block, limit, got, want)
                    checked += 1
            fresh = [engine.pool_cache(coordinator, hashes, model, walks=walks),
                     engine.pool_cache(coordinator, hashes, model)]
            hits = [R.hit_tokens(c, model.sizes, len(tokens), R.REFERENCE) for c in fresh]
            assert hits[0] == hits[1] and fresh[0].max_query == fresh[1].max_query, (len(tokens), hits)
            enforced = engine._reference(coordinator, model, hashes, walks, cap)
            assert enforced == hits[1][:3], (len(tokens), enforced, hits)
            reach = len(hashes) * model.sizes.hash_block
            for kk in range(len(model.sizes.groups)):
                alone = [engine.group_reference_hit(model, c, kk, min(cap, reach), reach) for c in fresh]
                assert alone[0] == alone[1], (len(tokens), kk, alone)
    assert checked
