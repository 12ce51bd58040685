"""The cache state a lookup reads, as an oracle over token boundaries.

A spec group ``k`` "has" boundary ``x`` when the block hash ending at token ``x`` is cached for every
KV-cache group of the spec group (vLLM: ``BlockPool.get_cached_block``). A block of ``u`` tokens with index
``j`` is cached when boundary ``(j + 1) * u`` is. A lookup asks two queries, ``window`` and ``run_from``,
and a scan over the first, ``last_held`` (:func:`scan_last_held`, its one definition). The Z3 lowering gives
the two queries a symbolic meaning (:class:`kvhit.spec.lower_z3.SymbolicCache`) and lowers the scan; here they
are plain loops over the oracle.

The write side describes what a request leaves behind as one :class:`Held` per spec group; the same
description is read here by plain loops (:func:`written_cache`) and in Z3 by a decision procedure over
its tails and points (:class:`kvhit.spec.lower_z3.SymbolicWrittenCache`). What several requests leave is
*layered*: per spec group a tuple of :class:`Held` layers, of which the cache holds the union
(:func:`layers`).
"""

from dataclasses import dataclass

from .domain import Kind
from .terms import active, and_, max_, max_aligned


class CacheState:
    """Which boundaries each spec group can serve.

    Args:
        has: ``has(k, x)`` is True when spec group ``k`` holds the hash of the block ending at token ``x``.
    """

    def __init__(self, has):
        self.has = has
        self.max_query = 0

    def _has(self, k, x):
        if x > self.max_query:
            self.max_query = x
        return self.has(k, x)

    def window(self, k, x, unit, before, after):
        """Whether blocks ``[max(0, x // unit - before), x // unit + after)`` of ``unit`` tokens are all
        cached in spec group ``k``: the context a window ending at ``x`` needs, plus ``after`` blocks past
        it (the EAGLE peek)."""
        i = x // unit
        for j in range(max(0, i - before), i + after):
            if not self._has(k, (j + 1) * unit):
                return False
        return True

    def run_from(self, k, start, unit, limit):
        """How many consecutive ``unit`` blocks from block ``start`` are cached, stopping at block
        ``limit``."""
        n = 0
        while start + n < limit and self._has(k, (start + n + 1) * unit):
            n += 1
        return n

    def last_held(self, k, step, lo, hi, unit, before, after):
        """The largest multiple ``x`` of ``step`` with ``lo < x <= hi`` whose window is cached in spec group
        ``k`` (``window(k, x, unit, before, after)``), or 0: the downward scan a lookup makes for a single
        cached state, a partial block or a sliding window's context (:func:`scan_last_held`)."""
        return scan_last_held(self, k, step, lo, hi, unit, before, after)

    @classmethod
    def from_sets(cls, boundaries):
        """A cache from one set of cached boundaries per spec group."""
        sets = [frozenset(s) for s in boundaries]
        return cls(lambda k, x: x in sets[k])

    @classmethod
    def up_to(cls, extents):
        """A dense cache: spec group ``k`` holds every boundary up to ``extents[k]`` tokens."""
        ext = list(extents)
        return cls(lambda k, x: 0 < x <= ext[k])


def scan_last_held(cache, k, step, lo, hi, unit, before, after):
    """What ``last_held`` means, for every cache state: scan the multiples of ``step`` down from ``hi`` for
    the first above ``lo`` whose window is cached. The Z3 caches lower this scan; a cache state that knows
    its own structure may answer ``last_held`` without it, with the same result and the same ``max_query``
    (the scan asks its highest candidate first)."""
    return max_aligned(step, hi, lambda x: and_(x > lo, cache.window(k, x, unit, before, after)))


@dataclass(frozen=True, kw_only=True)
class Held:
    """What one spec group holds of a prompt after the write side has run: positions in tokens. Built with
    keywords only (eleven fields, most of them integers).

    Attributes:
        kind, block: the spec group's kind and effective block.
        unit: the unit its single boundaries are read at (the alignment when it is looked up at hash
            granularity, else its block).
        extent: no block ends past it (the cacheable, prompt-only prefix).
        every: every boundary up to ``extent`` is held (full attention always; a sliding window whose
            mask keeps every block; every Mamba state).
        points: single held boundaries (full attention's partial tail; Mamba states).
        ends: sliding window: positions where an explicitly kept tail of ``need`` blocks ends.
        need: sliding window: blocks per kept tail.
        shift: sliding window: blocks a tail reaches past its boundary (1 when the group drops).
        period: tokens between periodic tails (sliding window) or states (Mamba); 0 for none. Periodic
            sliding-window tails end at ``shift * block + m * period`` for ``m >= 1``.
        gaps: sliding window, chunked local: ``(lo, hi)`` token ranges (multiples of the block; empty
            when ``lo >= hi``) whose blocks are not held whatever the rest says: blocks freed before any
            caching call covered them (sliding window), or never computed (chunked local: ``(0, hi)``).
    """

    kind: Kind
    block: int
    unit: int
    extent: object = 0
    every: bool = False
    points: tuple = ()
    ends: tuple = ()
    need: int = 0
    shift: int = 0
    period: int = 0
    gaps: tuple = ()


def live_gaps(gaps):
    """``gaps`` without the ones known to be empty before any prompt is chosen (concrete ``lo >= hi``)."""
    return tuple((lo, hi) for lo, hi in gaps if not (isinstance(lo, int) and isinstance(hi, int) and lo >= hi))


def held_from(g: Held):
    """Where a chunked-local group's held blocks start, in tokens: the end of its gaps, each of which starts at
    block 0 (the blocks its request's lookup counted as computed without reading them)."""
    start = 0
    for _, hi in live_gaps(g.gaps):
        start = max_(start, hi)
    return start


def holds_block(g: Held, j):
    """Whether block ``j`` (of ``g.block`` tokens) of a sliding-window or chunked-local group is kept
    (Python only)."""
    if (j + 1) * g.block > g.extent:
        return False
    for lo, hi in g.gaps:
        if lo <= j * g.block < hi:
            return False
    if g.every:
        return True
    per = g.period // g.block
    if per > 0 and j >= g.shift and (j - g.shift) % per >= per - g.need:
        return True
    for end in g.ends:
        if end - g.need * g.block <= j * g.block < end:
            return True
    return False


def holds(g: Held, x):
    """Whether a group holds the hash of the block ending at token ``x`` (Python only)."""
    if x <= 0:
        return False
    if g.kind in (Kind.SWA, Kind.CHUNKED):
        return x % g.block == 0 and holds_block(g, x // g.block - 1)
    if x in g.points:
        return True
    if x > g.extent:
        return False
    if g.kind is Kind.MAMBA:
        return x % g.unit == 0 and (g.every or (g.period > 0 and x % g.period == 0))
    return x % g.block == 0


def layers(group):
    """The layers of a written spec group: a :class:`Held` is one layer, a tuple of them is several (what
    several earlier prompts left, each clipped to what a later prompt shares with it)."""
    if isinstance(group, Held):
        return (group,)
    return tuple(group)


def holds_some(held, x):
    """Whether some layer in ``held`` holds the hash of the block ending at token ``x`` (Python only; a
    loop, which a single layer reads as fast as :func:`holds` alone)."""
    for g in held:
        if holds(g, x):
            return True
    return False


def written(groups):
    """The cache state the :class:`Held` descriptions say, for the read side to consume: plain loops in
    Python (:func:`written_cache`), a decision procedure over tails and points under a lowering that has
    one (its :meth:`kvhit.spec.terms.Lowering.written`, the Z3 one). A spec group given as a tuple of
    :class:`Held` layers (what several earlier prompts left) holds their union in both (:func:`layers`).
    An operator: the generated code calls :func:`written_cache` in its place."""
    lowering = active()
    cache = None if lowering is None else lowering.written(tuple(groups))
    return written_cache(groups) if cache is None else cache


def written_cache(groups):
    """A cache whose group ``k`` holds what ``groups[k]`` says: a :class:`Held`, or a tuple of
    :class:`Held` layers, of which it holds the union (a boundary is held when some layer holds it)."""
    held = tuple(layers(g) for g in groups)
    return CacheState(lambda k, x: holds_some(held[k], x))
