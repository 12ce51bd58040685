"""A written cache state that answers the refimpl's cache queries without walking every block: a tested
optimisation of the spec's definition, not a second one.

What a written cache holds is defined once, in ``spec/cache.py``: :func:`kvhit.spec.cache.holds` (with
:func:`~kvhit.spec.cache.holds_block` for a sliding window) says whether a group holds a boundary, and
:func:`kvhit.spec.cache.written_cache` reads a cache through it, one boundary at a time (generated as
``refimpl.holds`` and ``refimpl.written_cache``). That costs a call per block: a full-attention group of
64-token blocks holding a 30,000-token prompt costs 470 calls per ``run_from``, and the plan asks that for
every request, setting and policy. :class:`WrittenCache` is the same state (spec group ``k`` holds what the
:class:`refimpl.Held` ``groups[k]`` says; one layer per group) and finds the first boundary a query misses
by jumping over the stretches a ``Held`` says are held whole: every block up to the extent (full
attention, chunked local past its gaps, a Mamba group that keeps every state, a sliding window that keeps every block), a
sliding-window tail, a periodic tail; ``last_held`` takes the highest of a group's points and of its
lattice (the boundaries it holds up to its extent). Where it jumps it relies on ``holds``'s conditions
for that stretch (each place says which); everything else (single points, partial tails, states between
periods, a sliding window with gaps) it asks ``refimpl.holds`` about one boundary at a time. It reports the
same ``max_query`` as the refimpl's loops (the highest boundary they would have asked about), so ``reach``
accounting is unchanged. It is a cache state, not policy: the hit is still computed by the refimpl's own
functions.

``tests/tools/test_written_cache.py`` checks it against ``refimpl.written_cache`` query by query (on
random ``Held`` descriptions, gaps included, wider than the write side produces) and hit by hit, and shows
that comparison failing on a reader one block off at the extent.
"""

import math

from kvhit import refimpl
from kvhit.refimpl import CacheState, Kind, holds


def _by_tails(g, unit):
    """Whether a group read at ``unit`` is a sliding window read block by block without gaps (none of
    ``g.gaps`` is non-empty): then its held blocks are decided once per tail."""
    return g.kind is Kind.SWA and unit == g.block and not any(lo < hi for lo, hi in g.gaps)


class WrittenCache(CacheState):
    """Spec group ``k`` holds what ``groups[k]`` (a ``refimpl.Held``) says."""

    def __init__(self, groups):
        self.groups = tuple(groups)
        held = self.groups
        super().__init__(lambda k, x: holds(held[k], x))

    def _seen(self, x):
        if x > self.max_query:
            self.max_query = x

    def _first_miss(self, k, unit, j):
        """The first block index ``i >= j`` whose boundary ``(i + 1) * unit`` group ``k`` does not hold."""
        g = self.groups[k]
        if _by_tails(g, unit):
            return self._tails_first_miss(g, j)
        if not holds(g, (j + 1) * unit):
            return j
        if g.kind is Kind.SWA:
            # gaps (blocks lost before caching, refimpl.sliding_window_gaps) break the tails, and so does a
            # unit other than the block: ask each block
            whole = False
        elif g.kind is Kind.MAMBA:
            whole = unit % g.unit == 0 and (g.every or (g.period > 0 and unit % g.period == 0))
        elif g.kind is Kind.CHUNKED:
            # refimpl.holds_block: every block inside the extent but those in a gap (the write side's one
            # gap, the blocks its lookup skipped, ends below a held block)
            whole = g.every and unit % g.block == 0 and all(lo >= hi or hi <= j * unit for lo, hi in g.gaps)
        else:
            whole = unit % g.block == 0
        last = g.extent // unit  # boundaries (i + 1) * unit <= extent have i < last
        while holds(g, (j + 1) * unit):
            if whole and j < last:
                # every boundary up to the extent is held (points past it are asked one by one)
                j = last
            else:
                j += 1
        return j

    @staticmethod
    def _tails_first_miss(g, j):
        """``_first_miss`` of a sliding window read block by block, without gaps: ``refimpl.holds_block``'s
        conditions (inside the extent; every block, or a periodic or explicit tail covering it) decided
        once per tail rather than once per block."""
        last = g.extent // g.block  # blocks i < last end inside the extent
        if g.every:
            return max(j, last)
        per = g.period // g.block
        reach = g.need * g.block
        while j < last:
            end = 0  # one past the last block of the longest tail covering block j
            if per > 0 and j >= g.shift and (j - g.shift) % per >= per - g.need:
                end = j + per - (j - g.shift) % per
            for e in g.ends:
                if e - reach <= j * g.block < e:
                    end = max(end, -(-e // g.block))
            if end <= j:
                return j
            j = min(end, last)
        return j

    def window(self, k, x, unit, before, after):
        lo, hi = max(0, x // unit - before), x // unit + after
        if lo >= hi:
            return True
        if hi - lo == 1:  # one boundary: the lookups' single-state and partial-block checks
            self._seen(hi * unit)
            return holds(self.groups[k], hi * unit)
        miss = self._first_miss(k, unit, lo)
        if miss >= hi:
            self._seen(hi * unit)
            return True
        self._seen((miss + 1) * unit)
        return False

    def last_held(self, k, step, lo, hi, unit, before, after):
        """``CacheState.last_held`` without asking every candidate.

        A single boundary of a group of single boundaries (full attention, Mamba) read at a
        unit that divides the step: a candidate ``x`` is itself the boundary asked about, so the answer is
        the highest of the held points and of the highest multiple of the step on the group's lattice (the
        boundaries it holds up to its extent) inside ``(lo, hi]``. Otherwise the scan, except that a
        window missing block ``m`` skips every lower candidate whose window also contains ``m`` and, on a
        sliding window without gaps, every one whose window ends on a block it does not keep.
        """
        g = self.groups[k]
        top = hi // step * step
        if top <= lo or top <= 0:
            return 0  # the scan asks nothing
        if before == 1 and after == 0 and g.kind in (Kind.FULL, Kind.MAMBA) and step % unit == 0:
            self._seen(top)  # the scan's first question
            best = 0
            for p in g.points:
                if lo < p <= top and p > best and p % step == 0:
                    best = p
            if g.kind is Kind.MAMBA:
                lattice = g.unit if g.every else (g.unit * g.period // math.gcd(g.unit, g.period)
                                                  if g.period > 0 else 0)
            else:
                lattice = g.block
            if lattice:
                lattice = lattice * step // math.gcd(lattice, step)
                y = min(top, g.extent) // lattice * lattice
                if y > lo and y > best:
                    best = y
            return best
        tails = _by_tails(g, unit)
        x = top
        while x > 0 and x > lo:
            first, end = max(0, x // unit - before), x // unit + after
            if first >= end:
                return x  # an empty window is held
            miss = self._first_miss(k, unit, first)
            if miss >= end:
                self._seen(end * unit)
                return x
            self._seen((miss + 1) * unit)
            # every candidate x' with x' // unit > miss - after has block `miss` in its window
            q = miss - after
            if tails:
                # and the last block of a held window, x' // unit + after - 1, is held
                q = min(q, self._last_held_block(g, miss - 1) - after + 1)
            x = min(x - step, ((q + 1) * unit - 1) // step * step)
        return 0

    @staticmethod
    def _last_held_block(g, j):
        """The highest block ``i <= j`` of a sliding window without gaps that ``refimpl.holds_block`` says is
        kept (inside the extent; every block, or a periodic or explicit tail covering it), or -1."""
        j = min(j, g.extent // g.block - 1)
        if j < 0 or g.every:
            return j
        best = -1
        per = g.period // g.block
        if per > 0 and j >= g.shift:
            r = (j - g.shift) % per
            if r >= per - g.need:
                return j
            if g.need >= 1 and j - r - 1 >= g.shift:
                best = j - r - 1  # the last block of the period before
        for e in g.ends:
            first = -(-(e - g.need * g.block) // g.block)  # tail blocks i: e - need * block <= i * block < e
            last = -(-e // g.block) - 1
            if first <= j and first <= last:
                best = max(best, min(j, last))
        return best

    def run_from(self, k, start, unit, limit):
        if start >= limit:
            return 0
        miss = self._first_miss(k, unit, start)
        if miss < limit:
            self._seen((miss + 1) * unit)
            return miss - start
        self._seen(limit * unit)
        return limit - start


def replay_boundaries(sizes, n_tokens, rules):
    """``refimpl.replay_boundaries``, the reference policy's resume points (hits on the caches the request
    would leave if every state were retained: ``refimpl.resume_points``) read through :class:`WrittenCache`."""
    return refimpl.replay_boundaries(sizes, n_tokens, rules, WrittenCache)


def first_writes(sizes, n_tokens, interval, rules, boundaries=None):
    """``refimpl.request_writes(sizes, N, interval, rules)``: what a first request on an empty cache
    leaves, given its replay boundaries (:func:`replay_boundaries`, which do not depend on the retention
    interval, so a caller trying several intervals computes them once)."""
    if boundaries is None:
        boundaries = replay_boundaries(sizes, n_tokens, rules)
    return refimpl.request_writes(sizes, n_tokens, interval, rules, boundaries=boundaries)
