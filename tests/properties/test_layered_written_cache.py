"""Layered written caches: per spec group a tuple of Held layers (what several earlier prompts left, each
clipped to what a later prompt shares with it), holding their union. With every position a Z3 variable
fixed to an integer, the decision procedure (``SymbolicWrittenCache``) answers each query and each hit
the plain loops (``spec.cache.written_cache``, and the generated ``refimpl.written_cache``) answer; a
reading whose sliding-window covers stop at two pieces is shown wrong."""

from dataclasses import replace

import pytest
import z3
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from kvhit import refimpl
from kvhit.convert import to_spec
from kvhit.proofs.model import SPEC
from kvhit.spec.cache import Held, written_cache
from kvhit.spec.domain import Kind
from kvhit.spec.lower_z3 import SymbolicWrittenCache, fresh_int, lowering
from kvhit.spec.sizes import derive_sizes as spec_derive_sizes
from kvhit.spec.terms import SpecError, Term, _zv

from .test_write_side import _fixed, write_settings


class TwoPieceChains(SymbolicWrittenCache):
    """Known bad: a sliding-window window is covered only by chains of at most two pieces (what suffices
    for one layer), so a window that needs a middle piece cut at another layer's extent is missed."""

    def _longest_chain(self, ls) -> int:
        return 2


def _symbolic(held, constraints):
    """``held`` with its extent, points and ends as fresh Z3 variables, each fixed (in ``constraints``) to
    its value: the terms the decision procedure builds cannot fold the integers away."""

    def var(v):
        t = fresh_int("pos")
        constraints.append(t.z == v)
        return t

    return replace(held, extent=var(held.extent), points=tuple(var(p) for p in held.points),
                   ends=tuple(var(t) for t in held.ends), gaps=tuple((lo, var(hi)) for lo, hi in held.gaps))


def _windows(g):
    """The ``(unit, before, after)`` windows a random layered group is asked for: every window length a
    sliding window's tails can cover; single boundaries (and for full attention one longer window)."""
    if g.kind is Kind.SWA:
        return [(g.block, before, after) for before in range(g.need + 1) for after in (0, 1)
                if 0 < before + after <= g.need]  # the read side's own, (need, 0) and (need - 1, 1), last
    if g.kind is Kind.MAMBA:
        return [(g.unit, 1, 0)]
    return [(g.block, 1, 0), (g.block, 3, 1)] + ([(g.unit, 1, 0)] if g.unit != g.block else [])


def _ask(cache, k, windows, ends, runs, scans):
    """Every query of spec group ``k``: each window ``(unit, before, after)`` at a symbolic end, to be read
    at each of ``ends``; each run ``(start, unit, limit)``; each scan ``(step, lo, hi, unit, before,
    after)`` of ``last_held``."""
    x = fresh_int("x")
    out = [(("window", k, x, w, ends), cache.window(k, x, *w)) for w in windows]
    out += [(("run", k, start, unit, limit), cache.run_from(k, start, unit, limit)) for start, unit, limit in runs]
    out += [(("last", k, *scan), cache.last_held(k, *scan)) for scan in scans]
    return out


def _check(asked, loops, value, context):
    """Each answer of :func:`_ask` equals the plain loops' once ``value`` fixes the positions: a window's
    at each of its ends from its first block on (the read side asks for none before)."""
    for query, answer in asked:
        if query[0] == "window":
            _, k, x, (unit, before, after), ends = query
            for end in ends:
                if end >= unit:
                    at = answer if isinstance(answer, bool) else Term(z3.substitute(_zv(answer), (x.z, z3.IntVal(end))))
                    assert value(at) == loops.window(k, end, unit, before, after), (query, end, context)
            continue
        fixed = tuple(q if isinstance(q, str | int) else value(q) for q in query)  # a scan's top, a run's limit
        want = loops.run_from(*fixed[1:]) if fixed[0] == "run" else loops.last_held(*fixed[1:])
        assert value(answer) == want, (fixed, context)


@st.composite
def layered_groups(draw):
    """One spec group of 1-3 hand-made layers sharing kind, block, unit and tail shape (as layers of one
    layout do), with arbitrary extents, ends and points: out-of-order and overlapping tails, absent ones
    (-1), tails cut at an extent, layers that keep every block mixed with ones that keep tails, periodic
    tails. Positions are multiples of the block (of the unit for Mamba states), as the write side makes
    them; full attention's points lie inside a block (partial tails)."""
    kind = draw(st.sampled_from([Kind.SWA, Kind.SWA, Kind.FULL, Kind.MAMBA, Kind.CHUNKED]))
    block = draw(st.sampled_from([4, 8, 16]))
    unit = block if kind in (Kind.SWA, Kind.CHUNKED) else draw(st.sampled_from([block, block // 2]))
    need = draw(st.integers(1, 5))
    shift = draw(st.integers(0, 1))
    period = 0
    if kind is Kind.SWA:
        period = draw(st.sampled_from([0, 0, (need + 1) * block, (need + 3) * block]))
    elif kind is Kind.MAMBA:
        period = draw(st.sampled_from([0, 2 * unit, 3 * unit]))
    span = st.integers(0, 30)
    out = []
    for _ in range(draw(st.integers(1, 3))):
        every = draw(st.sampled_from([False, False, False, True])) if kind in (Kind.SWA, Kind.MAMBA) else True
        ends = points = gaps = ()
        if kind is Kind.SWA:
            ends = tuple(draw(st.lists(st.integers(-1, 34).map(lambda j: -1 if j < 0 else j * block), max_size=4)))
        elif kind is Kind.MAMBA:
            points = tuple(draw(st.lists(span.map(lambda j: j * unit), max_size=3)))
        elif kind is Kind.CHUNKED:  # the blocks its lookup skipped: a gap from block 0, empty or not
            gaps = ((0, draw(st.integers(-1, 30)) * block),)
        else:
            inside = st.builds(lambda j, r: j * block + r, st.integers(0, 29), st.integers(1, block - 1))
            points = tuple(draw(st.lists(inside, max_size=2)))
        scale = unit if kind is Kind.MAMBA else block
        layer_period = draw(st.sampled_from([0, period])) if kind is Kind.SWA else period
        out.append(Held(kind=kind, block=block, unit=unit, extent=draw(span) * scale, every=every, points=points,
                        ends=ends, need=need, shift=shift, period=layer_period, gaps=gaps))
    return tuple(out)


@st.composite
def middle_piece_groups(draw):
    """A sliding-window group of 2-3 layers where a window of ``need`` blocks ``[s, s + need)`` is covered
    only by a chain through middle pieces (uniform draws rarely make one): layer 0 keeps a tail reaching
    into the window and one reaching past it that do not touch; each other layer keeps a tail cut at its
    extent inside the window, the cut tails bridging the two; plus a few tails anywhere (in blocks)."""
    block = draw(st.sampled_from([4, 8, 16]))
    middles = draw(st.integers(1, 2))
    need = draw(st.integers(middles + 2, 6))
    s = draw(st.integers(0, 8))
    e = s + need
    cuts = sorted(draw(st.lists(st.integers(s + 2, e - 1), min_size=middles, max_size=middles, unique=True)))
    first = draw(st.integers(s + 1, cuts[0] - 1))  # layer 0's tail reaching into the window ends here
    lo, previous, layers = s, first, []
    for cut in cuts:  # each cut tail starts inside the window, after the last one, where the chain has got to
        lo = draw(st.integers(lo + 1, min(previous, cut - 1)))
        layers.append((cut, (lo + need,)))
        previous = cut
    last = draw(st.integers(max(first + 1, e - need), cuts[-1])) + need  # layer 0's tail reaching past it
    layers.insert(0, (draw(st.integers(last, last + 6)), (first, last)))
    out = []
    for extent, ends in layers:
        extra = tuple(draw(st.lists(st.integers(-1, e + 8), max_size=2)))
        ends = tuple(draw(st.permutations(ends + extra)))
        out.append(Held(kind=Kind.SWA, block=block, unit=block, extent=extent * block,
                        ends=tuple(-1 if t < 0 else t * block for t in ends), need=need))
    return tuple(draw(st.permutations(out)))


@st.composite
def chunked_chains(draw):
    """A chunked-local group of 2-3 layers whose held ranges chain (each starts inside the one before it
    and reaches past it), in an order the reader must not rely on: a run through them needs a step per
    layer (uniform draws rarely make one)."""
    block = draw(st.sampled_from([4, 8, 16]))
    lo, hi, ranges = 0, draw(st.integers(1, 6)), []
    for _ in range(draw(st.integers(2, 3))):
        ranges.append((lo, hi))
        lo, hi = draw(st.integers(lo, hi)), hi + draw(st.integers(1, 6))
    out = [Held(kind=Kind.CHUNKED, block=block, unit=block, extent=e * block, every=True, gaps=((0, s * block),))
           for s, e in ranges]
    return tuple(draw(st.permutations(out)))


# Which reader the random comparisons use; a one-off run with TwoPieceChains here shows them failing.
READER = SymbolicWrittenCache


@settings(max_examples=250, deadline=None)
@given(group=layered_groups() | middle_piece_groups() | chunked_chains(), data=st.data())
def test_layered_written_cache_matches_plain_loops(group, data):
    """On a hand-made layered group: the read side's two windows and one more of any length, at every end
    up to past the extents; runs; and ``last_held`` scans over those windows (the closed form over the
    scan variable, with a symbolic top)."""
    g = group[0]
    event(f"{g.kind.value}, {len(group)} layer(s)")
    with lowering():
        top = fresh_int("top")
        constraints = [top.z == data.draw(st.integers(0, 40), label="top") * g.unit]
        cache = READER((tuple(_symbolic(h, constraints) for h in group),))
        ends = list(range(g.unit, 36 * g.block, g.unit)) + [g.unit * 5 + 1]
        runs = [(0, g.block, 40)] if g.kind is not Kind.MAMBA else []
        if g.kind in (Kind.FULL, Kind.CHUNKED):
            runs += [(3, g.block, 40), (1, g.block, top // g.block)]
        if g.kind is Kind.CHUNKED:  # a lookup's run starts at its chunk
            runs += [(data.draw(st.integers(0, 32), label="run start"), g.block, top // g.block)]
        windows = _windows(g)
        windows = windows[-2:] + [data.draw(st.sampled_from(windows), label="another window")]
        scans = [(times * unit, data.draw(st.sampled_from([0, 2 * g.block]), label="lo"), top, unit, before, after)
                 for unit, before, after in windows for times in (1, 3)]
        if g.kind is Kind.CHUNKED:
            scans = []  # no lookup scans a chunked-local group (its window's length depends on its end)
        asked = _ask(cache, 0, windows, ends, runs, scans)
        if g.kind is Kind.CHUNKED:  # the reference's window: from the chunk's first block to the end
            chunk = data.draw(st.sampled_from([g.block, 2 * g.block, 4 * g.block]), label="chunk")
            x = fresh_int("x")
            serves = cache.window(0, x, g.block, x % chunk // g.block, 0)
    loops = written_cache((group,))
    _check(asked, loops, _fixed(constraints), group)
    if g.kind is Kind.CHUNKED:
        for end in ends:
            if end % g.block == 0:
                at = Term(z3.substitute(_zv(serves), (x.z, z3.IntVal(end))))
                want = loops.window(0, end, g.block, end % chunk // g.block, 0)
                assert _fixed(constraints)(at) == want, (end, chunk, group)


def _layer_settings():
    """:func:`write_settings` of at most two spec groups (three make vLLM's unrolled loop slow to lower),
    none a sliding window that can lose blocks before caching them; half of them with a sliding window."""
    usable = write_settings().filter(lambda s: len(s[2].groups) <= 2 and not any(
        refimpl.gaps_possible(s[2], k) for k in range(len(s[2].groups))))
    return usable.filter(lambda s: any(g.kind.value == "swa" for g in s[2].groups)) | usable


def _shape(layered):
    """How a layered cache's sliding windows hold blocks, for hypothesis' statistics."""
    shapes = {"every" if h.every else "periodic" if h.period else "tails"
              for group in layered for h in group if h.kind is Kind.SWA}
    return f"{len(layered[0])} layer(s), sliding window: {'+'.join(sorted(shapes)) or 'none'}"


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.filter_too_much])
@given(setting=_layer_settings(), data=st.data())
def test_layered_hits_and_reads_match_plain_loops(setting, data):
    """What 1-3 earlier prompts of different lengths leave (``request_writes``, admitted with a hit and a
    junction or not), each clipped at a shared length (``clip``), layered per spec group: Z3 on symbolic
    prompts, hits, junctions and shared lengths, then fixed, gives the hits of a later prompt under the
    reference and vllm_0_33 rules, and every window, run and ``last_held`` scan the read side makes, as the
    spec's plain loops and refimpl's do. (Layouts whose sliding window can lose blocks before caching them
    are left out: several layers with gaps are refused.)"""
    layout, speculation, sizes, interval = setting
    spec_layout, spec_speculation = to_spec(layout), to_spec(speculation)
    ssizes = spec_derive_sizes(spec_layout, spec_speculation)
    a = ssizes.alignment
    count = data.draw(st.sampled_from([1, 2, 2, 3, 3]), label="layers")
    prompts = [data.draw(st.integers(1, 1200), label="N") for _ in range(count)]
    starts = [data.draw(st.just(0) | st.integers(0, (n - 1) // a).map(lambda j: j * a), label="hit") for n in prompts]
    junctions = [data.draw(st.just(-1) | st.integers(1, n), label="junction") for n in prompts]
    shared = [data.draw(st.integers(0, n + a) | st.just(n), label="shared") for n in prompts]
    later = data.draw(st.integers(1, 1500), label="later prompt")
    for policy in ("reference", "vllm_0_33"):
        rules = SPEC.ALL_POLICIES[policy]
        with lowering():
            n_vars, s_vars = [fresh_int("N") for _ in prompts], [fresh_int("hit") for _ in prompts]
            j_vars, c_vars = [fresh_int("J") for _ in prompts], [fresh_int("shared") for _ in prompts]
            later_var = fresh_int("M")
            writes = [SPEC.request_writes(ssizes, n, interval, rules, h, j) for n, h, j in zip(n_vars, s_vars, j_vars)]
            groups = tuple(tuple(SPEC.clip(ssizes, w[k], c) for w, c in zip(writes, c_vars))
                           for k in range(len(ssizes.groups)))
            cache = SymbolicWrittenCache(groups)
            hit = SPEC.hit_tokens(cache, ssizes, later_var, rules)
            asked = []
            for k, sg in enumerate(ssizes.groups):
                b = sg.block
                if sg.kind is Kind.SWA:
                    need = -(-(sg.window - 1) // b)
                    windows = [(b, need, after) for after in ((0, 1) if sg.drops else (0,))]
                    scans = [(a, need * b - 1, later_var // b * b, *w) for w in windows]
                    runs = [(0, b, later // b)]
                elif sg.kind is Kind.MAMBA:
                    windows = [(a if sg.fine else b, 1, 0)]
                    scans = [(a, 0, later_var // windows[0][0] * windows[0][0], *windows[0])]
                    runs = []
                else:
                    windows = [(a, 1, 0)] if sg.fine else []
                    scans = [(a, b, later_var // a * a, a, 1, 0)] if sg.fine else []
                    runs = [(0, b, later // b)]
                ends = range(windows[0][0], min(later + 1, 40 * b), windows[0][0]) if windows else ()
                asked += _ask(cache, k, windows, ends, runs, scans)
        fixed = [v.z == n for v, n in zip(n_vars + s_vars + j_vars + c_vars, prompts + starts + junctions + shared)]
        value = _fixed(fixed + [later_var.z == later])

        concrete = [SPEC.request_writes(ssizes, *request, interval, rules, h, j)
                    for *request, h, j in zip(prompts, starts, junctions)]
        layered = tuple(tuple(SPEC.clip(ssizes, w[k], c) for w, c in zip(concrete, shared))
                        for k in range(len(ssizes.groups)))
        event(_shape(layered))
        loops = written_cache(layered)
        _check(asked, loops, value, (policy, layered))
        want = SPEC.hit_tokens(loops, ssizes, later, rules)
        rwrites = [refimpl.request_writes(sizes, n, interval, refimpl.ALL_POLICIES[policy], h, j)
                   for n, h, j in zip(prompts, starts, junctions)]
        rlayered = tuple(tuple(refimpl.clip(sizes, w[k], c) for w, c in zip(rwrites, shared))
                         for k in range(len(sizes.groups)))
        assert refimpl.hit_tokens(refimpl.written_cache(rlayered), sizes, later, refimpl.ALL_POLICIES[policy]) == want
        if value(hit[3]):  # vLLM's loop converged within the unrolled passes
            assert tuple(value(v) for v in hit[:3]) == want[:3], (policy, layered)


def _three_pieces(constraints):
    """Two layers of a sliding window of 4-block tails (blocks of 16): layer A keeps the tail ending at
    block 10 but its prompt was shared only up to block 8, so it holds blocks 6-7; layer B holds blocks
    3-6 and 8-11. The window of blocks 5-8 (ending at token 144) is covered only by B's first tail, A's cut
    tail and B's second: three pieces."""
    b = 16
    layer_a = Held(kind=Kind.SWA, block=b, unit=b, extent=8 * b, ends=(10 * b,), need=4)
    layer_b = Held(kind=Kind.SWA, block=b, unit=b, extent=20 * b, ends=(12 * b, 7 * b), need=4)
    return ((layer_a, layer_b),), ((_symbolic(layer_a, constraints), _symbolic(layer_b, constraints)),)


def test_a_window_needs_a_middle_piece_that_two_piece_chains_miss():
    """The window ending at 144 and the scan down from 144: the loops and the exact reading find 144;
    chains of two pieces miss it and scan down to 128 (blocks 4-7: B's first tail and A's cut one)."""
    with lowering():
        top = fresh_int("top")
        constraints = [top.z == 144]
        concrete, symbolic = _three_pieces(constraints)
        right, wrong = SymbolicWrittenCache(symbolic), TwoPieceChains(symbolic)
        window = {"unit": 16, "before": 4, "after": 0}
        answers = [(c.window(0, 144, **window), c.last_held(0, step=16, lo=0, hi=top, **window))
                   for c in (right, wrong)]
    value = _fixed(constraints)
    loops = written_cache(concrete)
    assert (loops.window(0, 144, **window), loops.last_held(0, step=16, lo=0, hi=144, **window)) == (True, 144)
    assert [(value(w), value(last)) for w, last in answers] == [(True, 144), (False, 128)]


def test_layered_sliding_windows_refuse_gaps_and_unlike_periodic_tails():
    b = 16
    plain = Held(kind=Kind.SWA, block=b, unit=b, extent=20 * b, ends=(12 * b,), need=4)
    with lowering():
        gapped = replace(plain, gaps=((fresh_int("lo"), fresh_int("hi")),))
        cases = {"gaps": (gapped, plain),
                 "different periods": (replace(plain, period=6 * b), replace(plain, period=7 * b)),
                 "tails that touch": (replace(plain, period=4 * b), plain)}
        for words, group in cases.items():
            with pytest.raises(SpecError, match=words):
                SymbolicWrittenCache((group,)).window(0, fresh_int("x"), b, 4, 0)
        SymbolicWrittenCache((gapped,)).window(0, fresh_int("x"), b, 4, 0)  # one layer: today's reading
