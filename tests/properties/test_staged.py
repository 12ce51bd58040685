"""The staged lowering computes what the refimpl computes: the same hit, reach, longest and convergence,
asking the cache no boundary the refimpl does not ask, for every policy it stages, on random layouts,
catalogue layouts, prompts and cache states; and it refuses what it cannot stage.

The hits are staged by ``kvhit.refimpl.staging`` (what the adapter stages with: ``kvhit.spec.stage`` as codegen
copies it, on the refimpl's domain types; ``tests/unit/test_codegen.py`` checks that both stage the same
source); the operators' own tests run ``kvhit.spec.stage`` on the spec's operators."""

from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvhit import refimpl
from kvhit.convert import to_refimpl
from kvhit.refimpl import staging
from kvhit.spec import stage
from kvhit.spec.catalogue import CATALOGUE
from kvhit.spec.terms import SpecError, SymbolicBranchError, and_, ite, max_aligned, min_

from .strategies import caches, layouts, speculations

POLICIES = sorted(refimpl.ALL_POLICIES)


class _Recording(refimpl.CacheState):
    """A cache from boundary sets that records every boundary it is asked about."""

    def __init__(self, sets):
        self.asked = set()

        def has(k, x):
            self.asked.add((k, x))
            return x in sets[k]

        super().__init__(has)


def _check(layout, speculation, n, sets, policy):
    rules = refimpl.ALL_POLICIES[policy]
    sizes = refimpl.derive_sizes(layout, speculation, rules.scale_replicated)
    if sizes.hash_lookahead and not rules.lookahead_hashes:  # vllm_0_32 has no lookahead mode: both refuse
        with pytest.raises(ValueError, match="no lookahead block hashes"):
            staging.stage_hit_tokens(layout, speculation, policy)
        with pytest.raises(ValueError, match="no lookahead block hashes"):
            refimpl.hit_tokens(_Recording(sets), sizes, n, rules)
        return None
    try:
        source, staged = staging.stage_hit_tokens(layout, speculation, policy)
    except staging.SymbolicBranchError:
        # vLLM's fixed-point loop over more than two groups branches on the cache (see below); the
        # reference's one scan never does
        assert not rules.declarative and not refimpl.is_simple(sizes), (policy, layout, speculation)
        return None
    want_cache, got_cache = _Recording(sets), _Recording(sets)
    want = refimpl.hit_tokens(want_cache, sizes, n, rules)
    got = staged(n, got_cache)
    assert got == want, (policy, layout, speculation, n, source)
    # never a boundary refimpl does not ask (a value the spec assigns and then uses only in a branch, the
    # staged function asks only in that branch, where refimpl asks it at the assignment)
    assert got_cache.asked <= want_cache.asked, (policy, layout, speculation, n, source)
    return want


@settings(max_examples=300, deadline=None)
@given(data=st.data(), layout=layouts(), speculation=speculations, n=st.integers(1, 2500),
       policy=st.sampled_from(POLICIES))
def test_staged_hit_tokens_is_refimpls_on_random_layouts(data, layout, speculation, n, policy):
    sizes = refimpl.derive_sizes(layout, speculation)
    _check(layout, speculation, n, data.draw(caches(len(sizes.groups), n + 64)), policy)


def _accepted(name, speculation, dcp) -> bool:
    """Whether the spec accepts the catalogue layout at this DCP size with this speculative setting (no
    sharded sliding window or chunked-local group at DCP > 1, no drop with chunked local attention, no
    EAGLE-family mode beside it)."""
    try:
        refimpl.derive_sizes(to_refimpl(replace(CATALOGUE[name], dcp=dcp)), speculation)
    except ValueError:
        return False
    return True


CATALOGUE_SETTINGS = [
    (name, speculation, dcp)
    for name in sorted(CATALOGUE)
    for speculation in (refimpl.Speculation("none"), refimpl.Speculation("drop", 1),
                        refimpl.Speculation("drop", 2, True), refimpl.Speculation("lookahead", 1))
    for dcp in (1, 2, 8)
    if _accepted(name, speculation, dcp)
]


@pytest.mark.parametrize(("name", "speculation", "dcp"), CATALOGUE_SETTINGS,
                         ids=[f"{n}-{s.describe()}-dcp{d}" for n, s, d in CATALOGUE_SETTINGS])
@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_staged_reference_is_refimpls_on_the_catalogue(name, speculation, dcp, data):
    layout = to_refimpl(replace(CATALOGUE[name], dcp=dcp))
    sizes = refimpl.derive_sizes(layout, speculation)
    a = sizes.alignment
    n = data.draw(st.integers(1, 6 * a + 3 * sizes.scheduler_block))
    # caches at the hash-unit grid: the draws of `caches` scaled to it, so that hits of several A happen
    horizon = n // sizes.hash_block + 4
    sets = [{x * sizes.hash_block for x in s} for s in data.draw(caches(len(sizes.groups), horizon))]
    _check(layout, speculation, n, sets, "reference")


def test_the_check_sees_a_wrong_window():
    """A staged window that forgets its lowest block (a mutant of StagedCache.window) gives a different
    hit than refimpl's on a cache where that block is missing: the comparison above can fail."""
    layout = refimpl.Layout((refimpl.Group("full", 64), refimpl.Group("swa", 32, window=512)), name="gemma")
    speculation = refimpl.Speculation("none")
    sizes = refimpl.derive_sizes(layout, speculation)
    n = 64 * 12 + 1
    sets = [set(range(64, 64 * 13, 64)), set(range(32, 32 * 30, 32)) - {32 * 9}]  # block 8 of SWA missing
    want = refimpl.hit_tokens(refimpl.CacheState.from_sets(sets), sizes, n, refimpl.REFERENCE)
    original = staging.StagedCache.window

    def short(self, k, x, unit, before, after):
        return original(self, k, x, unit, before - 1, after)

    staging.StagedCache.window = short
    try:
        _, staged = staging.stage_hit_tokens(layout, speculation)
    finally:
        staging.StagedCache.window = original
    assert staged(n, refimpl.CacheState.from_sets(sets)) != want
    _, staged = staging.stage_hit_tokens(layout, speculation)
    assert staged(n, refimpl.CacheState.from_sets(sets)) == want


def test_vllms_fixed_point_loop_stages_only_when_it_is_one_pass():
    """vLLM's lookup loops until the cache stops shortening the hit: a branch on the cache, which a
    function of the request alone cannot take at staging time, except for a simple hybrid (full attention
    and one other group), where vLLM makes one pass."""
    three = refimpl.Layout((refimpl.Group("full", 16), refimpl.Group("mamba", 16),
                            refimpl.Group("swa", 16, window=32)), name="three")
    with pytest.raises(staging.SymbolicBranchError):
        staging.stage_hit_tokens(three, refimpl.Speculation("drop", 1), "vllm_0_33")
    simple = refimpl.Layout((refimpl.Group("full", 16), refimpl.Group("mamba", 16)), name="simple")
    sets = [set(range(16, 16 * 9, 16)), {16 * 3, 16 * 5}]
    # full attention holds 8 blocks, then drops one (112); the Mamba finder then takes its last state at
    # or below 112: 80
    assert _check(simple, refimpl.Speculation("drop", 1), 16 * 8 + 5, sets, "vllm_0_33")[0] == 16 * 5


def test_staging_refuses_branches_and_symbolic_divisors():
    def branches(cache, n):
        return 1 if n > 3 else 0

    with pytest.raises(SymbolicBranchError, match="ite"):
        stage.stage(branches, stage.N)
    with pytest.raises(SpecError, match="must be concrete"):
        stage.stage(lambda cache, n: 100 // n, stage.N)
    with pytest.raises(SpecError, match="concrete positive"):
        stage.stage(lambda cache, n: n % 0, stage.N)


def test_operators_stage_to_their_python_source():
    source, fn = stage.stage(
        lambda cache, n: (ite(n > 3, n, 3), min_(n, 7), and_(True, n > 1), and_(n > 1, False),
                          max_aligned(4, n, lambda x: and_(x < 10, cache.has(0, x)))),
        stage.N)
    assert "(n_tokens if (n_tokens > 3) else 3)" in source and "min(n_tokens, 7)" in source
    cache = refimpl.CacheState.from_sets([{4, 12}])
    assert fn(13, cache) == (13, 7, True, False, 4)
    assert fn(2, cache) == (3, 2, True, False, 0)


def test_a_value_used_twice_is_computed_once_only_where_refimpl_computes_it():
    """A cache query used twice is bound to a local only when every call asks it; one under an
    ``and_``'s second operand stays inline, so the function never asks it when the first is False."""
    def f(cache, n):
        strict = cache.run_from(0, 0, 4, n)
        lazy = cache.run_from(1, 0, 4, n)
        return strict + strict, and_(n > 10, lazy > 1), and_(n > 20, lazy > 2)

    source, fn = stage.stage(f, stage.N)
    assert source.count("cache.run_from(0,") == 1 and source.count("cache.run_from(1,") == 2
    cache = _Recording([{4, 8}, {4, 8, 12}])
    assert fn(5, cache) == (4, False, False)  # blocks 0 and 1 of group 0 cached: 2 + 2
    assert {k for k, _ in cache.asked} == {0}
