"""DenseCache is CacheState.up_to with closed-form queries: same answers, same max_query, same hits."""

from hypothesis import given, settings
from hypothesis import strategies as st

from kvhit import refimpl
from kvhit.dense import DenseCache
from kvhit.refimpl import CacheState, Speculation

from ..properties.strategies import layouts, speculations


@settings(max_examples=500, deadline=None)
@given(extent=st.integers(0, 400), start=st.integers(0, 40), unit=st.integers(1, 64), limit=st.integers(0, 60))
def test_dense_run_from_answers_like_up_to(extent, start, unit, limit):
    dense, slow = DenseCache([extent]), CacheState.up_to([extent])
    assert dense.run_from(0, start, unit, limit) == slow.run_from(0, start, unit, limit)
    assert dense.max_query == slow.max_query


@settings(max_examples=500, deadline=None)
@given(extent=st.integers(0, 400), x=st.integers(0, 500), unit=st.integers(1, 64),
       before=st.integers(0, 10), after=st.integers(0, 2))
def test_dense_window_answers_like_up_to(extent, x, unit, before, after):
    dense, slow = DenseCache([extent]), CacheState.up_to([extent])
    assert dense.window(0, x, unit, before, after) == slow.window(0, x, unit, before, after)
    assert dense.max_query == slow.max_query


@settings(max_examples=200, deadline=None)
@given(data=st.data(), layout=layouts(), speculation=speculations, n=st.integers(1, 3000),
       policy=st.sampled_from(["reference", "vllm_0_33", "historical"]))
def test_dense_cache_gives_the_same_hit_and_reads_as_up_to(data, layout, speculation, n, policy):
    sizes = refimpl.derive_sizes(layout, speculation)
    extents = data.draw(st.lists(st.integers(0, n + 64), min_size=len(sizes.groups), max_size=len(sizes.groups)))
    rules = refimpl.policy_rules(policy)
    dense, slow = DenseCache(extents), CacheState.up_to(extents)
    assert refimpl.hit_tokens(dense, sizes, n, rules) == refimpl.hit_tokens(slow, sizes, n, rules)
    assert dense.max_query == slow.max_query
