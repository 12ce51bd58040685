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
from contextlib import contextmanager
from dataclasses import dataclass

from .terms import _LOWERING, SpecError, Term, _zv, is_symbolic, ite, max_, min_


def _z3():
    import z3

    return z3


_fresh = itertools.count()


def fresh_int(prefix: str) -> Term:
    return Term(_z3().Int(f"{prefix}!{next(_fresh)}"))


@contextmanager
def lowering():
    """While active, :func:`kvhit.spec.terms.passes` unrolls a bounded number of passes."""
    previous = _LOWERING.get("z3")
    _LOWERING["z3"] = True
    try:
        yield
    finally:
        _LOWERING["z3"] = previous


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
    """A predicate of the scan variable: ``x`` lies in one of the closed intervals ``[lo, hi]``."""

    def __init__(self, intervals, top):
        self.intervals = list(intervals)
        self.top = top

    @classmethod
    def of(cls, lo, hi, top):
        return cls([(lo, hi)], top)

    @classmethod
    def everything(cls, top, when=True):
        return cls([(0, top)] if when is True else [(0, _if(when, top, -1))], top)

    def __bool__(self):
        raise SpecError("a predicate of the scan variable used in a Python branch")

    @staticmethod
    def __kvhit_set__(op, a, b):
        top = a.top if isinstance(a, IntervalSet) else b.top
        a = a if isinstance(a, IntervalSet) else IntervalSet.everything(top, a)
        b = b if isinstance(b, IntervalSet) else IntervalSet.everything(top, b)
        if op == "or":
            return IntervalSet(a.intervals + b.intervals, top)
        return IntervalSet([(max_(l1, l2), min_(h1, h2)) for (l1, h1), (l2, h2) in
                            itertools.product(a.intervals, b.intervals)], top)


def _if(c, a, b):
    if c is True:
        return a
    if c is False:
        return b
    return ite(Term(_zv(c)), a, b)


def symbolic_max_aligned(step: int, hi, pred):
    """``max_aligned`` in closed form over the intervals its predicate lowers to."""
    x = ScanVar(step, hi)
    sat = pred(x)
    if not isinstance(sat, IntervalSet):
        sat = IntervalSet.everything(hi, sat)
    best = 0
    for lo, top in sat.intervals:
        t = min_(hi, top) // step * step
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
        z3 = _z3()
        i = x // unit
        empty = z3.Or(z3.And(_zv(before) == 0, _zv(after) == 0), _zv(i + after <= 0))
        inside = []
        for s, e in self._runs(k, unit):
            inside.append(z3.And(z3.Or(s.z == 0, _zv(i - before >= s)), _zv(i + after <= e)))
        return Term(z3.Or(empty, *inside))

    def run_from(self, k, start, unit, limit):
        """Consecutive cached blocks from block ``start``, stopping at block ``limit``."""
        z3 = _z3()
        length = z3.IntVal(0)
        for s, e in self._runs(k, unit):
            length = z3.If(z3.And(s.z <= _zv(start), _zv(start) < e.z), e.z - _zv(start), length)
        room = _zv(limit) - _zv(start)
        return Term(z3.If(room <= 0, 0, z3.If(length <= room, length, room)))

    def boundaries(self, model, k, unit, upto):
        """The cached boundaries ``x <= upto`` of (group, unit) in a model, for replay."""
        out = set()
        for s, e in self.lists.get((k, unit), []):
            sv, ev = model.eval(s.z, True).as_long(), model.eval(e.z, True).as_long()
            for j in range(max(sv, 0), min(ev, upto // unit + 2)):
                out.add((j + 1) * unit)
        return out
