"""The Z3 lowering: run the spec's functions on symbolic request state.

Layouts stay concrete; the prompt length and the cache are symbolic. The cache of each spec group, at
each block unit the spec reads it at, is a list of ``runs`` maximal runs of cached blocks
``[start_j, end_j)`` with symbolic, unbounded ends (:class:`SymbolicCache`). Every query the spec makes
(``window``, ``run_from``) is then linear arithmetic over those ends, and ``max_aligned``'s predicate
becomes a finite union of intervals of the scan variable, so its maximum has a closed form: no
quantifiers, no uninterpreted functions.

Why a few runs suffice (the small-model argument, stated in the README): whether a group serves a
boundary is monotone in the set of cached blocks, and a check reads the cache at finitely many places
(each lookup's result and each witness). Dropping every cached block that no such place uses keeps every
lookup's result and every verdict; what remains is one run per place. So a counterexample exists iff one
exists with at most that many runs per group and unit, and the checks allocate that many
(:func:`kvhit.proofs.model.runs_needed`).
"""

from __future__ import annotations

import itertools
import math
from contextlib import contextmanager
from dataclasses import dataclass

from .cache import held_from, layers, live_gaps, scan_last_held
from .domain import Kind
from . import runtime
from .terms import (Lowering, SpecError, Term, _zv, and_, build, cdiv, eq, floor_to, installed, is_symbolic, ite,
                    max_, min_, or_)


def _z3():
    import z3

    return z3


_fresh = itertools.count()


def fresh_int(prefix: str) -> Term:
    return Term(_z3().Int(f"{prefix}!{next(_fresh)}"))


class Z3Lowering(Lowering):
    """The operators of :mod:`kvhit.spec.terms` while the spec runs on :class:`Term` values (which the
    operators lower themselves): ``max_aligned`` up to a symbolic bound in closed form
    (:func:`symbolic_max_aligned`), a written cache as the decision procedure over its descriptions
    (:class:`SymbolicWrittenCache`), and a fixed-point loop as ``bound`` unrolled passes."""

    def max_aligned(self, step: int, hi, pred):
        if is_symbolic(hi):
            return symbolic_max_aligned(step, hi, pred)
        return runtime.max_aligned(step, hi, pred)

    def passes(self, bound: int):
        return range(bound)

    def written(self, groups: tuple):
        return SymbolicWrittenCache(groups)


class ContractLowering(Z3Lowering):
    """The Z3 lowering with each ``max_aligned`` up to a symbolic bound replaced by its contract: a fresh
    multiple ``r`` of the step that is 0 or a point in range where the predicate holds, and no higher point
    in range the predicate holds at, stated at the points a check names (:meth:`facts`). Every fact is true
    of ``max_aligned``'s value on every input, so an assignment that satisfies the exact lowering's formulas
    satisfies these with ``r`` its value: a claim this lowering proves, the exact one proves. The converse
    fails where maximality is needed at a point that is not named, and the caller then decides with the
    exact lowering (README, "Contracts")."""

    def __init__(self):
        self.scans: list[tuple[int, object, object, Term]] = []

    def max_aligned(self, step: int, hi, pred):
        if not is_symbolic(hi):
            return runtime.max_aligned(step, hi, pred)
        r = Term(_z3().Int(f"scan!{next(_fresh)}"), step)  # a multiple of step by its scale
        self.scans.append((step, hi, pred, r))
        return r

    def facts(self, probes=()) -> list:
        """The contract of every scan so far: for each point ``t`` (each other scan's result, and the
        symbolic integers of ``probes``), ``t`` is no higher point in range the predicate holds at; then
        ``r >= 0``, and ``r == 0`` or ``step <= r <= hi`` with the predicate at ``r``. Evaluating a predicate
        may scan again: those scans get the second part too."""
        out = []
        points = [r for _, _, _, r in self.scans] + [t for t in probes if _is_int(t)]
        for step, hi, pred, r in list(self.scans):
            for t in points:
                if t is r:
                    continue
                inside = build().and_(_zv(eq(t % step, 0)), _zv(t >= step), _zv(t <= hi), _zv(t > r))
                out.append(build().implies(inside, build().not_(_zv(pred(t)))))
        done = 0
        while done < len(self.scans):
            step, hi, pred, r = self.scans[done]
            done += 1
            out += [build().cmp("ge", r.e, 0), build().or_(build().cmp("eq", r.z, 0),
                                                           build().and_(_zv(r >= step), _zv(r <= hi), _zv(pred(r))))]
        return out


def _is_int(t) -> bool:
    """Whether ``t`` is a symbolic integer (a probe a scan's maximality can be stated at)."""
    return isinstance(t, Term) and _z3().is_int(t.e)


@contextmanager
def lowering():
    """Run the spec's operators under the Z3 lowering (:class:`Z3Lowering`) until the block ends."""
    with installed(Z3Lowering()):
        yield


# ----------------------------------------------------------------------------------------------------
# The scan variable of max_aligned and the predicate sets it lowers to
# ----------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ScanVar:
    """``x + offset`` where ``x`` ranges over positive multiples of ``step`` up to ``top``."""

    step: int
    top: object
    offset: int = 0

    def __add__(self, o):
        if not isinstance(o, int) or isinstance(o, bool):
            raise SpecError("the scan variable may only be offset by a concrete integer")
        return ScanVar(self.step, self.top, self.offset + o)

    def __radd__(self, o):
        return self.__add__(o)

    def __sub__(self, o):
        return self.__add__(-o)

    def __kvhit_compare__(self, a, b, op):
        if isinstance(a, ScanVar) and isinstance(b, ScanVar):
            raise SpecError("comparing the scan variable with itself is not supported")
        if isinstance(b, ScanVar):  # t op (x + o)  ==  (x + o) flipped-op t
            a, b = b, a
            op = {"lt": "gt", "le": "ge", "gt": "lt", "ge": "le"}[op]
        t = b - a.offset  # x op t
        if op == "le":
            return IntervalSet.of(0, t, a.top)
        if op == "lt":
            return IntervalSet.of(0, t - 1, a.top)
        if op == "ge":
            return IntervalSet.of(t, a.top, a.top)
        if op == "gt":
            return IntervalSet.of(t + 1, a.top, a.top)
        raise SpecError(f"unsupported comparison {op} of the scan variable")

    __lt__ = lambda self, o: self.__kvhit_compare__(self, o, "lt")  # noqa: E731
    __le__ = lambda self, o: self.__kvhit_compare__(self, o, "le")  # noqa: E731
    __gt__ = lambda self, o: self.__kvhit_compare__(self, o, "gt")  # noqa: E731
    __ge__ = lambda self, o: self.__kvhit_compare__(self, o, "ge")  # noqa: E731

    def __bool__(self):
        raise SpecError("the scan variable of max_aligned used in a Python branch")

    def __floordiv__(self, o):
        raise SpecError("integer division of the scan variable is not supported by the Z3 lowering")

    __mod__ = __floordiv__


class IntervalSet:
    """A predicate of the scan variable: an and/or tree over closed intervals of ``x``, each ``(lo, hi)`` or
    periodic ``(lo, hi, period, phase)`` (``x`` also ``phase`` modulo ``period``), and guards that do not
    depend on ``x`` (``("guard", condition)``). No negation: the spec raises on one, so the predicate is
    monotone in each interval, which :func:`symbolic_max_aligned` relies on.

    Attributes:
        op: ``"or"`` or ``"and"`` of ``parts``.
        parts: intervals, guards and sub-trees.
        top: the scan's bound.
    """

    def __init__(self, intervals, top, op="or"):
        self.parts = list(intervals)
        self.top = top
        self.op = op

    @classmethod
    def of(cls, lo, hi, top):
        return cls([(lo, hi)], top)

    @classmethod
    def everything(cls, top, when=True):
        return cls([(0, top)] if when is True else [("guard", when), (0, top)], top, "and")

    def __bool__(self):
        raise SpecError("a predicate of the scan variable used in a Python branch")

    @staticmethod
    def __kvhit_set__(op, a, b):
        top = a.top if isinstance(a, IntervalSet) else b.top
        parts = []
        for side in (a, b):
            if not isinstance(side, IntervalSet):
                parts.append(("guard", side))
            elif side.op == op or len(side.parts) == 1:
                parts += side.parts
            else:
                parts.append(side)
        return IntervalSet(parts, top, op)

    def leaves(self):
        """Every interval of the tree (guards left out)."""
        for part in self.parts:
            if isinstance(part, IntervalSet):
                yield from part.leaves()
            elif part[0] != "guard":
                yield part

    def dnf_size(self) -> int:
        """How many intervals :meth:`dnf` makes (before dropping inconsistent congruences)."""
        sizes = [part.dnf_size() if isinstance(part, IntervalSet) else 1 for part in self.parts]
        return sum(sizes) if self.op == "or" else math.prod(sizes)

    def dnf(self) -> list:
        """The predicate as a union of intervals: a conjunction of intervals is their intersection (the
        congruences combined), of a guard the interval up to the top or, when the guard fails, none."""
        lists = []
        for part in self.parts:
            if isinstance(part, IntervalSet):
                lists.append(part.dnf())
            elif part[0] == "guard":
                lists.append([(0, _if(part[1], self.top, -1))])
            else:
                lists.append([part])
        if self.op == "or":
            return [iv for ivs in lists for iv in ivs]
        out = lists[0]
        for ivs in lists[1:]:
            joined = []
            for i1, i2 in itertools.product(out, ivs):
                p1, r1 = (i1[2], i1[3]) if len(i1) == 4 else (1, 0)
                p2, r2 = (i2[2], i2[3]) if len(i2) == 4 else (1, 0)
                both = _crt(p1, r1, p2, r2)
                if both is not None:
                    joined.append((max_(i1[0], i2[0]), min_(i1[1], i2[1])) + both)
            out = joined
        return out

    def contains(self, c):
        """Whether the point ``c`` (a multiple of the scan's step) satisfies the predicate."""
        conds = []
        for part in self.parts:
            if isinstance(part, IntervalSet):
                conds.append(part.contains(c))
            elif part[0] == "guard":
                conds.append(_zv(part[1]))
            else:
                inside = [_zv(c >= part[0]), _zv(c <= part[1])]
                if len(part) == 4:
                    inside.append(_zv(eq((c - part[3]) % part[2], 0)))
                conds.append(build().and_(*inside))
        return (build().or_ if self.op == "or" else build().and_)(*conds)


def _if(c, a, b):
    if c is True:
        return a
    if c is False:
        return b
    return ite(Term(_zv(c)), a, b)


def _lattice(step: int, interval):
    """An interval's points as ``(lo, hi, period, phase)``: multiples of ``step`` in ``[lo, hi]`` that are
    ``phase`` modulo ``period``, or None when none can be (the two congruences disagree)."""
    if len(interval) == 2:
        return interval[0], interval[1], step, 0
    lo, hi, period, phase = interval
    combined = _crt(step, 0, period, phase)
    if combined is None:
        return None
    return (lo, hi) + combined


def _crt(m1: int, r1: int, m2: int, r2: int):
    """``(m, r)`` with ``x = r (mod m)`` iff ``x = r1 (mod m1)`` and ``x = r2 (mod m2)``, or None."""
    g = math.gcd(m1, m2)
    if (r2 - r1) % g:
        return None
    m = m1 // g * m2
    for r in range(r1 % m1, m, m1):
        if r % m2 == r2 % m2:
            return m, r
    return None  # pragma: no cover - unreachable when the gcd test passed


# A predicate whose union of intervals (:meth:`IntervalSet.dnf`) would have more intervals than this many times
# the intervals it is built of is lowered by its candidates instead (:func:`symbolic_max_aligned`), unless it
# has more than MAX_CONGRUENCES congruences (its lattices are the subsets of them: 2 ** n). On the default
# run both forms give every verdict alike; the candidates take DeepSeek-V4's longest-hit check from over
# 120 s to 3 s.
DNF_GROWTH = 1
MAX_CONGRUENCES = 3


def symbolic_max_aligned(step: int, hi, pred):
    """``max_aligned`` in closed form over the intervals its predicate lowers to.

    Two forms, equal on every input (``tests/unit/test_lower_z3.py``):

    * over the union of intervals (:meth:`IntervalSet.dnf`): the top aligned point of each interval that
      has one, the largest of them. A conjunction of groups' predicates multiplies their intervals, so on a
      layout of ``g`` groups of ``r`` intervals each this is ``r ** g`` intervals.
    * over candidates: the largest ``c`` with ``step <= c`` and the predicate true at ``c`` among the
      floors of ``min(hi, u)``, for ``u`` each interval's upper end and ``hi`` itself, to each lattice the
      step and a set of the tree's congruences make. That is the maximum: it lies in the intersection of
      some intervals, one conjunct of the union, whose points on that conjunct's lattice up to the least of
      its upper ends (and ``hi``) are all in it (the tree has no negation), so the floor of that least end
      to that lattice is in it, is a candidate, and is no lower than the maximum. About
      ``(g * r) ** 2`` terms instead of ``r ** g``.
    """
    x = ScanVar(step, hi)
    sat = pred(x)
    if not isinstance(sat, IntervalSet):
        sat = IntervalSet.everything(hi, sat)
    leaves = list(sat.leaves())
    congruences = sorted({(iv[2], iv[3]) for iv in leaves if len(iv) == 4})
    if sat.dnf_size() <= DNF_GROWTH * max(1, len(leaves)) or len(congruences) > MAX_CONGRUENCES:
        return _max_over_union(step, hi, sat.dnf())
    return _max_over_candidates(step, hi, sat, leaves, congruences)


def _max_over_candidates(step: int, hi, sat: IntervalSet, leaves, congruences):
    """The largest candidate of :func:`symbolic_max_aligned`'s second form that satisfies ``sat``, or 0."""
    lattices = set()
    for size in range(len(congruences) + 1):
        for subset in itertools.combinations(congruences, size):
            lattice = (step, 0)
            for period, phase in subset:
                lattice = lattice and _crt(lattice[0], lattice[1], period, phase)
            if lattice is not None:
                lattices.add(lattice)
    ends = [hi]
    for iv in leaves:
        if not any(_same(iv[1], e) for e in ends):
            ends.append(iv[1])
    best = 0
    for end in ends:
        u = min_(hi, end)
        for period, phase in sorted(lattices):
            c = (u - phase) // period * period + phase
            ok = Term(_z3().And(_zv(c >= step), sat.contains(c)))
            best = _if(ok, max_(best, c), best)
    return best


def _same(a, b) -> bool:
    """Whether two bounds are the same term (or the same integer)."""
    if isinstance(a, Term) and isinstance(b, Term):
        return a.z.eq(b.z)
    return not isinstance(a, Term) and not isinstance(b, Term) and a == b


def _max_over_union(step: int, hi, intervals):
    """The largest positive multiple of ``step`` up to ``hi`` in one of ``intervals``, or 0."""
    best = 0
    for interval in intervals:
        lattice = _lattice(step, interval)
        if lattice is None:
            continue
        lo, top, period, phase = lattice
        t = (min_(hi, top) - phase) // period * period + phase
        ok = Term(_z3().And(_zv(t >= lo), _zv(t >= step)))
        best = _if(ok, max_(best, t), best)
    return best


# ----------------------------------------------------------------------------------------------------
# The symbolic cache
# ----------------------------------------------------------------------------------------------------


class SymbolicCache:
    """Every cache state, as runs of cached blocks per spec group and block unit.

    Args:
        runs: how many maximal runs each (group, unit) gets (see the module docstring).
        name: a prefix for the Z3 variables, so two caches in one query stay distinct.
    """

    def __init__(self, runs: int, name: str = "cache"):
        self.runs = runs
        self.name = name
        self.lists: dict[tuple[int, int], list[tuple[Term, Term]]] = {}

    def _runs(self, k: int, unit: int):
        key = (k, unit)
        if key not in self.lists:
            self.lists[key] = [(fresh_int(f"{self.name}.g{k}.u{unit}.s{j}"),
                                fresh_int(f"{self.name}.g{k}.u{unit}.e{j}")) for j in range(self.runs)]
        return self.lists[key]

    def well_formed(self):
        """Runs are ordered and separated by at least one uncached block: ``0 <= s1 <= e1 < s2 <= ...``."""
        z3 = _z3()
        out = []
        for runs in self.lists.values():
            previous_end = None
            for s, e in runs:
                out.append(s.z >= 0 if previous_end is None else s.z > previous_end.z)
                out.append(e.z >= s.z)
                previous_end = e
        return z3.And(out) if out else z3.BoolVal(True)

    def blocks(self):
        """How many blocks the runs cache, over every group and unit (what a smallest counterexample's cache
        minimises); 0 when no lookup has read the cache."""
        z3 = _z3()
        return z3.Sum([e.z - s.z for runs in self.lists.values() for s, e in runs] or [z3.IntVal(0)])

    def dense_up_to(self, extent):
        """Every group holds every block up to ``extent`` tokens (at least)."""
        z3 = _z3()
        out = []
        for (_, unit), runs in self.lists.items():
            s, e = runs[0]
            out += [s.z == 0, e.z * unit >= _zv(extent)]
        return z3.And(out) if out else z3.BoolVal(True)

    def window(self, k, x, unit, before, after):
        """Blocks ``[max(0, x // unit - before), x // unit + after)`` are cached (see
        :meth:`kvhit.spec.cache.CacheState.window`)."""
        if isinstance(x, ScanVar):
            if x.step % unit or x.offset % unit:
                raise SpecError(f"window of unit {unit} over a scan of step {x.step} offset {x.offset}")
            if is_symbolic(before):
                raise SpecError("a symbolic window length over the scan variable is not supported")
            if before == 0 and after == 0:
                return IntervalSet.everything(x.top)
            intervals = []
            for s, e in self._runs(k, unit):
                lo = _if(s.z == 0, 0, (s + before) * unit - x.offset)
                intervals.append((lo, (e - after) * unit - x.offset))
            return IntervalSet(intervals, x.top)
        i = x // unit
        b = build()
        empty = b.or_(b.and_(b.cmp("eq", _zv(before), 0), b.cmp("eq", _zv(after), 0)), _zv(i + after <= 0))
        inside = []
        for s, e in self._runs(k, unit):
            inside.append(b.and_(b.or_(b.cmp("eq", s.z, 0), _zv(i - before >= s)), _zv(i + after <= e)))
        return Term(b.or_(empty, *inside))

    def run_from(self, k, start, unit, limit):
        """Consecutive cached blocks from block ``start``, stopping at block ``limit``."""
        z3 = _z3()
        length = z3.IntVal(0)
        for s, e in self._runs(k, unit):
            length = z3.If(z3.And(s.z <= _zv(start), _zv(start) < e.z), e.z - _zv(start), length)
        room = _zv(limit) - _zv(start)
        return Term(z3.If(room <= 0, 0, z3.If(length <= room, length, room)))

    def last_held(self, k, step, lo, hi, unit, before, after):
        """:meth:`kvhit.spec.cache.CacheState.last_held`: the same scan, lowered."""
        return scan_last_held(self, k, step, lo, hi, unit, before, after)

    def boundaries(self, model, k, unit, upto):
        """The cached boundaries ``x <= upto`` of (group, unit) in a model, for replay."""
        out = set()
        for s, e in self.lists.get((k, unit), []):
            sv, ev = model.eval(s.z, True).as_long(), model.eval(e.z, True).as_long()
            for j in range(max(sv, 0), min(ev, upto // unit + 2)):
                out.add((j + 1) * unit)
        return out


# ----------------------------------------------------------------------------------------------------
# The cache a write side leaves
# ----------------------------------------------------------------------------------------------------


def _key(p):
    """What tells two positions apart when building terms: the integer, or the term's identity."""
    return ("int", p) if isinstance(p, int) else (p.scale, p.e.get_id())


def _distinct_positive(positions):
    """The positions that can be positive, each once (concrete sentinels and repeated terms dropped)."""
    out, seen = [], set()
    for p in positions:
        if isinstance(p, int) and p <= 0:
            continue
        key = _key(p)
        if key not in seen:
            seen.add(key)
            out.append(p)
    return out


def _max_all(values):
    """The largest of ``values`` (at least one), each distinct one compared once."""
    out, seen = None, set()
    for v in values:
        if _key(v) not in seen:
            seen.add(_key(v))
            out = v if out is None else max_(out, v)
    return out


class SymbolicWrittenCache:
    """The cache :class:`kvhit.spec.cache.Held` descriptions say, with symbolic positions.

    What it lowers: :func:`kvhit.spec.cache.written_cache` read through :class:`kvhit.spec.cache.CacheState`'s
    ``window``, ``run_from`` and ``last_held``, whose one definition of what a group holds is
    :func:`kvhit.spec.cache.holds` (and :func:`~kvhit.spec.cache.holds_block` for a sliding window,
    :func:`~kvhit.spec.cache.holds_some` for layers). Those are loops over boundaries, which Z3 cannot
    run on symbolic positions, so this class restates their conditions as intervals of window ends rather
    than deriving them; ``tests/properties/test_layered_written_cache.py`` (every query, one layer or
    several, positions fixed to random integers) and ``tests/properties/test_write_side.py`` (what the
    write side leaves) check it against ``written_cache`` on concrete inputs, and a reading known to be
    wrong (``TwoPieceChains``) is shown to fail there.

    Full attention holds every block up to its extent and a few single boundaries; Mamba holds single
    states (and every state, or every ``period`` tokens, up to its extent); a sliding window holds tails
    of ``need`` blocks ending at a few symbolic positions and at periodic ones. A window query is decided
    exactly from the tails: with every tail ``need`` blocks long and the window no longer, the window is
    covered iff one tail covers it, or a tail ending inside it and a second one reaching past it overlap
    (two tails always suffice). Over the scan variable every such condition is an interval, periodic for
    periodic tails, so ``max_aligned`` keeps its closed form.

    A group may be *layered* (a tuple of :class:`Held`, :func:`kvhit.spec.cache.layers`): it holds the union
    of its layers. A group of one layer is read exactly as above. For several, full attention and Mamba are
    the unions of the layers' intervals (each layer's blocks are a prefix, so a run is the longest prefix);
    a sliding window is read from the *pieces* its layers' tails make, each cut at its own layer's extent
    (:class:`_Pieces`), with covers by chains of at most ``L + 1`` pieces for ``L`` layers with tails:

    *Why ``L + 1`` pieces suffice.* Take a cover of the window ``[s, e)`` with as few pieces as possible,
    ordered by start. No two end at the same block (the one starting later would be redundant), so they
    are ordered by end too. A piece other than the first and the last starts after ``s`` (else it covers
    everything the pieces before it do) and ends before ``e`` (likewise for the pieces after it): it lies
    strictly inside the window, so it is shorter than the window, hence shorter than a tail. A piece is
    shorter than a tail only when it is cut at block 0 (it then starts at ``0 <= s``, so it cannot be one of
    these middle pieces) or at its layer's extent ``E_i``; so the middle pieces end at distinct extents,
    all before ``e``. The last piece ends at or past ``e`` and within its own layer's extent, so that extent
    is not among them: at most ``L - 1`` middle pieces, ``L + 1`` in all (``L = 1``: today's two tails).

    The encoding: for each possible first piece, how far it reaches through ``L - 1`` greedy steps over
    the middle candidates and one final step over every piece; the window ends it covers are then one
    interval. A middle piece can be swapped for its layer's candidate (the layer's longest tail cut at its
    extent: the same end, a start no later; for periodic tails, the one cut at the periodic layers' extent),
    and each greedy step reaches at least as far as the chain's next piece, so this misses no cover; every
    chain it finds is one. A periodic first piece is followed by an explicit one, which starts inside it,
    so it is the periodic tail ending first at or after that start (tails are shorter than the period).
    Intervals: one per explicit tail, one per explicit tail for the periodic tail before it, one for the
    layers that keep every block, and the single periodic tails as for one layer.

    Supported exactly: explicit tails, layers that keep every block, and periodic tails when the periodic
    layers share their period, shift and tail (as layers of one layout and interval do), periods multiples
    of the block and longer than a tail. Not supported (:class:`SpecError`): live gaps in a sliding-window
    group of several layers, and periodic tails of differing shapes or that touch.
    """

    def __init__(self, groups):
        self.layers = tuple(layers(g) for g in groups)
        for k, ls in enumerate(self.layers):
            if not ls:
                raise SpecError(f"spec group {k} has no layer")
        # each group's readings, built once: k -> its _Pieces (a layered sliding window), (k, unit, before,
        # after) -> the window ends it covers (a check asks the same window at many points)
        self._pieces, self._ends = {}, {}

    # -- the sets of window ends that are covered ----------------------------------------------------
    def _intervals(self, k, unit, before, after):
        """Window ends ``x`` (multiples of ``unit``) whose blocks ``[x/unit - before, x/unit + after)`` are
        all held, as ``(lo, hi)`` or ``(lo, hi, period, phase)`` intervals of ``x``; built once per window."""
        if before == 0 and after == 0:
            return None  # an empty window: always held
        key = (k, unit, before, after)
        if key not in self._ends:
            self._ends[key] = (self._union_intervals(k, unit, before, after) if len(self.layers[k]) > 1
                               else self._layer_intervals(k, unit, before, after))
        return self._ends[key]

    def _layer_intervals(self, k, unit, before, after):
        """:meth:`_intervals` of a group of one layer."""
        g = self.layers[k][0]
        if g.kind is Kind.MAMBA:
            if before != 1 or after != 0 or unit != g.unit:
                raise SpecError("a Mamba group is read one state at a time at its unit")
            out = [(p, p) for p in _distinct_positive(g.points)]
            if g.every:
                out.append((unit, g.extent))
            elif g.period > 0:
                out.append((g.period, g.extent, g.period, 0))
            return out
        if g.kind is not Kind.SWA or g.every:
            if unit == g.block:
                return self._outside_gaps(g, [(unit, g.extent - after * unit)], before, after)
            if g.kind is Kind.FULL and before == 1 and after == 0:
                return [(g.block, g.extent, g.block, 0)] + [(p, p) for p in _distinct_positive(g.points)]
            raise SpecError(f"unsupported window of unit {unit} over group {k}")
        if unit != g.block:
            raise SpecError("a sliding-window group is read at its block")
        return self._outside_gaps(g, self._tail_intervals(g, before, after), before, after)

    @staticmethod
    def _outside_gaps(g, intervals, before, after):
        """``intervals`` without the window ends whose window reaches into one of ``g.gaps``.

        Blocks ``[x - before*b, x + after*b)`` meet the gap ``[lo, hi)`` iff ``lo - after*b < x <
        hi + before*b``. The ends meeting no gap are the union, over ``L`` = minus infinity and each gap's
        ``hi + before*b``, of ``[L, R(L)]`` with ``R(L)`` the least ``lo - after*b`` of the gaps not
        entirely before ``L`` (an ``L`` inside a gap gets an empty interval): linear in the gaps, where
        cutting each interval at each gap would double the intervals per gap.
        """
        gaps = live_gaps(g.gaps)
        if not gaps:
            return intervals
        bb, ab = before * g.block, after * g.block
        starts = [None] + [(lo < hi, hi + bb) for lo, hi in gaps]
        out = []
        for iv in intervals:
            for start in starts:
                lo_x, hi_x = iv[0], iv[1]
                if start is not None:
                    lo_x = ite(start[0], max_(lo_x, start[1]), hi_x + 1)
                for lo, hi in gaps:
                    reaches = lo < hi if start is None else and_(lo < hi, hi + bb > start[1])
                    hi_x = ite(reaches, min_(hi_x, lo - ab), hi_x)
                out.append((lo_x, hi_x) + tuple(iv[2:]))
        return out

    @staticmethod
    def _tail_intervals(g, before, after):
        b = g.block
        tail = g.need * b
        if before + after > g.need:
            raise SpecError(f"a window of {before + after} blocks is longer than the kept tails ({g.need})")
        bb, ab = before * b, after * b
        first = g.shift * b + g.period  # the first periodic tail end
        cap = g.extent - ab  # the window's last block is held only below the extent
        out = []

        def add(lo, hi, guard=True, period=None, phase=0):
            hi = min_(hi, cap)
            if guard is not True:
                hi = ite(guard, hi, -1)
            out.append((lo, hi) if period is None else (lo, hi, period, phase))

        def next_periodic(t1):  # the smallest periodic end past t1
            return g.shift * b + (t1 - g.shift * b) // g.period * g.period + g.period

        def last_periodic(t2):  # the largest periodic end before t2
            return g.shift * b + (t2 - b - g.shift * b) // g.period * g.period

        ends = _distinct_positive(g.ends)
        # Windows whose start is not clipped at block 0: x >= before blocks.
        for t in ends:
            add(max_(t - tail + bb, bb), t - ab)
        if g.period > 0:
            for delta in range(after, g.need - before + 1):
                add(max(bb, first - delta * b), cap, True, g.period, (g.shift * b - delta * b) % g.period)
        for t1 in ends:
            for t2 in ends:
                add(max_(t1 - ab + b, bb), min_(t1 + bb - b, t2 - ab), t2 - tail <= t1)
            if g.period > 0:
                q = next_periodic(t1)
                add(max_(t1 - ab + b, bb), min_(t1 + bb - b, q - ab), and_(q - tail <= t1, q >= first))
                p = last_periodic(t1)  # t1 as the far tail, a periodic one ending inside the window
                add(max_(p - ab + b, bb), min_(p + bb - b, t1 - ab), and_(p >= t1 - tail, p >= first))
        # Windows clipped at block 0: x < before blocks, the window is blocks [0, x/b + after).
        if bb > 0:
            top = bb - b
            for t in ends:
                add(b, min_(t - ab, top), t <= tail)
            for t1 in ends:
                for t2 in ends:
                    add(max_(t1 - ab + b, b), min_(t2 - ab, top), and_(t1 > 0, t2 - tail <= t1))
                if g.period > 0:
                    q = next_periodic(t1)
                    add(max_(t1 - ab + b, b), min_(q - ab, top), and_(and_(t1 > 0, q - tail <= t1), q >= first))
        return out

    # -- the two queries the read side makes ---------------------------------------------------------
    def window(self, k, x, unit, before, after):
        """Blocks ``[max(0, x // unit - before), x // unit + after)`` are held (see
        :meth:`kvhit.spec.cache.CacheState.window`)."""
        if self._chunked(k) and not isinstance(x, ScanVar):
            # a chunked-local window reaches back to its chunk's start: a length that depends on x
            i = x // unit
            first = max_(0, i - before)
            return or_(i + after <= first, self._chunked_reach(k, first * unit) >= (i + after) * unit)
        if is_symbolic(before) or is_symbolic(after):
            raise SpecError("window lengths must be concrete")
        intervals = self._intervals(k, unit, before, after)
        if isinstance(x, ScanVar):
            if x.step % unit or x.offset % unit:
                raise SpecError(f"window of unit {unit} over a scan of step {x.step} offset {x.offset}")
            if intervals is None:
                return IntervalSet.everything(x.top)
            shifted = []
            for iv in intervals:  # conditions on x + offset, as conditions on x
                lo, hi = iv[0] - x.offset, iv[1] - x.offset
                shifted.append((lo, hi) if len(iv) == 2 else (lo, hi, iv[2], (iv[3] - x.offset) % iv[2]))
            return IntervalSet(shifted, x.top)
        if intervals is None:
            return True
        x = x // unit * unit
        inside = []
        for iv in intervals:
            conds = [_zv(x >= iv[0]), _zv(x <= iv[1]), _zv(x >= unit)]
            if len(iv) == 4:
                conds.append(_zv(eq((x - iv[3]) % iv[2], 0)))
            inside.append(build().and_(*conds))
        return Term(build().or_(*inside)) if inside else False

    def run_from(self, k, start, unit, limit):
        """Consecutive held blocks from block ``start``, stopping at block ``limit``."""
        if self._chunked(k):
            if unit != self.layers[k][0].block:
                raise SpecError(f"run of unit {unit} over group {k}")
            return max_(0, min_(self._chunked_reach(k, start * unit) // unit, limit) - start)
        if len(self.layers[k]) > 1:
            return self._layered_run_from(k, start, unit, limit)
        g = self.layers[k][0]
        if unit != g.block or g.kind is Kind.MAMBA:
            raise SpecError(f"run of unit {unit} over group {k}")
        if g.kind is not Kind.SWA:
            return max_(0, min_(g.extent // unit, limit) - start)
        if not (isinstance(start, int) and start == 0):
            raise SpecError("a sliding-window run is read from block 0 only")
        if g.every:
            return max_(0, min_(self._before_gaps(g, g.extent) // unit, limit))
        b = g.block
        tail = g.need * b
        first = g.shift * b + g.period
        reach = 0
        ends = _distinct_positive(g.ends)
        for t in ends:  # a tail that starts at block 0
            reach = ite(and_(t > 0, t <= tail), max_(reach, t), reach)
        for _ in range(2 * len(ends) + 2):  # each step adds one tail overlapping the run's end
            nxt = reach
            for t in ends:
                nxt = ite(and_(t - tail <= reach, t > nxt), t, nxt)
            if g.period > 0:
                p = g.shift * b + (reach + tail - g.shift * b) // g.period * g.period
                nxt = ite(and_(p >= first, p > nxt), p, nxt)
            reach = nxt
        return max_(0, min_(self._before_gaps(g, min_(reach, g.extent)) // b, limit))

    def last_held(self, k, step, lo, hi, unit, before, after):
        """:meth:`kvhit.spec.cache.CacheState.last_held`: the same scan, lowered."""
        return scan_last_held(self, k, step, lo, hi, unit, before, after)

    # -- chunked local attention: each layer holds one range of blocks ------------------------------
    def _chunked(self, k) -> bool:
        return self.layers[k][0].kind is Kind.CHUNKED

    def _chunked_reach(self, k, first):
        """Where the run of held blocks from token ``first`` (a multiple of the block) ends, in a
        chunked-local group: each layer holds the blocks from the end of its gaps at block 0 (the blocks its
        request's lookup skipped) up to its extent, one range; the union's run from ``first`` grows by a
        layer whose range holds the block at the run's end, to that range's end, and each layer can do so
        once, so as many steps as layers reach it."""
        ranges = []
        for h in self.layers[k]:
            for g_lo, _ in live_gaps(h.gaps):
                if not (isinstance(g_lo, int) and g_lo <= 0):
                    raise SpecError(f"spec group {k}: a chunked-local gap must start at block 0, not {g_lo!r}")
            ranges.append((held_from(h), floor_to(h.extent, h.block)))
        b = self.layers[k][0].block
        reach = first
        for _ in ranges:
            for lo, hi in ranges:
                reach = ite(and_(lo <= reach, hi >= reach + b), max_(reach, hi), reach)
        return reach

    @staticmethod
    def _before_gaps(g, reach):
        """A run of held blocks from block 0 ending at token ``reach``, cut at the first gap inside it."""
        for lo, hi in live_gaps(g.gaps):
            reach = ite(and_(lo < hi, lo < reach), lo, reach)
        return reach

    # -- layered groups: the union of several Held ---------------------------------------------------
    def _layered(self, k):
        """Spec group ``k``'s layers, checked to be readable together: one kind, block and unit, and no
        sliding-window gaps."""
        ls = self.layers[k]
        g = ls[0]
        if any((h.kind, h.block, h.unit) != (g.kind, g.block, g.unit) for h in ls):
            raise SpecError(f"the layers of spec group {k} differ in kind, block or unit")
        if g.kind is Kind.SWA and any(live_gaps(h.gaps) for h in ls):
            raise SpecError(f"spec group {k}: gaps (Held.gaps) in a sliding-window group of several layers are "
                            "not supported (a block one layer lost may be held by another)")
        return ls

    def _longest_chain(self, ls) -> int:
        """Pieces a minimal cover of one window has at most: one more than the layers with tails (see the
        class docstring)."""
        return sum(1 for h in ls if not h.every) + 1

    def _union_intervals(self, k, unit, before, after):
        """:meth:`_intervals` of a group of several layers: the window ends the union of the layers covers."""
        ls = self._layered(k)
        g = ls[0]
        if g.kind is Kind.MAMBA:
            if before != 1 or after != 0 or unit != g.unit:
                raise SpecError("a Mamba group is read one state at a time at its unit")
            out = [(p, p) for p in _distinct_positive(p for h in ls for p in h.points)]
            if any(h.every for h in ls):
                out.append((unit, _max_all(h.extent for h in ls if h.every)))
            for period in sorted({h.period for h in ls if not h.every and h.period > 0}):
                out.append((period, _max_all(h.extent for h in ls if not h.every and h.period == period), period, 0))
            return out
        if g.kind is Kind.CHUNKED and any(live_gaps(h.gaps) for h in ls):
            raise SpecError(f"spec group {k}: a chunked-local window over the scan variable in several layers "
                            "with gaps is not supported")
        if g.kind is not Kind.SWA or all(h.every for h in ls):
            # each layer holds every block up to its extent: the union is the longest of those prefixes
            extent = _max_all(h.extent for h in ls)
            if unit == g.block:
                return [(unit, extent - after * unit)]
            if g.kind is Kind.FULL and before == 1 and after == 0:
                points = _distinct_positive(p for h in ls for p in h.points)
                return [(g.block, extent, g.block, 0)] + [(p, p) for p in points]
            raise SpecError(f"unsupported window of unit {unit} over group {k}")
        if unit != g.block:
            raise SpecError("a sliding-window group is read at its block")
        return self._pieces_of(k).window_ends(before, after)

    def _layered_run_from(self, k, start, unit, limit):
        """:meth:`run_from` of a group of several layers."""
        ls = self._layered(k)
        g = ls[0]
        if unit != g.block or g.kind is Kind.MAMBA:
            raise SpecError(f"run of unit {unit} over group {k}")
        if g.kind is not Kind.SWA or all(h.every for h in ls):
            return max_(0, min_(_max_all(h.extent for h in ls) // unit, limit) - start)
        if not (isinstance(start, int) and start == 0):
            raise SpecError("a sliding-window run is read from block 0 only")
        return max_(0, min_(self._pieces_of(k).run() // unit, limit))

    def _pieces_of(self, k):
        if k not in self._pieces:
            self._pieces[k] = _Pieces(self.layers[k], k, self._longest_chain(self.layers[k]))
        return self._pieces[k]


class _Pieces:
    """A sliding-window group of several layers as the pieces of held blocks its layers' tails make, in
    tokens ``[lo, hi)`` (``lo`` may be negative: blocks from 0): an explicit tail ending at ``t`` is
    ``[t - need*b, min(t, E))``, cut at the largest extent ``E`` among the layers that keep it; a layer
    that keeps every block is ``[0, E)``; periodic tails are cut at the periodic layers' largest extent.
    Positions are multiples of the block, as the write side makes them.
    """

    def __init__(self, ls, k, longest: int):
        self.longest = longest
        self._chains = None
        b = ls[0].block
        self.block = b
        self.tails = [h for h in ls if not h.every]
        dense = [h.extent for h in ls if h.every]
        self.dense = _max_all(dense) if dense else None
        by_end = {}
        for h in self.tails:
            for t in _distinct_positive(h.ends):
                by_end.setdefault((_key(t), h.need), (t, h.need, []))[2].append(h.extent)
        self.explicit = [(t - need * b, min_(t, _max_all(extents))) for t, need, extents in by_end.values()]
        # the middle candidates: per layer, the longest of its tails cut at its extent
        self.middles = []
        for h in self.tails:
            ends = _distinct_positive(h.ends)
            if ends:
                lo = h.extent
                for t in ends:
                    lo = ite(and_(t > h.extent, t - h.need * b < lo), t - h.need * b, lo)
                self.middles.append((lo, h.extent))
        self.period = 0
        periodic = [h for h in self.tails if h.period > 0]
        if periodic:
            shapes = {(h.period, h.shift, h.need) for h in periodic}
            if len(shapes) > 1:
                raise SpecError(f"spec group {k}: layers with periodic tails of different periods, shifts or "
                                "tails are not supported")
            ((period, shift, need),) = shapes
            if period % b or period <= need * b:
                raise SpecError(f"spec group {k}: periodic tails every {period} tokens of {need} blocks of {b} "
                                "(a period not a multiple of the block, or tails that touch) are not supported "
                                "in several layers")
            self.period, self.base, self.tail, self.need = period, shift * b, need * b, need
            self.first = self.base + period  # the first periodic tail end
            self.top = _max_all(h.extent for h in periodic)

    def periodic_reaching(self, reach):
        """The periodic tail ending last among those starting at or before ``reach``: ``(hi, exists)``."""
        q = self.base + (reach + self.tail - self.base) // self.period * self.period
        return min_(q, self.top), q >= self.first

    def periodic_from(self, lo):
        """The periodic tail ending first at or after ``lo``: ``(lo, hi, exists)``."""
        q = self.base + cdiv(lo - self.base, self.period) * self.period
        return q - self.tail, min_(q, self.top), q >= self.first

    def extend(self, reach, pieces):
        """``reach`` extended by the piece ending last among ``pieces`` and the periodic tails that start
        at or before it (one greedy step of a chain)."""
        out = reach
        for lo, hi in pieces:
            out = ite(and_(lo <= reach, hi > out), hi, out)
        if self.period:
            hi, ok = self.periodic_reaching(reach)
            out = ite(and_(ok, hi > out), hi, out)
        return out

    def run(self):
        """Where the run of held blocks from block 0 ends: greedy steps until no piece extends it. Each
        step that moves it uses an explicit piece for good or a periodic tail, and two periodic tails
        never touch, so ``2n + 1`` steps (``n`` without periodic tails) reach the end."""
        reach = 0 if self.dense is None else self.dense
        n = len(self.explicit)
        for _ in range(2 * n + 1 if self.period else n):
            reach = self.extend(reach, self.explicit)
        return reach

    def chains(self):
        """Per possible first piece ``(lo, reach, exists)``: where the chains of at most ``longest`` pieces
        from it reach (the same for every window, so built once)."""
        if self._chains is None:
            firsts = [(lo, hi, True) for lo, hi in self.explicit]
            if self.dense is not None:
                firsts.append((0, self.dense, True))
            if self.period:
                # a periodic first piece is followed by an explicit one, which starts inside it: the periodic
                # tail ending first at or after that start (the only one, as tails are shorter than the period)
                firsts += [self.periodic_from(lo) for lo, _ in self.explicit]
            steps = self.longest - 2 if (self.middles or self.period) else 0
            self._chains = []
            for lo, hi, ok in firsts:
                reach = hi
                for _ in range(steps):
                    reach = self.extend(reach, self.middles)
                self._chains.append((lo, self.extend(reach, self.explicit), ok))
        return self._chains

    def window_ends(self, before, after):
        """The window ends ``x`` whose blocks ``[x/b - before, x/b + after)`` the pieces cover, as
        intervals: a single periodic tail covering it (as for one layer), or a chain from a first piece
        that starts at or before the window's first block ``max(0, x/b - before)`` and reaches past its last."""
        b = self.block
        bb, ab = before * b, after * b
        for h in self.tails:
            if before + after > h.need:
                raise SpecError(f"a window of {before + after} blocks is longer than the kept tails ({h.need})")
        out = []
        if self.period:
            for delta in range(after, self.need - before + 1):  # x = a periodic end - delta blocks
                out.append((max(bb, self.first - delta * b), self.top - ab, self.period,
                            (self.base - delta * b) % self.period))
        for lo, reach, ok in self.chains():
            out.append((ite(lo <= 0, 0, lo + bb), ite(ok, reach - ab, -1)))
        return out
