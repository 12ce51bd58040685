"""The invariants of `make prove`, checked on concrete integers over wider ranges than Z3 enumerates
(random layouts outside the catalogue, prompts up to 3000 tokens, arbitrary cache states).

Each invariant is its claim function in ``kvhit.proofs``, the definition the prover runs, here evaluated on
the generated refimpl by ``kvhit.proofs.concrete``. The witness ``y`` of ``hit_is_the_longest_valid`` ranges
over every multiple of ``A`` from 0 up to ``min(N - 1, |H| * h)``, so that claim is checked exactly; each check also
asserts that the claim's assumption held, so none passes vacuously.
"""

from hypothesis import given, settings
from hypothesis import strategies as st

from kvhit import refimpl
from kvhit.proofs.concrete import ConcreteContext, config_of, outcomes
from kvhit.proofs.runner import BY_NAME
from kvhit.refimpl import Speculation

from .strategies import caches, layouts, speculations

REF = refimpl.ALL_POLICIES["reference"]


def _setup(data, layout, speculation, n):
    sizes = refimpl.derive_sizes(layout, speculation)
    sets = data.draw(caches(len(sizes.groups), n + 64))
    return sizes, sets


def _assert_holds(name, layout, speculation, n, cache, candidates=None):
    """The claim ``name`` holds for the reference at every candidate, its assumption holding at each."""
    checked = list(outcomes(BY_NAME[name].claim, config_of(layout, speculation), REF, n, cache, candidates))
    assert checked, f"{name}: no candidate was tried"
    for outcome in checked:
        assert outcome.assumption, f"{name}: the assumption fails at {outcome.values} (a vacuous check)"
        assert outcome.holds, f"{name} fails at {outcome.values}: {outcome.shown}"


@settings(max_examples=300, deadline=None)
@given(data=st.data(), layout=layouts(), speculation=speculations, n=st.integers(1, 3000))
def test_reference_hit_is_aligned_capped_valid_and_longest(data, layout, speculation, n):
    sizes, sets = _setup(data, layout, speculation, n)
    cache = refimpl.CacheState.from_sets(sets)
    for name in ("hit_is_aligned_and_capped", "lookup_stays_within_hashes", "hit_is_valid_in_every_group"):
        _assert_holds(name, layout, speculation, n, cache)
    cap = min(n - 1, refimpl.hash_reach(sizes, n))  # y = 0 is never longer: it runs the claim when cap < A
    _assert_holds("hit_is_the_longest_valid", layout, speculation, n, cache,
                  {"y": range(0, cap + 1, sizes.alignment)})
    fresh = refimpl.CacheState.from_sets(sets)
    _, reach, _, _ = refimpl.hit_tokens(fresh, sizes, n, REF)
    assert fresh.max_query <= reach


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
    """Part (a) on an arbitrary cache, and both parts on a cache whose every group holds every boundary up
    to the hashes without speculation (where part (b) speaks)."""
    name = "eagle_loses_at_most_one_block_beyond_alignment"
    sizes1, sets = _setup(data, layout, speculation, n)
    _assert_holds(name, layout, speculation, n, refimpl.CacheState.from_sets(sets))
    r0 = refimpl.hash_reach(refimpl.derive_sizes(layout, Speculation("none")), n)
    whole = refimpl.CacheState.from_sets([set(range(1, r0 + 1))] * len(sizes1.groups))
    assert ConcreteContext(config_of(layout, speculation), REF, n, whole).dense(r0), "part (b) is not exercised"
    _assert_holds(name, layout, speculation, n, whole)
