"""The term language the policy is written in.

The policy in :mod:`kvhit.spec.policy` is ordinary Python over a handful of operators. Each operator has
exactly one entry in :data:`OPERATORS`, which says how it behaves in each of the two lowerings:

* **Python** (the concrete interpreter and the generated ``refimpl``): integers and booleans. The
  ``source`` template is what :mod:`kvhit.spec.codegen` writes into ``refimpl`` in place of the call.
* **Z3** (:mod:`kvhit.spec.lower_z3`): the same spec functions are *executed* with :class:`Term` values,
  which wrap Z3 expressions. Layout quantities (block sizes, windows, DCP size) stay concrete Python ints;
  request state (prompt length, cache state) is symbolic.

The Python lowering also runs per layout (:mod:`kvhit.spec.stage`): the spec functions executed with the
layout concrete and the request as staged Python expressions, each operator call written with the same
``source`` template, which leaves one function of the request for that layout (what the vLLM adapter
calls per lookup).

The operators know none of those modules. A lowering other than plain Python subclasses
:class:`Lowering` and installs itself with :func:`installed` while it runs the spec; the operators
consult the lowering in force through that one interface (a staged operand, ``max_aligned``, a fixed-point
loop's ``passes``, a written cache) and never import the module that defines it.

Two rules keep the lowerings honest:

* A symbolic value in a Python ``if``/``and``/``or``/``not`` raises :class:`SymbolicBranchError`
  (``Term.__bool__``), so a branch can never be silently picked at lowering time. Branch with :func:`ite`.
* Division is only by a concrete positive integer. Z3's integer division equals Python's ``//`` only for
  positive divisors, so the obligation "divisor > 0" is discharged when the term is built, not assumed.
"""

from __future__ import annotations

import itertools
import math
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, Callable

from . import runtime


class SpecError(Exception):
    """The spec used the term language in a way neither lowering supports."""


class SymbolicBranchError(SpecError):
    """A symbolic value reached a Python branch; use ``ite`` instead."""


# ----------------------------------------------------------------------------------------------------
# Symbolic values (used only by the Z3 lowering)
# ----------------------------------------------------------------------------------------------------


def _z3():
    import z3  # imported lazily: the concrete interpreter and refimpl never need it

    return z3


class _Build:
    """Z3 terms made through Z3's C API (``z3.Z3_mk_*``) as z3py's operators make them, without their checks.

    z3py's ``a <= b``, ``a * 3``, ``And(...)`` first coerce their operands (sorts compared, Python values
    turned into numerals, probes looked for), and that was most of the time a check spent building its
    formula: on 2026-12-07 ``make prove`` spent 274 s of its 672 s of checks building terms, a comparison
    took 11 us through z3py and 5 us here, ``And`` of two 35 us and 3 us. The lowering's operands are
    already expressions of the right sort (a Python int is made a numeral, as z3py's coercion does), so the
    checks are not needed. Each constructor makes the term z3py's operator makes (the same node:
    ``tests/unit/test_terms.py``), so every formula is what it was. Numerals are made once per process and
    kept, and a comparison no longer makes the four others it discarded, so Z3 frees nodes and reuses their
    ids at other moments than before: a check's resource count is still one number per commit, but not the
    number it was (the default run's total went from 10.7 G to 10.2 G units, every verdict the same)."""

    def __init__(self, z3):
        self.z3 = z3
        self.ctx = z3.main_ctx()
        self.ref = self.ctx.ref()
        self.int_sort = z3.IntSort(self.ctx)  # a built-in sort: held, it makes no node
        self.numerals = {}  # v -> z3.IntVal(v), made once (a check makes tens of thousands, of a few values)
        self.comparisons = {"lt": z3.Z3_mk_lt, "le": z3.Z3_mk_le, "gt": z3.Z3_mk_gt, "ge": z3.Z3_mk_ge,
                            "eq": z3.Z3_mk_eq}

    def num(self, v: int):
        """``z3.IntVal(v)``."""
        made = self.numerals.get(v)
        if made is None:
            made = self.numerals[v] = self.z3.IntNumRef(
                self.z3.Z3_mk_numeral(self.ref, str(v), self.int_sort.ast), self.ctx)
        return made

    def expr(self, v):
        """``v`` as an expression: a Python int becomes a numeral (what z3py's coercion makes of it)."""
        return self.num(v) if isinstance(v, int) and not isinstance(v, bool) else v

    def _arith(self, f, a, b):
        a, b = self.expr(a), self.expr(b)
        args = (self.z3.Ast * 2)(a.as_ast(), b.as_ast())
        return self.z3.ArithRef(f(self.ref, 2, args), self.ctx)

    def add(self, a, b):
        return self._arith(self.z3.Z3_mk_add, a, b)

    def sub(self, a, b):
        return self._arith(self.z3.Z3_mk_sub, a, b)

    def mul(self, a, b):
        return self._arith(self.z3.Z3_mk_mul, a, b)

    def div(self, a, b):
        """``a / b`` of integers (Z3's integer division)."""
        a, b = self.expr(a), self.expr(b)
        return self.z3.ArithRef(self.z3.Z3_mk_div(self.ref, a.as_ast(), b.as_ast()), self.ctx)

    def neg(self, a):
        return self.z3.ArithRef(self.z3.Z3_mk_unary_minus(self.ref, a.as_ast()), self.ctx)

    def cmp(self, op: str, a, b):
        """``a < b`` (``op`` "lt"), ``<=`` ("le"), ``>``, ``>=``, ``==`` ("eq") as a boolean."""
        a, b = self.expr(a), self.expr(b)
        return self.z3.BoolRef(self.comparisons[op](self.ref, a.as_ast(), b.as_ast()), self.ctx)

    def _nary(self, f, args):
        array = (self.z3.Ast * len(args))(*(a.as_ast() for a in args))
        return self.z3.BoolRef(f(self.ref, len(args), array), self.ctx)

    def and_(self, *args):
        """``z3.And(*args)`` of boolean expressions."""
        return self._nary(self.z3.Z3_mk_and, args)

    def or_(self, *args):
        """``z3.Or(*args)`` of boolean expressions."""
        return self._nary(self.z3.Z3_mk_or, args)

    def not_(self, a):
        return self.z3.BoolRef(self.z3.Z3_mk_not(self.ref, a.as_ast()), self.ctx)

    def implies(self, a, b):
        return self.z3.BoolRef(self.z3.Z3_mk_implies(self.ref, a.as_ast(), b.as_ast()), self.ctx)

    def ite(self, c, a, b):
        """``z3.If(c, a, b)``: ``a`` and ``b`` of one sort (ints made numerals, ``a`` first)."""
        a, b = self.expr(a), self.expr(b)
        sort = self.z3.BoolRef if isinstance(a, self.z3.BoolRef) else self.z3.ArithRef
        return sort(self.z3.Z3_mk_ite(self.ref, c.as_ast(), a.as_ast(), b.as_ast()), self.ctx)


_BUILD: _Build | None = None


def build() -> _Build:
    """The Z3 term builder (:class:`_Build`), made on first use: importing this module needs no Z3."""
    global _BUILD
    if _BUILD is None:
        _BUILD = _Build(_z3())
    return _BUILD


class Term:
    """A symbolic integer or boolean: a Z3 expression ``e`` times a known positive integer ``scale``.

    Positions in the policy are mostly multiples of block sizes. Keeping the factor out of the expression
    lets ``(1600 * s) // 1600`` lower to ``s`` instead of a Z3 division, which the solver would otherwise
    have to reason about; divisions that remain are by the smallest possible constant.
    """

    __slots__ = ("e", "scale")

    def __init__(self, e, scale: int = 1):
        self.e = e
        self.scale = scale

    @property
    def z(self):
        """The Z3 expression of the value."""
        return self.e if self.scale == 1 else build().mul(self.e, self.scale)

    def __bool__(self):
        raise SymbolicBranchError(
            f"symbolic value {self.z} used in a Python branch; write the choice with ite()")

    def __repr__(self):
        return f"Term({self.z})"

    # arithmetic --------------------------------------------------------------------------------------
    def __add__(self, o):
        a, b, g = _common(self, o)
        return Term(build().add(a, b), g)

    def __radd__(self, o):
        return self.__add__(o)

    def __sub__(self, o):
        a, b, g = _common(self, o)
        return Term(build().sub(a, b), g)

    def __rsub__(self, o):
        a, b, g = _common(self, o)
        return Term(build().sub(b, a), g)

    def __mul__(self, o):
        if isinstance(o, Term):
            return Term(build().mul(self.z, o.z))
        if not isinstance(o, int) or isinstance(o, bool):
            raise SpecError(f"cannot multiply a term by {o!r}")
        if o == 0:
            return Term(build().num(0))
        if o < 0:
            return Term(build().neg(self.e), self.scale * -o)
        return Term(self.e, self.scale * o)

    __rmul__ = __mul__

    def __neg__(self):
        return Term(build().neg(self.e), self.scale)

    def __floordiv__(self, o):
        d = _positive_divisor(o)
        g = math.gcd(self.scale, d)
        scale, d = self.scale // g, d // g
        if d == 1:
            return Term(self.e, scale)
        return Term(build().div(self.e if scale == 1 else build().mul(self.e, scale), d))

    def __rfloordiv__(self, o):
        raise SpecError(f"division by the symbolic value {self.z}; divisors must be concrete")

    def __mod__(self, o):
        return self - (self // o) * o

    def __rmod__(self, o):
        raise SpecError(f"modulo by the symbolic value {self.z}; divisors must be concrete")

    # comparisons -------------------------------------------------------------------------------------
    def __lt__(self, o):
        return _cmp(self, o, "lt")

    def __le__(self, o):
        return _cmp(self, o, "le")

    def __gt__(self, o):
        return _cmp(self, o, "gt")

    def __ge__(self, o):
        return _cmp(self, o, "ge")

    __hash__ = None  # equality is eq(), never ==


def _as_term(v) -> Term:
    if isinstance(v, Term):
        return v
    if isinstance(v, bool):
        return Term(_z3().BoolVal(v))
    if isinstance(v, int):  # 0 has every scale (gcd(s, 0) == s)
        return Term(build().num(1 if v > 0 else -1), abs(v)) if v else Term(build().num(0), 0)
    return Term(_zv(v))


def _common(a, b):
    """Both values as Z3 expressions over their largest common scale: ``(ea, eb, scale)``."""
    a, b = _as_term(a), _as_term(b)
    g = math.gcd(a.scale, b.scale)
    ea = a.e if a.scale == g else build().mul(a.e, a.scale // g)
    eb = b.e if b.scale == g else build().mul(b.e, b.scale // g)
    return ea, eb, g


def _positive_divisor(d) -> int:
    if isinstance(d, Term):
        raise SpecError(f"division by the symbolic value {d.z}; divisors must be concrete")
    if not isinstance(d, int) or d <= 0:
        raise SpecError(f"division by {d!r}: the divisor must be a positive integer")
    return d


def _zv(v):
    """The Z3 form of a value (Term, int, bool or a Z3 expression)."""
    z3 = _z3()
    if isinstance(v, Term):
        return v.z
    if isinstance(v, bool):
        return z3.BoolVal(v)
    if isinstance(v, int):
        return build().num(v)
    if isinstance(v, z3.ExprRef):
        return v
    raise SpecError(f"cannot lower {v!r} to Z3")


def _cmp(a, b, op):
    # The scan variable of max_aligned compares into a predicate set, not a boolean.
    for v in (a, b):
        hook = getattr(v, "__kvhit_compare__", None)
        if hook is not None and not isinstance(v, Term):
            return hook(a, b, op)
    za, zb, _ = _common(a, b)
    return Term(build().cmp(op, za, zb))


def is_symbolic(*vals) -> bool:
    return any(isinstance(v, Term) or hasattr(v, "__kvhit_set__") for v in vals)


# ----------------------------------------------------------------------------------------------------
# The lowering in force: the one interface between the operators and the modules that lower them
# ----------------------------------------------------------------------------------------------------


class Lowering:
    """What the operators do while a lowering other than plain Python runs the spec.

    The operators know no lowering module: a lowering (:func:`kvhit.spec.lower_z3.lowering`,
    :func:`kvhit.spec.stage.stage`) subclasses this, overrides the hooks whose meaning it changes, and
    installs an instance with :func:`installed` while it executes the spec; the operators consult it through
    :func:`active` and these hooks only. The defaults are the Python meaning, which is also what runs when no
    lowering is installed.
    """

    def owns(self, vals) -> bool:
        """Whether some of ``vals`` are this lowering's own symbolic values: an operator applied to them
        is then this lowering's :meth:`call`, not evaluated by the operator itself."""
        return False

    def call(self, op: "Operator", args: tuple):
        """Operator ``op`` applied to ``args``, some of them this lowering's values (see :meth:`owns`)."""
        raise SpecError(f"{type(self).__name__} does not lower {op.name}")

    def max_aligned(self, step: int, hi, pred):
        """:func:`max_aligned`, its divisor already checked: in Python, the downward scan."""
        if is_symbolic(hi):
            raise SpecError(f"max_aligned up to the symbolic bound {hi!r} outside the Z3 lowering "
                            "(kvhit.spec.lower_z3.lowering())")
        return runtime.max_aligned(step, hi, pred)

    def passes(self, bound: int):
        """:func:`passes`: in Python, unbounded."""
        return itertools.count()

    def written(self, groups: tuple):
        """:func:`written` of symbolic descriptions; ``None``: read them with the plain loops."""
        return None


# The lowering in force in this context, if any: written only by installed().
_ACTIVE: ContextVar[Lowering | None] = ContextVar("kvhit_spec_lowering", default=None)
_PYTHON = Lowering()


@contextmanager
def installed(lowering: Lowering):
    """Run the operators under ``lowering`` until the block ends (then the one in force before, if any).

    A context variable rather than a module global: a lowering in one thread or task is not seen in
    another, and only this function sets it.
    """
    token = _ACTIVE.set(lowering)
    try:
        yield lowering
    finally:
        _ACTIVE.reset(token)


def active() -> Lowering | None:
    """The lowering :func:`installed` put in force, or None while the spec runs on Python values."""
    return _ACTIVE.get()


def _owner(*vals) -> Lowering | None:
    """The lowering in force, when some of ``vals`` are its own values (an operator applied to them is its
    :meth:`Lowering.call`); else None, and the operator evaluates itself."""
    lowering = _ACTIVE.get()
    return lowering if lowering is not None and lowering.owns(vals) else None


# ----------------------------------------------------------------------------------------------------
# The operators. Concrete behaviour is plain Python; each lowers to Z3 and to Python source.
# ----------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Operator:
    """One operator of the term language.

    Attributes:
        name: the name the spec calls it by.
        source: how codegen writes a call in ``refimpl`` (``{0}``, ``{1}``, ... are the argument sources).
        doc: one line for the README's operator table.
    """

    name: str
    source: str
    doc: str


OPERATORS: dict[str, Operator] = {}


def _operator(source: str, doc: str):
    def register(fn: Callable) -> Callable:
        OPERATORS[fn.__name__] = Operator(fn.__name__, source, doc)
        return fn

    return register


@_operator("({1} if {0} else {2})", "if-then-else; both branches must have the same shape")
def ite(cond, then, other):
    """``then`` if ``cond`` else ``other``. Tuples are chosen element-wise in Z3."""
    elements = (*then, *other) if isinstance(then, tuple) else ()
    if (lowering := _owner(cond, then, other, *elements)) is not None:
        return lowering.call(OPERATORS["ite"], (cond, then, other))
    if not is_symbolic(cond):
        return then if cond else other
    if isinstance(then, tuple):
        return tuple(ite(cond, t, o) for t, o in zip(then, other, strict=True))
    z3 = _z3()
    if isinstance(then, bool) or isinstance(other, bool) or z3.is_bool(_zv(then)):
        return Term(build().ite(_zv(cond), _zv(then), _zv(other)))
    a, b, g = _common(then, other)
    return Term(build().ite(_zv(cond), a, b), g)


@_operator("min({0}, {1})", "minimum of two integers")
def min_(a, b):
    if (lowering := _owner(a, b)) is not None:
        return lowering.call(OPERATORS["min_"], (a, b))
    if not is_symbolic(a, b):
        return min(a, b)
    return ite(a <= b, a, b)


@_operator("max({0}, {1})", "maximum of two integers")
def max_(a, b):
    if (lowering := _owner(a, b)) is not None:
        return lowering.call(OPERATORS["max_"], (a, b))
    if not is_symbolic(a, b):
        return max(a, b)
    return ite(a >= b, a, b)


@_operator("(-(-({0}) // ({1})))", "ceiling division by a concrete positive integer")
def cdiv(a, b):
    _positive_divisor(b)
    return -((-a) // b)


@_operator("(({0}) // ({1}) * ({1}))", "round down to a multiple of a concrete positive integer")
def floor_to(a, unit):
    _positive_divisor(unit)
    return a // unit * unit


@_operator("(({0}) == ({1}))", "integer equality")
def eq(a, b):
    if (lowering := _owner(a, b)) is not None:
        return lowering.call(OPERATORS["eq"], (a, b))
    if not is_symbolic(a, b):
        return a == b
    return _cmp(a, b, "eq")


def _connective(name: str, a, b, decides: bool):
    """``and_`` (``decides`` False) or ``or_`` (``decides`` True) of two operands: as in Python on concrete
    ones (an operand equal to ``decides`` decides it); predicate sets of a scan variable combine as sets."""
    if (lowering := _owner(a, b)) is not None:
        return lowering.call(OPERATORS[name], (a, b))
    if not is_symbolic(a, b):
        return (a or b) if decides else (a and b)
    if a is decides or b is decides:  # a concrete True (or) or False (and) decides it, as in Python
        return decides
    op = "or" if decides else "and"
    hook = getattr(a, "__kvhit_set__", None) or getattr(b, "__kvhit_set__", None)
    if hook is not None:
        return hook(op, a, b)
    return Term((build().or_ if decides else build().and_)(_zv(a), _zv(b)))


@_operator("({0} and {1})", "conjunction")
def and_(a, b):
    return _connective("and_", a, b, decides=False)


@_operator("({0} or {1})", "disjunction")
def or_(a, b):
    return _connective("or_", a, b, decides=True)


@_operator("(not {0})", "negation (not of a predicate on a scan variable)")
def not_(a):
    if (lowering := _owner(a)) is not None:
        return lowering.call(OPERATORS["not_"], (a,))
    if not is_symbolic(a):
        return not a
    if hasattr(a, "__kvhit_set__"):
        raise SpecError("negating a predicate of the max_aligned scan variable is not supported")
    return Term(build().not_(_zv(a)))


@_operator("max_aligned({0}, {1}, {2})",
           "largest positive multiple of a step, at most a bound, satisfying a predicate (else 0)")
def max_aligned(step: int, hi, pred: Callable[[Any], Any]):
    """The largest ``x = k * step`` with ``0 < x <= hi`` and ``pred(x)``, or 0 if there is none.

    This is the one place the policy searches: every lookup in vLLM scans candidate boundaries from the top
    down and stops at the first one its cache can serve. In Python it is that scan; in Z3 the predicate is
    lowered to a finite union of intervals of ``x`` and the maximum is taken in closed form (no quantifier).
    """
    _positive_divisor(step)
    return (_ACTIVE.get() or _PYTHON).max_aligned(step, hi, pred)


# The operator's meaning lives with Held (:func:`kvhit.spec.cache.written`), which imports this module; only
# its generated form is registered here, like passes and stop.
OPERATORS["written"] = Operator("written", "written_cache({0})", "the cache a write side leaves: per spec group "
                                "a Held, or a tuple of Held layers")


def passes(bound: int):
    """The passes of a fixed-point loop: unbounded in Python, ``bound`` unrolled passes in Z3.

    The loop body must guard its state with ``ite`` on a ``done`` flag and leave with ``if stop(done):
    break``; in Z3 ``stop`` never breaks, so the unrolled passes after convergence change nothing.
    """
    return (_ACTIVE.get() or _PYTHON).passes(bound)


def stop(done) -> bool:
    """True when a fixed-point loop may leave (Python); never in Z3 (see :func:`passes`)."""
    if is_symbolic(done):
        return False
    return bool(done)


OPERATORS["passes"] = Operator("passes", "itertools.count()", "passes of a fixed-point loop")
OPERATORS["stop"] = Operator("stop", "{0}", "leave a fixed-point loop once done")

lcm_all = runtime.lcm_all
gcd_all = runtime.gcd_all
