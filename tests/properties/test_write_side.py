"""The write side: the generated refimpl computes what the spec says, the Z3 decision procedure over the
cache a request leaves agrees with plain loops over it, and the write-side invariants hold on concrete
integers over wide ranges (for the reference policy), on random layouts beyond the catalogue."""

import z3
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from kvhit import refimpl
from kvhit.proofs.model import SPEC
from kvhit.spec import retention as spec_retention
from kvhit.spec.lower_z3 import SymbolicWrittenCache, fresh_int, lowering
from kvhit.spec.sizes import derive_sizes as spec_derive_sizes
from kvhit.spec.terms import _zv

from .convert import to_spec
from .strategies import layouts

write_speculations = st.sampled_from([
    refimpl.Speculation("none"), refimpl.Speculation("lookahead", 1), refimpl.Speculation("lookahead", 2, True),
    refimpl.Speculation("drop", 1), refimpl.Speculation("drop", 2, True)])


@st.composite
def write_settings(draw):
    """A layout with a sliding-window or Mamba group, a speculative setting and a retention interval the
    spec accepts."""
    layout = draw(layouts())
    assume(any(g.kind in ("swa", "mamba") for g in layout.groups))
    speculation = draw(write_speculations)
    try:
        sizes = refimpl.derive_sizes(layout, speculation)
    except ValueError:
        assume(False)
    interval = draw(st.sampled_from([None, 0, sizes.scheduler_block, 2 * sizes.scheduler_block,
                                     5 * sizes.scheduler_block]))
    return layout, speculation, sizes, interval


def _policies():
    return sorted(refimpl.POLICIES) + ["retain_prompt_end", "junction_past_hit"]


@settings(max_examples=200, deadline=None)
@given(setting=write_settings(), n=st.integers(1, 3000))
def test_refimpl_write_side_matches_the_spec_interpreter(setting, n):
    layout, speculation, sizes, interval = setting
    spec_layout, spec_speculation = to_spec(layout, speculation)
    spec_sizes = spec_derive_sizes(spec_layout, spec_speculation)
    for name in _policies():
        got = refimpl.request_writes(sizes, n, interval, refimpl.ALL_POLICIES[name])
        want = spec_retention.request_writes(spec_sizes, n, interval, SPEC.ALL_POLICIES[name])
        assert [(g.kind.value, g.extent, g.every, g.points, g.ends, g.need, g.shift, g.period) for g in got] == \
            [(g.kind.value, g.extent, g.every, g.points, g.ends, g.need, g.shift, g.period) for g in want]
        assert refimpl.repeat_hits(sizes, n, interval, refimpl.ALL_POLICIES[name], 3) == \
            spec_retention.repeat_hits(spec_sizes, n, interval, SPEC.ALL_POLICIES[name], 3)


@settings(max_examples=80, deadline=None)
@given(setting=write_settings(), n=st.integers(1, 1500), longer=st.integers(1, 400),
       policy=st.sampled_from(sorted(refimpl.POLICIES)))
def test_z3_reading_of_a_written_cache_matches_refimpl(setting, n, longer, policy):
    """Run the write side and the read side on symbolic prompts, then fix them: Z3 must give refimpl's
    hits for a resend and a longer sibling, and each window and run query refimpl's loops answer."""
    layout, speculation, sizes, interval = setting
    spec_layout, spec_speculation = to_spec(layout, speculation)
    rules = SPEC.ALL_POLICIES[policy]
    ssizes = spec_derive_sizes(spec_layout, spec_speculation)
    with lowering():
        n_sym, n2_sym = fresh_int("N"), fresh_int("N2")
        groups = SPEC.request_writes(ssizes, n_sym, interval, rules)
        cache = SymbolicWrittenCache(groups)
        resend = SPEC.hit_tokens(cache, ssizes, n_sym, rules)
        sibling = SPEC.hit_tokens(cache, ssizes, n2_sym, rules)
        probes = []
        for k, sg in enumerate(ssizes.groups):
            if sg.kind.value == "swa":
                need = -(-(sg.window - 1) // sg.block)
                for after in (0, 1) if sg.drops else (0,):
                    for x in range(sg.block, min(n + 1, 40 * sg.block), sg.block):
                        probes.append(((k, x, sg.block, need, after), cache.window(k, x, sg.block, need, after)))
                probes.append((("run", k, sg.block), cache.run_from(k, 0, sg.block, n // sg.block + 1)))
    solver = z3.Solver()
    solver.add(n_sym.z == n, n2_sym.z == n + longer)
    assert solver.check() == z3.sat
    model = solver.model()

    def value(v):
        if isinstance(v, bool | int):
            return v
        e = model.eval(_zv(v), True)
        return z3.is_true(e) if z3.is_bool(e) else e.as_long()

    rsizes = refimpl.derive_sizes(layout, speculation)
    rgroups = refimpl.request_writes(rsizes, n, interval, refimpl.ALL_POLICIES[policy])
    concrete = refimpl.written_cache(rgroups)
    for query, symbolic in probes:
        if query[0] == "run":
            want = concrete.run_from(query[1], 0, query[2], n // query[2] + 1)
        else:
            want = concrete.window(*query)
        assert value(symbolic) == want, (query, rgroups)
    for result, prompt in ((resend, n), (sibling, n + longer)):
        if not value(result[3]):
            continue  # vLLM's loop did not converge within the unrolled passes
        want = refimpl.hit_tokens(refimpl.written_cache(rgroups), rsizes, prompt, refimpl.ALL_POLICIES[policy])
        assert tuple(value(v) for v in result[:3]) == want[:3], (prompt, rgroups)


@settings(max_examples=150, deadline=None)
@given(setting=write_settings(), n=st.integers(1, 5000), longer=st.integers(1, 3000))
def test_reference_write_side_invariants_hold_on_concrete_prompts(setting, n, longer):
    layout, speculation, sizes, interval = setting
    rules = refimpl.REFERENCE
    groups = refimpl.request_writes(sizes, n, interval, rules)
    kept = refimpl.written_cache(groups)
    dense = refimpl.written_cache(refimpl.dense_groups(sizes, n))
    for prompt in (n, n + longer):
        assert refimpl.hit_tokens(kept, sizes, prompt, rules)[0] == refimpl.hit_tokens(dense, sizes, prompt, rules)[0]
    hits = refimpl.repeat_hits(sizes, n, interval, rules, 5)
    assert len(set(hits[1:])) == 1
    if interval is not None:
        boundaries = len(refimpl.replay_boundaries(sizes, n, rules))
        for g in groups:
            if g.kind.value in ("swa", "mamba"):
                assert refimpl.retained_states(g) <= refimpl.retention_bound(sizes, g, n, interval, boundaries)


@settings(max_examples=100, deadline=None)
@given(setting=write_settings(), n=st.integers(1, 5000), policy=st.sampled_from(sorted(refimpl.POLICIES)))
def test_every_policy_is_stable_after_the_second_repeat(setting, n, policy):
    layout, speculation, sizes, interval = setting
    hits = refimpl.repeat_hits(sizes, n, interval, refimpl.ALL_POLICIES[policy], 6)
    assert len(set(hits[1:])) == 1, hits


def test_bad_retention_intervals_are_refused_with_the_reason():
    sizes = refimpl.derive_sizes(refimpl.Layout((refimpl.Group("full", 1600), refimpl.Group("mamba", 1600))),
                                 refimpl.Speculation())
    for bad, words in ((-1600, "multiple of the scheduler block 1600"), (800, "multiple"), (1.5, "must be None")):
        try:
            refimpl.request_writes(sizes, 4000, bad, refimpl.REFERENCE)
        except ValueError as e:
            assert words in str(e)
        else:
            raise AssertionError(f"interval {bad} accepted")
    full = refimpl.derive_sizes(refimpl.Layout((refimpl.Group("full", 16),)), refimpl.Speculation())
    try:
        refimpl.request_writes(full, 100, None, refimpl.REFERENCE)
    except ValueError as e:
        assert "needs a sliding-window or Mamba group" in str(e)
    else:
        raise AssertionError("a retention interval on a full-attention-only layout was accepted")
    assert refimpl.repeat_hits(full, 100, 0, refimpl.REFERENCE, 2) == (96, 96)
