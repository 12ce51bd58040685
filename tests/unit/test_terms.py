"""The term language: both lowerings agree operator by operator, and misuse is caught at build time."""

import pytest
import z3
from hypothesis import given, settings
from hypothesis import strategies as st

from kvhit.spec import runtime
from kvhit.spec.lower_z3 import SymbolicCache, lowering
from kvhit.spec.terms import (OPERATORS, SpecError, SymbolicBranchError, Term, _zv, and_, build, cdiv, eq,
                              floor_to, ite, max_, max_aligned, min_)
from kvhit.spec.cache import CacheState


def _value(term):
    """Evaluate a closed Z3 term."""
    v = z3.simplify(_zv(term))
    return z3.is_true(v) if z3.is_bool(v) else v.as_long()


def _sym(n):
    return Term(z3.IntVal(n))


def test_symbolic_value_in_python_if_raises():
    x = Term(z3.Int("x"))
    with pytest.raises(SymbolicBranchError):
        if x > 3:
            pass
    with pytest.raises(SymbolicBranchError):
        bool(min_(x, 4) <= 2)


def test_division_needs_a_concrete_positive_divisor():
    x = Term(z3.Int("x"))
    with pytest.raises(SpecError, match="positive"):
        x // 0
    with pytest.raises(SpecError, match="positive"):
        x % -16
    with pytest.raises(SpecError, match="symbolic"):
        16 // x
    with pytest.raises(SpecError, match="positive"):
        floor_to(x, 0)


ints = st.integers(min_value=-5000, max_value=5000)
divisors = st.integers(min_value=1, max_value=400)


@given(ints, ints, divisors, st.booleans())
def test_operators_agree_between_python_and_z3(a, b, d, c):
    assert _value(_sym(a) // d) == a // d
    assert _value(_sym(a) % d) == a % d
    assert _value((_sym(a) * d) // d) == a
    assert _value(_sym(a) * 3 + _sym(b) * 6 - 9) == 3 * a + 6 * b - 9
    assert _value(cdiv(_sym(a), d)) == -(-a // d)
    assert _value(floor_to(_sym(a) * d + b, d)) == (a * d + b) // d * d
    assert _value(min_(_sym(a), b)) == min(a, b)
    assert _value(max_(_sym(a), _sym(b) * d)) == max(a, b * d)
    assert _value(ite(Term(z3.BoolVal(c)), _sym(a) * d, b)) == (a * d if c else b)
    assert _value(eq(_sym(a) * d, b)) == (a * d == b)
    assert _value(_sym(a) <= b) == (a <= b)


def test_every_operator_has_a_python_source_template():
    for op in OPERATORS.values():
        assert op.source and op.doc, op.name


runs_strategy = st.lists(st.tuples(st.integers(0, 6), st.integers(0, 6)), min_size=1, max_size=3)


@settings(max_examples=150, deadline=None)
@given(runs=runs_strategy, hi=st.integers(-20, 400), step_units=st.integers(1, 3),
       before=st.integers(0, 3), after=st.integers(0, 1), bound=st.integers(0, 400))
def test_max_aligned_in_z3_equals_the_python_scan(runs, hi, step_units, before, after, bound):
    """The closed form over intervals picks exactly what the downward scan picks."""
    unit = 16
    step = unit * step_units
    spans, start = [], 0
    for gap, length in runs:  # ordered runs of blocks, separated by at least one missing block
        s = start + gap + (1 if spans else 0)
        spans.append((s, s + length))
        start = s + length
    cached = {(j + 1) * unit for s, e in spans for j in range(s, e)}

    def pred(cache):
        return lambda x: and_(cache.window(0, x, unit, before, after), x <= bound)

    want = runtime.max_aligned(step, hi, pred(CacheState.from_sets([cached])))
    with lowering():
        cache = SymbolicCache(len(spans))
        top = Term(z3.Int("hi"))
        got = max_aligned(step, top, pred(cache))
        solver = z3.Solver()
        for (s, e), (sv, ev) in zip(cache._runs(0, unit), spans):
            solver.add(s.z == sv, e.z == ev)
        solver.add(top.z == hi)
        assert solver.check() == z3.sat
        assert solver.model().eval(_zv(got), True).as_long() == want


def test_the_term_builder_makes_the_terms_z3py_makes():
    """spec.terms.build() goes around z3py's coercions for speed; each constructor must still make the very
    node z3py's operator makes (Z3 shares equal nodes, so the same term is the same AST), Python ints made
    numerals as z3py makes them, on either side; a builder that swapped operands or made a different
    operator fails here (the last assertions show the comparison can tell)."""
    b = build()
    x, y, p, q = z3.Int("x"), z3.Int("y"), z3.Bool("p"), z3.Bool("q")
    pairs = [(b.num(-7), z3.IntVal(-7)), (b.add(x, y), x + y), (b.add(x, 3), x + 3), (b.sub(x, y), x - y),
             (b.sub(5, x), 5 - x), (b.mul(x, 16), x * 16), (b.mul(x, y), x * y), (b.div(x, 4), x / 4),
             (b.neg(x), -x), (b.cmp("lt", x, y), x < y), (b.cmp("le", x, 0), x <= 0), (b.cmp("gt", x, y), x > y),
             (b.cmp("ge", 2, x), z3.IntVal(2) >= x), (b.cmp("eq", x, 1), x == 1), (b.and_(p, q), z3.And(p, q)),
             (b.and_(p, q, p), z3.And([p, q, p])), (b.and_(), z3.And([])), (b.or_(p, q), z3.Or(p, q)),
             (b.not_(p), z3.Not(p)), (b.implies(p, q), z3.Implies(p, q)), (b.ite(p, x, 3), z3.If(p, x, 3)),
             (b.ite(p, q, p), z3.If(p, q, p))]
    for made, expected in pairs:
        assert made.eq(expected), (made, expected)
        assert type(made) is type(expected) or isinstance(made, type(expected)), (made, expected)
    assert not b.sub(x, y).eq(y - x) and not b.cmp("lt", x, y).eq(x <= y) and not b.or_(p, q).eq(z3.And(p, q))
