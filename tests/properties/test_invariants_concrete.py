"""The invariants of `make prove`, checked on concrete integers over wider ranges than Z3 enumerates
(random layouts outside the catalogue, prompts up to 3000 tokens, arbitrary cache states)."""

from hypothesis import given, settings
from hypothesis import strategies as st

from kvhit import refimpl
from kvhit.refimpl import Speculation

from .strategies import caches, layouts, speculations

REF = refimpl.ALL_POLICIES["reference"]


def _setup(data, layout, speculation, n):
    sizes = refimpl.derive_sizes(layout, speculation)
    sets = data.draw(caches(len(sizes.groups), n + 64))
    return sizes, sets


def _serves(sizes, sets, n, x):
    cache = refimpl.CacheState.from_sets(sets)
    reach = refimpl.num_hashes(sizes, n) * sizes.hash_block
    extents = refimpl.group_extents(cache, sizes, reach)
    return refimpl.serves_all(cache, sizes, x, extents, reach, REF)


@settings(max_examples=300, deadline=None)
@given(data=st.data(), layout=layouts(), speculation=speculations, n=st.integers(1, 3000))
def test_reference_hit_is_aligned_capped_valid_and_longest(data, layout, speculation, n):
    sizes, sets = _setup(data, layout, speculation, n)
    cache = refimpl.CacheState.from_sets(sets)
    hit, reach, _, _ = refimpl.hit_tokens(cache, sizes, n, REF)
    hash_reach = refimpl.num_hashes(sizes, n) * sizes.hash_block
    assert hit % sizes.alignment == 0 and 0 <= hit <= n - 1 and hit <= hash_reach
    assert hit == 0 or _serves(sizes, sets, n, hit)
    cap = min(n - 1, hash_reach)
    for y in range(hit + sizes.alignment, cap + 1, sizes.alignment):
        assert not _serves(sizes, sets, n, y), f"{y} is longer than the hit {hit} and valid"
    assert cache.max_query <= reach <= hash_reach


@settings(max_examples=300, deadline=None)
@given(data=st.data(), layout=layouts(), speculation=speculations, n=st.integers(1, 3000),
       policy=st.sampled_from(["reference", "vllm_0_33", "historical"]))
def test_reported_reach_covers_every_read(data, layout, speculation, n, policy):
    """The `reach` the spec reports (checked by lookup_stays_within_hashes) is an upper bound of the
    boundaries the lookup really reads."""
    sizes, sets = _setup(data, layout, speculation, n)
    cache = refimpl.CacheState.from_sets(sets)
    _, reach, _, _ = refimpl.hit_tokens(cache, sizes, n, refimpl.ALL_POLICIES[policy])
    assert cache.max_query <= reach


@settings(max_examples=300, deadline=None)
@given(data=st.data(), layout=layouts(), n=st.integers(1, 3000),
       speculation=st.sampled_from([Speculation("drop", 1), Speculation("lookahead", 1),
                                    Speculation("lookahead", 3, True)]))
def test_reference_eagle_loses_at_most_one_block_beyond_alignment(data, layout, speculation, n):
    sizes1, sets = _setup(data, layout, speculation, n)
    sizes0 = refimpl.derive_sizes(layout, Speculation("none"))
    h0 = refimpl.hit_tokens(refimpl.CacheState.from_sets(sets), sizes0, n, REF)[0]
    h1 = refimpl.hit_tokens(refimpl.CacheState.from_sets(sets), sizes1, n, REF)[0]
    r1 = refimpl.num_hashes(sizes1, n) * sizes1.hash_block
    if h0 <= r1 and _serves(sizes1, sets, n, h0):
        assert h1 >= h0
    r0 = refimpl.num_hashes(sizes0, n) * sizes0.hash_block
    dense = [set(range(1, r0 + 1))] * len(sizes1.groups)
    h1_dense = refimpl.hit_tokens(refimpl.CacheState.from_sets(dense), sizes1, n, REF)[0]
    bound = min(n - 1, r1 - sizes1.eagle_unit) // sizes1.alignment * sizes1.alignment
    assert h1_dense >= bound
