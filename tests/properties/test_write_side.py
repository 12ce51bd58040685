"""The write side: the generated refimpl computes what the spec says, the Z3 decision procedure over the
cache a request leaves agrees with plain loops over it, and the write-side invariants hold on concrete
integers over wide ranges (for the reference policy), on random layouts beyond the catalogue."""

import z3
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from kvhit import refimpl
from kvhit.convert import to_spec
from kvhit.proofs.model import SPEC
from kvhit.spec import retention as spec_retention
from kvhit.spec.lower_z3 import SymbolicWrittenCache, fresh_int, lowering
from kvhit.spec.sizes import derive_sizes as spec_derive_sizes
from kvhit.spec.terms import _zv

from .strategies import layouts

WRITE_SPECULATIONS = (
    refimpl.Speculation("none"), refimpl.Speculation("lookahead", 1), refimpl.Speculation("lookahead", 2, True),
    refimpl.Speculation("drop", 1), refimpl.Speculation("drop", 2, True))
write_speculations = st.sampled_from(WRITE_SPECULATIONS)


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
    spec_layout, spec_speculation = to_spec(layout), to_spec(speculation)
    spec_sizes = spec_derive_sizes(spec_layout, spec_speculation)
    for name in _policies():
        got = refimpl.request_writes(sizes, n, interval, refimpl.ALL_POLICIES[name])
        want = spec_retention.request_writes(spec_sizes, n, interval, SPEC.ALL_POLICIES[name])
        assert [(g.kind.value, g.extent, g.every, g.points, g.ends, g.need, g.shift, g.period, g.gaps)
                for g in got] == \
            [(g.kind.value, g.extent, g.every, g.points, g.ends, g.need, g.shift, g.period, g.gaps) for g in want]
        assert refimpl.repeat_hits(sizes, n, interval, refimpl.ALL_POLICIES[name], 3) == \
            spec_retention.repeat_hits(spec_sizes, n, interval, SPEC.ALL_POLICIES[name], 3)


@st.composite
def gap_settings(draw, positive_intervals=True):
    """A layout whose sliding window can lose blocks before they are cached (``gaps_possible``): a small
    window next to a Mamba group whose chunk stops lag the cacheable prefix by more than a window; with
    retention dense, 0 and (``positive_intervals``) one or two scheduler blocks."""
    swa_block = draw(st.sampled_from([16, 32]))
    groups = [refimpl.Group("swa", swa_block, window=draw(st.sampled_from([17, 20, 32, 48])),
                            eagle=draw(st.booleans())),
              refimpl.Group("mamba", draw(st.sampled_from([64, 128, 256]))),
              # without a full-attention group the Mamba group is read at the sliding window's block (partial
              # hits), and the cacheable prefix never lags a chunk end
              refimpl.Group("full", draw(st.sampled_from([16, 32])), eagle=draw(st.booleans()))]
    layout = refimpl.Layout(tuple(draw(st.permutations(groups))), name="gaps")
    speculation = draw(write_speculations)
    sizes = refimpl.derive_sizes(layout, speculation)
    assume(any(sg.kind.value == "swa" and refimpl.gaps_possible(sizes, k) for k, sg in enumerate(sizes.groups)))
    positive = [sizes.scheduler_block, 2 * sizes.scheduler_block] if positive_intervals else []
    interval = draw(st.sampled_from([None, 0, *positive]))
    return layout, speculation, sizes, interval


def test_a_sliding_window_loses_blocks_freed_before_caching():
    """vLLM 0.33.0, full16 + mamba128 + swa32 (window 17), drop, R = 0, N = 128: the first chunk ends at
    the prompt checkpoint 112, where nothing is cacheable yet (the aligned prefix is 0); the second chunk
    frees blocks 0-2 (outside the window of token 112) before caching. Measured on vLLM (long conformance
    run, then tests/conformance/test_write_side_matches_vllm.py::test_pinned_write_scenarios): the sliding
    window retains nothing; at N = 160 the first chunk (to 144) caches 128 tokens and block 0 stays."""
    layout = refimpl.Layout((refimpl.Group("full", 16), refimpl.Group("mamba", 128),
                             refimpl.Group("swa", 32, window=17)))
    sizes = refimpl.derive_sizes(layout, refimpl.Speculation("drop", 1))
    rules = refimpl.ALL_POLICIES["vllm_0_33"]
    measured = {128: [], 160: [32], 256: [32, 128, 160], 300: [128, 160]}
    for n, boundaries in measured.items():
        cache = refimpl.written_cache(refimpl.request_writes(sizes, n, 0, rules))
        assert [x for x in range(32, n + 1, 32) if cache.has(2, x)] == boundaries, n
    assert refimpl.request_writes(sizes, 128, 0, rules)[2].gaps[0] == (0, 96)


def _fixed(constraints):
    """The value of a term once ``constraints`` fix its variables (Python values pass through)."""
    solver = z3.Solver()
    solver.add(*constraints)
    assert solver.check() == z3.sat
    model = solver.model()

    def value(v):
        if isinstance(v, bool | int):
            return v
        e = model.eval(_zv(v), True)
        return z3.is_true(e) if z3.is_bool(e) else e.as_long()

    return value


@settings(max_examples=80, deadline=None)
@given(setting=write_settings(), n=st.integers(1, 1500), longer=st.integers(1, 400),
       policy=st.sampled_from(sorted(refimpl.POLICIES)), repeats=st.integers(0, 1))
def test_z3_reading_of_a_written_cache_matches_refimpl(setting, n, longer, policy, repeats):
    """Run the write side (a first request, then ``repeats`` resends writing on top of it) and the read
    side on symbolic prompts, then fix them: Z3 must give refimpl's hits for a resend and a longer
    sibling, and each window and run query refimpl's loops answer."""
    _z3_matches_refimpl(setting, n, longer, policy, repeats)


@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.filter_too_much])
@given(setting=gap_settings(positive_intervals=False), n=st.integers(1, 1500), longer=st.integers(1, 400),
       policy=st.sampled_from(sorted(refimpl.POLICIES)))
def test_z3_reading_of_a_cache_with_lost_blocks_matches_refimpl(setting, n, longer, policy):
    """The same on layouts whose sliding window loses blocks before caching them (``Held.gaps``), after the
    first request only. A resend intersects the gaps pairwise, and since the reference's scheduler also
    stops at its retained Mamba states (up to 11 gap entries a group here, 9 under vLLM 0.33) one resend
    made the derandomized run build terms for over 15 minutes (12 examples without it: 290 s; 6 took 306 s
    of CI's unit stage on 2026-12-03, whose 45 minutes were then nearly spent; 4 here). A positive
    retention interval keeps a state every interval, and each one stops the reference's chunks: two of the
    four derandomized examples had R = 256 and took 111 s each of the test's 224 s (2026-12-07, when CI's
    45 minutes were nearly spent again), so here the interval is dense or 0 (vLLM's default): 2.5 s alone,
    50 s under ``-n 2`` as ``make test`` runs it, 121 s in a CI run;
    positive intervals are read by Z3 in the test above, without gaps, and on these layouts by plain loops
    against vLLM;
    resends on these layouts are compared by
    plain loops against vLLM, stock and patched (tests/conformance: test_write_side_matches_vllm's
    gap layout, test_patched_vllm's write differential)."""
    repeats = 0
    layout, speculation, sizes, interval = setting
    first = refimpl.request_writes(sizes, n, interval, refimpl.ALL_POLICIES[policy])
    assume(any(lo < hi for g in first for lo, hi in g.gaps))  # a block really is lost
    _z3_matches_refimpl(setting, n, longer, policy, repeats)


def _z3_matches_refimpl(setting, n, longer, policy, repeats):
    layout, speculation, sizes, interval = setting
    spec_layout, spec_speculation = to_spec(layout), to_spec(speculation)
    rules = SPEC.ALL_POLICIES[policy]
    ssizes = spec_derive_sizes(spec_layout, spec_speculation)
    with lowering():
        n_sym, n2_sym = fresh_int("N"), fresh_int("N2")
        groups = SPEC.request_writes(ssizes, n_sym, interval, rules)
        for _ in range(repeats):
            groups = spec_retention.repeat(ssizes, n_sym, interval, rules, groups)[2]
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
    value = _fixed([n_sym.z == n, n2_sym.z == n + longer])

    rsizes = refimpl.derive_sizes(layout, speculation)
    rgroups = refimpl.request_writes(rsizes, n, interval, refimpl.ALL_POLICIES[policy])
    for _ in range(repeats):
        rgroups = refimpl.repeat(rsizes, n, interval, refimpl.ALL_POLICIES[policy], rgroups)[2]
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
    """The resend and a longer prompt hit what every state retained gives; with a Mamba group read at hash
    granularity only the resend (``test_with_one_partial_tail_a_longer_sibling_resumes_at_the_resends_point``);
    not in the two settings the adapter leaves to vLLM: drop mode where only Mamba groups drop
    (``test_where_only_mamba_drops_with_mtp_the_resend_point_is_never_computed``) and a Mamba group read at
    hash granularity with multi-module MTP in drop mode (full 16 + Mamba 32, MTP 2, N = 33: 0 where every
    state retained gives 16)."""
    layout, speculation, sizes, interval = setting
    dropping = [g.kind.value for g in sizes.groups if g.drops]
    assume(not (sizes.drop and dropping and set(dropping) == {"mamba"}))
    assume(not (sizes.drop and sizes.prefill_lookahead >= 2 and refimpl.mamba_at_hash_granularity(sizes)))
    rules = refimpl.REFERENCE
    groups = refimpl.request_writes(sizes, n, interval, rules)
    kept = refimpl.written_cache(groups)
    dense = refimpl.written_cache(refimpl.dense_groups(sizes, n))
    for prompt in (n,) if refimpl.mamba_at_hash_granularity(sizes) else (n, n + longer):
        assert refimpl.hit_tokens(kept, sizes, prompt, rules)[0] == refimpl.hit_tokens(dense, sizes, prompt, rules)[0]
    hits = refimpl.repeat_hits(sizes, n, interval, rules, 5)
    assert len(set(hits[1:])) == 1
    if interval is not None:
        boundaries = len(refimpl.replay_boundaries(sizes, n, rules))
        for g in groups:
            if g.kind.value in ("swa", "mamba"):
                assert refimpl.retained_states(g) <= refimpl.retention_bound(sizes, g, n, interval, boundaries)


def test_with_one_partial_tail_a_longer_sibling_resumes_at_the_resends_point():
    """Where the reference gives a longer sibling less than every state retained would (README, "Not proved"):
    full attention 16 beside Mamba 32, read at 16-token hash units, dense retention. A prompt of 48 tokens
    leaves the Mamba state at 32 (a block end) and one partial tail, at 32, where its resend resumes (47
    floored); a sibling of 49 tokens would resume at 48, inside the second Mamba block, which no state
    holds: it hits 32 where every state retained gives 48. vLLM keeps the same one tail per request."""
    sizes = refimpl.derive_sizes(refimpl.Layout((refimpl.Group("full", 16), refimpl.Group("mamba", 32))),
                                 refimpl.Speculation("none"))
    rules = refimpl.REFERENCE
    kept = refimpl.written_cache(refimpl.request_writes(sizes, 48, None, rules))
    dense = refimpl.written_cache(refimpl.dense_groups(sizes, 48))
    hits = [(refimpl.hit_tokens(kept, sizes, p, rules)[0], refimpl.hit_tokens(dense, sizes, p, rules)[0])
            for p in (48, 49)]
    assert hits == [(32, 32), (32, 48)]
    stock = refimpl.written_cache(refimpl.request_writes(sizes, 48, None, refimpl.VLLM_0_33))
    assert refimpl.hit_tokens(stock, sizes, 49, refimpl.VLLM_0_33)[0] == 32


def test_where_only_mamba_drops_with_mtp_the_resend_point_is_never_computed():
    """Where the adapter leaves a layout to vLLM (``refimpl.ONLY_MAMBA_DROPS``): one Mamba group of 16 tokens,
    two MTP modules in drop mode, a prompt of 17. Its resend resumes at 16 with every state retained, but 16
    lies within the prefill lookahead of the prompt end, where no chunk ends, so no state is ever computed
    there and the resend hits 0 (README, "Not proved")."""
    sizes = refimpl.derive_sizes(refimpl.Layout((refimpl.Group("mamba", 16),)),
                                 refimpl.Speculation("drop", 2, True))
    kept = refimpl.written_cache(refimpl.request_writes(sizes, 17, None, refimpl.REFERENCE))
    dense = refimpl.written_cache(refimpl.dense_groups(sizes, 17))
    assert [refimpl.hit_tokens(c, sizes, 17, refimpl.REFERENCE)[0] for c in (kept, dense)] == [0, 16]


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


@st.composite
def sliding_window_descriptions(draw):
    """A sliding-window :class:`Held` with gaps (the write side produces gaps only where no tail reaches,
    so the Z3 reading of gaps is checked on descriptions drawn directly)."""
    b = draw(st.sampled_from([16, 32]))
    need = draw(st.integers(1, 3))
    shift = draw(st.integers(0, min(1, need - 1)))
    extent = b * draw(st.integers(0, 30))
    every = draw(st.booleans())
    # the write side keeps every block when a tail would cover a whole period, so periods exceed a tail
    period = 0 if every else draw(st.sampled_from([0, (need + 1) * b, (need + 3) * b]))
    ends = tuple(b * draw(st.integers(-1, 32)) for _ in range(draw(st.integers(0, 3))))
    gaps = tuple((b * lo, b * (lo + draw(st.integers(-1, 6)))) for lo in draw(st.lists(st.integers(0, 30), max_size=3)))
    return refimpl.Held(kind=refimpl.Kind.SWA, block=b, unit=b, extent=extent, every=every, ends=ends, need=need,
                        shift=shift, period=period, gaps=gaps)


@settings(max_examples=60, deadline=None)
@given(held=sliding_window_descriptions(), data=st.data())
def test_z3_reading_of_gaps_matches_the_loops(held, data):
    """Window and run queries, and the closed-form ``max_aligned`` over a window predicate, on a
    description with gaps whose bounds are Z3 variables, equal refimpl's loops."""
    from kvhit.spec import cache as spec_cache
    from kvhit.spec.domain import Kind
    from kvhit.spec.lower_z3 import symbolic_max_aligned

    b = held.block
    before = data.draw(st.integers(0, held.need))
    after = data.draw(st.integers(0, held.need - before))
    with lowering():
        bounds = [(fresh_int("lo"), fresh_int("hi")) for _ in held.gaps]
        symbolic = spec_cache.Held(kind=Kind.SWA, block=b, unit=b, extent=held.extent, every=held.every,
                                   ends=held.ends, need=held.need, shift=held.shift, period=held.period,
                                   gaps=tuple(bounds))
        cache = SymbolicWrittenCache((symbolic,))
        windows = [cache.window(0, x, b, before, after) for x in range(b, 34 * b, b)]
        run = cache.run_from(0, 0, b, 40)
        best = symbolic_max_aligned(b, 33 * b, lambda x: cache.window(0, x, b, before, after))
    value = _fixed([c for (lo, hi), (lo_v, hi_v) in zip(bounds, held.gaps) for c in (lo.z == lo_v, hi.z == hi_v)])

    loops = refimpl.written_cache((held,))
    want = [loops.window(0, x, b, before, after) for x in range(b, 34 * b, b)]
    assert [value(w) for w in windows] == want, held
    assert value(run) == loops.run_from(0, 0, b, 40), held
    assert value(best) == max([x for x, ok in zip(range(b, 34 * b, b), want) if ok], default=0), held


def test_the_decoded_cache_moves_a_resume_point_only_where_resume_points_adds_one():
    """``refimpl.resume_points`` adds the resend on the decoded cache (``dense_groups(decoded=True)``) only
    in drop mode with multi-module MTP, and no sibling point for it. That holds because on every catalogue
    layout at DCP 1, 2, 4 and 8, in every speculative setting, for prompts up to 8 alignment units, the
    decoded cache gives the resend, the next sibling and the far sibling the hits the prefill's cache gives,
    except in those settings, where the two siblings resume where the decoded resend does."""
    from kvhit.written import WrittenCache

    rules = refimpl.policy_rules("reference")
    speculations = [refimpl.Speculation("none"), refimpl.Speculation("lookahead", 1),
                    refimpl.Speculation("drop", 1), refimpl.Speculation("lookahead", 2, True),
                    refimpl.Speculation("drop", 2, True)]
    differing = checked = 0
    for layout, dcp, speculation, sizes in _catalogue_write_sizes((1, 2, 4, 8), speculations):
        top = 8 * max(sizes.alignment, sizes.scheduler_block)
        if layout.name == "dsv4_report":
            top = 3 * sizes.scheduler_block
        for n in range(1, top + 1, max(1, top // 400)):
            reads = [WrittenCache(refimpl.dense_groups(sizes, n, decoded)) for decoded in (False, True)]
            prefill, decoded = ([refimpl.hit_tokens(cache, sizes, m, rules)[0]
                                 for m in (n, n + 1, refimpl.far_sibling(sizes, n))] for cache in reads)
            checked += 1
            if prefill != decoded:
                differing += 1
                where = (layout.name, dcp, speculation, n, prefill, decoded)
                assert sizes.drop and refimpl.reprefillable(sizes) > 0, where
                assert decoded[1] == decoded[2] == decoded[0], where
    assert checked > 30000 and differing > 0, (checked, differing)


def _catalogue_write_sizes(dcps, speculations):
    """``(layout, dcp, speculation, sizes)`` of every catalogue layout with a write side, at each DCP size and
    speculative setting the spec accepts."""
    from kvhit.layouts import catalogue

    for layout in catalogue().values():
        if any(g.kind.value == "chunked" for g in layout.groups):
            continue  # no write side
        for dcp in dcps:
            for speculation in speculations:
                try:
                    yield layout, dcp, speculation, refimpl.derive_sizes(
                        refimpl.Layout(layout.groups, dcp, layout.prefix_match_unit), speculation)
                except ValueError:
                    continue


def test_the_repaired_policy_resumes_where_the_declarative_read_side_does():
    """``refimpl.resume_points`` computes a policy's resume points with the declarative read side under its
    rules (cheaper in Z3 than vLLM's unrolled loop). For ``vllm_0_33_repaired`` that is its own read side's
    answer because make prove proves that read side the longest valid hit; here the two are compared on
    concrete dense caches (the prefill's and the decoded one) on every catalogue layout at DCP 1 and 2, in
    every speculative setting, for the resend, the next sibling and the far sibling."""
    from dataclasses import replace

    from kvhit.written import WrittenCache

    own = refimpl.policy_rules("vllm_0_33_repaired")
    declarative = replace(own, declarative=True)
    checked = 0
    for layout, dcp, speculation, sizes in _catalogue_write_sizes((1, 2), WRITE_SPECULATIONS):
        top = 6 * max(sizes.alignment, sizes.scheduler_block)
        for n in range(1, top + 1, max(1, top // 150)):
            for decoded in (False, True):
                cache = WrittenCache(refimpl.dense_groups(sizes, n, decoded))
                for m in (n, n + 1, refimpl.far_sibling(sizes, n)):
                    where = (layout.name, dcp, speculation, n, decoded, m)
                    assert (refimpl.hit_tokens(cache, sizes, m, own)[0]
                            == refimpl.hit_tokens(cache, sizes, m, declarative)[0]), where
                    checked += 1
    assert checked > 10000, checked


def test_a_resend_after_decoding_resumes_past_the_prefills_point_under_dcp():
    """Qwen3-Next-like, MTP 2 in drop mode, DCP 2 (full-attention block 3200, hash unit 1600), N = 8000:
    vLLM's real Scheduler (tests/adapter/test_scheduler_plugin.py, three decode steps) leaves a partial-tail
    entry at 8000 and its first repeat hits 6400. The reference keeps the Mamba state at 6400 as well as at
    4800, where a resend of a request that ended after its prefill resumes, and vLLM's own boundary, one
    scheduler block below floor(8000, 3200): 3200."""
    layout = refimpl.Layout((refimpl.Group("full", 1600, eagle=True), refimpl.Group("mamba", 1600)), dcp=2)
    sizes = refimpl.derive_sizes(layout, refimpl.Speculation("drop", 2, True))
    assert refimpl.dense_groups(sizes, 8000, True)[0].points == (8000,)
    assert set(refimpl.replay_boundaries(sizes, 8000, refimpl.policy_rules("reference"))) == {3200, 4800, 6400}
