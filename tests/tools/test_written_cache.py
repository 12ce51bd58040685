"""WrittenCache is refimpl.written_cache with queries that jump over held stretches: same answers, same
max_query, same hits, on random Held descriptions and on what the write side really leaves."""

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from kvhit import refimpl
from kvhit.layouts import catalogue
from kvhit.refimpl import Held, Kind, Speculation
from kvhit.written import WrittenCache, first_writes, replay_boundaries

from ..properties.strategies import layouts

POLICIES = ("reference", "vllm_0_33", "historical")
positions = st.integers(-1, 700)


@st.composite
def helds(draw):
    """A Held of any kind with arbitrary positions: wider than what the write side produces (points past
    the extent, overlapping and out-of-order tails, periods that are not multiples of the unit, gaps on
    any kind, empty ones included)."""
    kind = draw(st.sampled_from([Kind.FULL, Kind.SWA, Kind.MAMBA, Kind.CHUNKED]))
    block = draw(st.sampled_from([4, 8, 16, 32]))
    unit = draw(st.sampled_from([block, block // 2, block // 4, 2 * block]))
    need = draw(st.integers(1, 6))
    period = draw(st.sampled_from([0, 0, block, 2 * block, 3 * block, 24, 8 * block]))
    gap = st.tuples(st.integers(-1, 40), st.integers(-1, 40)).map(lambda g: (g[0] * block, g[1] * block))
    return Held(kind=kind, block=block, unit=unit, extent=draw(st.integers(0, 600)), every=draw(st.booleans()),
                points=tuple(draw(st.lists(positions, max_size=4))), ends=tuple(draw(st.lists(positions, max_size=4))),
                need=need, shift=draw(st.integers(0, 1)), period=period,
                gaps=tuple(draw(st.lists(gap, max_size=2))) if draw(st.integers(0, 3)) == 0 else ())


def _unit(g, choice):
    return {"block": g.block, "unit": g.unit, "half": max(1, g.block // 2), "double": 2 * g.block}[choice]


units = st.sampled_from(["block", "block", "unit", "half", "double"])


def _windows_agree(reader, g, choice, before, after, off):
    """``reader``'s windows of ``g`` are ``refimpl.written_cache``'s, at every end up to past the extent."""
    unit = _unit(g, choice)
    for x in range(off, g.extent + 4 * unit, unit):
        fast, slow = reader([g]), refimpl.written_cache([g])
        assert fast.window(0, x, unit, before, after) == slow.window(0, x, unit, before, after), x
        assert fast.max_query == slow.max_query, x


windows = {"g": helds(), "choice": units, "before": st.integers(0, 8), "after": st.integers(0, 2),
           "off": st.integers(0, 3)}


@settings(max_examples=1000, deadline=None)
@given(**windows)
def test_written_window_answers_like_refimpl(g, choice, before, after, off):
    _windows_agree(WrittenCache, g, choice, before, after, off)


class HoldsTheBlockPastTheExtent(WrittenCache):
    """Known bad: a run of held blocks ends one block late when it reaches the extent (the block ending
    past the extent counted as held: ``j * unit <= extent`` for ``refimpl.holds``'s ``(j + 1) * unit <=
    extent``)."""

    def _first_miss(self, k, unit, j):
        miss = super()._first_miss(k, unit, j)
        return miss + 1 if miss == self.groups[k].extent // unit else miss


def test_the_window_comparison_catches_a_reader_one_block_off_at_the_extent():
    """The random comparison above is not vacuous: run on a reader that is wrong at the extent, it fails."""

    @settings(max_examples=1000, deadline=None, database=None, report_multiple_bugs=False)
    @given(**windows)
    def compare(g, choice, before, after, off):
        _windows_agree(HoldsTheBlockPastTheExtent, g, choice, before, after, off)

    with pytest.raises(AssertionError):
        compare()


@settings(max_examples=1000, deadline=None)
@given(g=helds(), choice=units, limit=st.integers(0, 200))
def test_written_run_from_answers_like_refimpl(g, choice, limit):
    unit = _unit(g, choice)
    for start in range(g.extent // unit + 3):  # a run from every block up to past the extent
        fast, slow = WrittenCache([g]), refimpl.written_cache([g])
        assert fast.run_from(0, start, unit, limit) == slow.run_from(0, start, unit, limit), start
        assert fast.max_query == slow.max_query, start


@settings(max_examples=1500, deadline=None)
@given(g=helds(), choice=units, times=st.integers(1, 4), lo=st.integers(-1, 650),
       window=st.sampled_from([(1, 0), (1, 0), (0, 0), (0, 1), (2, 0), (3, 1), (8, 1)]))
def test_written_last_held_answers_like_the_scan(g, choice, times, lo, window):
    unit = _unit(g, choice)
    step = unit * times if times < 4 else unit + 1  # steps the unit divides, and one it does not
    before, after = window
    for hi in range(0, g.extent + 4 * step, max(1, step // 3)):
        fast, slow = WrittenCache([g]), refimpl.written_cache([g])
        got = fast.last_held(0, step, lo, hi, unit, before, after)
        assert got == slow.last_held(0, step, lo, hi, unit, before, after), hi
        assert fast.max_query == slow.max_query, hi


@st.composite
def written_settings(draw):
    """A layout (random or from the catalogue, chunked local excluded: the write side refuses it), a
    speculative mode, a retention interval the spec accepts (None, 0 or a multiple of S) and a policy."""
    if draw(st.booleans()):
        layout = draw(layouts())
    else:
        layout = catalogue()[draw(st.sampled_from(sorted(set(catalogue()) - {"chunked64"})))]
    speculation = draw(st.sampled_from([
        Speculation("none"), Speculation("lookahead", 1), Speculation("lookahead", 2, True),
        Speculation("drop", 1), Speculation("drop", 2, True)]))
    try:
        sizes = refimpl.derive_sizes(layout, speculation)
        s = sizes.scheduler_block
        interval = draw(st.sampled_from([None, 0, s, 2 * s, 4 * s]))
        refimpl.check_retention(sizes, interval)
    except ValueError:
        assume(False)
    return sizes, interval, draw(st.sampled_from(POLICIES))


def prompt_lengths(sizes, most):
    """Prompt lengths up to ``most``, half of them on or next to a multiple of a unit the policy floors
    to (where alignment, the cap and the hashes change their minds)."""
    units = sorted({sizes.alignment, sizes.scheduler_block, sizes.hash_block, sizes.config_block}
                   | {sg.block for sg in sizes.groups})
    near = st.builds(lambda u, k, d: max(1, k * u + d), st.sampled_from(units), st.integers(1, 8),
                     st.integers(-2, 2))
    return st.integers(1, most) | near


@settings(max_examples=400, deadline=None)
@given(setting=written_settings(), data=st.data())
def test_written_cache_gives_the_same_hit_and_reads_as_refimpl(setting, data):
    sizes, interval, policy = setting
    rules = refimpl.policy_rules(policy)
    big = 4 * max(sizes.alignment, sizes.scheduler_block)
    p = data.draw(prompt_lengths(sizes, 3 * big), label="P")
    n = p + data.draw(st.sampled_from([0, 1, sizes.hash_block, sizes.scheduler_block]) | st.integers(0, big),
                      label="N - P")
    groups = refimpl.request_writes(sizes, p, interval, rules)
    if data.draw(st.booleans(), label="after a repeat"):
        groups = refimpl.repeat(sizes, p, interval, rules, groups)[2]
    fast, slow = WrittenCache(groups), refimpl.written_cache(groups)
    assert refimpl.hit_tokens(fast, sizes, n, rules) == refimpl.hit_tokens(slow, sizes, n, rules)
    assert fast.max_query == slow.max_query


@settings(max_examples=300, deadline=None)
@given(setting=written_settings(), data=st.data())
def test_first_writes_are_refimpl_request_writes(setting, data):
    sizes, interval, policy = setting
    rules = refimpl.policy_rules(policy)
    p = data.draw(prompt_lengths(sizes, 12 * max(sizes.alignment, sizes.scheduler_block)), label="P")
    want = refimpl.request_writes(sizes, p, interval, rules)
    assert replay_boundaries(sizes, p, rules) == refimpl.replay_boundaries(sizes, p, rules)
    assert first_writes(sizes, p, interval, rules) == want
    assert first_writes(sizes, p, interval, rules, refimpl.replay_boundaries(sizes, p, rules)) == want
