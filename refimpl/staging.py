"""kvhit's staged lowering, GENERATED from spec/ by `make gen` (python -m kvhit.spec.codegen). DO NOT EDIT.

spec/stage.py's stage_hit_tokens and what it runs: spec/terms.py and spec/stage.py, and the functions of
spec/domain.py, spec/sizes.py, spec/cache.py, spec/policy.py, spec/retention.py, spec/api.py they reach that name an operator
(or one that does), copied as the spec writes them; the rest, and the domain types, from refimpl/policy.py.
See kvhit.spec.codegen.generate_staging.
Z3 is imported only if a Z3 term is built, which nothing here does.
spec-sha256: 354c44233853d586b5e8fb63aa334df46d2eb5153aba81fd289ca329167f1ecf
output-sha256: c1e9050dea8d620072e7fb508362fd988139a8e2689b1eaee7c5c0dcdd37204e
"""

from __future__ import annotations
import itertools
import math
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, Callable
from dataclasses import dataclass, replace
from enum import Enum
from . import policy as runtime
from .policy import Kind, Layout, Mode, Rules, Sizes, SpecGroup, Speculation, check_speculation, chunked_group, effective_block, fine_grained_capable, is_simple, lookup_cap, max_cache_hit_length, partial_hash_hits_enabled, pass_bound, policy_rules, prefix_groups


# --------------------------------------------------------------------------------------------------
# spec/terms.py
# The term language the policy is written in.
#
# The policy in :mod:`kvhit.spec.policy` is ordinary Python over a handful of operators. Each operator has
# exactly one entry in :data:`OPERATORS`, which says how it behaves in each of the two lowerings:
#
# * **Python** (the concrete interpreter and the generated ``refimpl``): integers and booleans. The
#   ``source`` template is what :mod:`kvhit.spec.codegen` writes into ``refimpl`` in place of the call.
# * **Z3** (:mod:`kvhit.spec.lower_z3`): the same spec functions are *executed* with :class:`Term` values,
#   which wrap Z3 expressions. Layout quantities (block sizes, windows, DCP size) stay concrete Python ints;
#   request state (prompt length, cache state) is symbolic.
#
# The Python lowering also runs per layout (:mod:`kvhit.spec.stage`): the spec functions executed with the
# layout concrete and the request as staged Python expressions, each operator call written with the same
# ``source`` template, which leaves one function of the request for that layout (what the vLLM adapter
# calls per lookup).
#
# The operators know none of those modules. A lowering other than plain Python subclasses
# :class:`Lowering` and installs itself with :func:`installed` while it runs the spec; the operators
# consult the lowering in force through that one interface (a staged operand, ``max_aligned``, a fixed-point
# loop's ``passes``, a written cache) and never import the module that defines it.
#
# Two rules keep the lowerings honest:
#
# * A symbolic value in a Python ``if``/``and``/``or``/``not`` raises :class:`SymbolicBranchError`
#   (``Term.__bool__``), so a branch can never be silently picked at lowering time. Branch with :func:`ite`.
# * Division is only by a concrete positive integer. Z3's integer division equals Python's ``//`` only for
#   positive divisors, so the obligation "divisor > 0" is discharged when the term is built, not assumed.
# --------------------------------------------------------------------------------------------------

class SpecError(Exception):
    """The spec used the term language in a way neither lowering supports."""

class SymbolicBranchError(SpecError):
    """A symbolic value reached a Python branch; use ``ite`` instead."""

def _z3():
    import z3
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
        self.int_sort = z3.IntSort(self.ctx)
        self.numerals = {}
        self.comparisons = {'lt': z3.Z3_mk_lt, 'le': z3.Z3_mk_le, 'gt': z3.Z3_mk_gt, 'ge': z3.Z3_mk_ge, 'eq': z3.Z3_mk_eq}

    def num(self, v: int):
        """``z3.IntVal(v)``."""
        made = self.numerals.get(v)
        if made is None:
            made = self.numerals[v] = self.z3.IntNumRef(self.z3.Z3_mk_numeral(self.ref, str(v), self.int_sort.ast), self.ctx)
        return made

    def expr(self, v):
        """``v`` as an expression: a Python int becomes a numeral (what z3py's coercion makes of it)."""
        return self.num(v) if isinstance(v, int) and (not isinstance(v, bool)) else v

    def _arith(self, f, a, b):
        a, b = (self.expr(a), self.expr(b))
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
        a, b = (self.expr(a), self.expr(b))
        return self.z3.ArithRef(self.z3.Z3_mk_div(self.ref, a.as_ast(), b.as_ast()), self.ctx)

    def neg(self, a):
        return self.z3.ArithRef(self.z3.Z3_mk_unary_minus(self.ref, a.as_ast()), self.ctx)

    def cmp(self, op: str, a, b):
        """``a < b`` (``op`` "lt"), ``<=`` ("le"), ``>``, ``>=``, ``==`` ("eq") as a boolean."""
        a, b = (self.expr(a), self.expr(b))
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
        a, b = (self.expr(a), self.expr(b))
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
    __slots__ = ('e', 'scale')

    def __init__(self, e, scale: int=1):
        self.e = e
        self.scale = scale

    @property
    def z(self):
        """The Z3 expression of the value."""
        return self.e if self.scale == 1 else build().mul(self.e, self.scale)

    def __bool__(self):
        raise SymbolicBranchError(f'symbolic value {self.z} used in a Python branch; write the choice with ite()')

    def __repr__(self):
        return f'Term({self.z})'

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
            raise SpecError(f'cannot multiply a term by {o!r}')
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
        scale, d = (self.scale // g, d // g)
        if d == 1:
            return Term(self.e, scale)
        return Term(build().div(self.e if scale == 1 else build().mul(self.e, scale), d))

    def __rfloordiv__(self, o):
        raise SpecError(f'division by the symbolic value {self.z}; divisors must be concrete')

    def __mod__(self, o):
        return self - self // o * o

    def __rmod__(self, o):
        raise SpecError(f'modulo by the symbolic value {self.z}; divisors must be concrete')

    def __lt__(self, o):
        return _cmp(self, o, 'lt')

    def __le__(self, o):
        return _cmp(self, o, 'le')

    def __gt__(self, o):
        return _cmp(self, o, 'gt')

    def __ge__(self, o):
        return _cmp(self, o, 'ge')
    __hash__ = None

def _as_term(v) -> Term:
    if isinstance(v, Term):
        return v
    if isinstance(v, bool):
        return Term(_z3().BoolVal(v))
    if isinstance(v, int):
        return Term(build().num(1 if v > 0 else -1), abs(v)) if v else Term(build().num(0), 0)
    return Term(_zv(v))

def _common(a, b):
    """Both values as Z3 expressions over their largest common scale: ``(ea, eb, scale)``."""
    a, b = (_as_term(a), _as_term(b))
    g = math.gcd(a.scale, b.scale)
    ea = a.e if a.scale == g else build().mul(a.e, a.scale // g)
    eb = b.e if b.scale == g else build().mul(b.e, b.scale // g)
    return (ea, eb, g)

def _positive_divisor(d) -> int:
    if isinstance(d, Term):
        raise SpecError(f'division by the symbolic value {d.z}; divisors must be concrete')
    if not isinstance(d, int) or d <= 0:
        raise SpecError(f'division by {d!r}: the divisor must be a positive integer')
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
    raise SpecError(f'cannot lower {v!r} to Z3')

def _cmp(a, b, op):
    for v in (a, b):
        hook = getattr(v, '__kvhit_compare__', None)
        if hook is not None and (not isinstance(v, Term)):
            return hook(a, b, op)
    za, zb, _ = _common(a, b)
    return Term(build().cmp(op, za, zb))

def is_symbolic(*vals) -> bool:
    return any((isinstance(v, Term) or hasattr(v, '__kvhit_set__') for v in vals))

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

    def call(self, op: 'Operator', args: tuple):
        """Operator ``op`` applied to ``args``, some of them this lowering's values (see :meth:`owns`)."""
        raise SpecError(f'{type(self).__name__} does not lower {op.name}')

    def max_aligned(self, step: int, hi, pred):
        """:func:`max_aligned`, its divisor already checked: in Python, the downward scan."""
        if is_symbolic(hi):
            raise SpecError(f'max_aligned up to the symbolic bound {hi!r} outside the Z3 lowering (kvhit.spec.lower_z3.lowering())')
        return runtime.max_aligned(step, hi, pred)

    def passes(self, bound: int):
        """:func:`passes`: in Python, unbounded."""
        return itertools.count()

    def written(self, groups: tuple):
        """:func:`written` of symbolic descriptions; ``None``: read them with the plain loops."""
        return None
_ACTIVE: ContextVar[Lowering | None] = ContextVar('kvhit_spec_lowering', default=None)
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

@_operator('({1} if {0} else {2})', 'if-then-else; both branches must have the same shape')
def ite(cond, then, other):
    """``then`` if ``cond`` else ``other``. Tuples are chosen element-wise in Z3."""
    elements = (*then, *other) if isinstance(then, tuple) else ()
    if (lowering := _owner(cond, then, other, *elements)) is not None:
        return lowering.call(OPERATORS['ite'], (cond, then, other))
    if not is_symbolic(cond):
        return then if cond else other
    if isinstance(then, tuple):
        return tuple((ite(cond, t, o) for t, o in zip(then, other, strict=True)))
    z3 = _z3()
    if isinstance(then, bool) or isinstance(other, bool) or z3.is_bool(_zv(then)):
        return Term(build().ite(_zv(cond), _zv(then), _zv(other)))
    a, b, g = _common(then, other)
    return Term(build().ite(_zv(cond), a, b), g)

@_operator('min({0}, {1})', 'minimum of two integers')
def min_(a, b):
    if (lowering := _owner(a, b)) is not None:
        return lowering.call(OPERATORS['min_'], (a, b))
    if not is_symbolic(a, b):
        return min(a, b)
    return ite(a <= b, a, b)

@_operator('max({0}, {1})', 'maximum of two integers')
def max_(a, b):
    if (lowering := _owner(a, b)) is not None:
        return lowering.call(OPERATORS['max_'], (a, b))
    if not is_symbolic(a, b):
        return max(a, b)
    return ite(a >= b, a, b)

@_operator('(-(-({0}) // ({1})))', 'ceiling division by a concrete positive integer')
def cdiv(a, b):
    _positive_divisor(b)
    return -(-a // b)

@_operator('(({0}) // ({1}) * ({1}))', 'round down to a multiple of a concrete positive integer')
def floor_to(a, unit):
    _positive_divisor(unit)
    return a // unit * unit

@_operator('(({0}) == ({1}))', 'integer equality')
def eq(a, b):
    if (lowering := _owner(a, b)) is not None:
        return lowering.call(OPERATORS['eq'], (a, b))
    if not is_symbolic(a, b):
        return a == b
    return _cmp(a, b, 'eq')

def _connective(name: str, a, b, decides: bool):
    """``and_`` (``decides`` False) or ``or_`` (``decides`` True) of two operands: as in Python on concrete
    ones (an operand equal to ``decides`` decides it); predicate sets of a scan variable combine as sets."""
    if (lowering := _owner(a, b)) is not None:
        return lowering.call(OPERATORS[name], (a, b))
    if not is_symbolic(a, b):
        return a or b if decides else a and b
    if a is decides or b is decides:
        return decides
    op = 'or' if decides else 'and'
    hook = getattr(a, '__kvhit_set__', None) or getattr(b, '__kvhit_set__', None)
    if hook is not None:
        return hook(op, a, b)
    return Term((build().or_ if decides else build().and_)(_zv(a), _zv(b)))

@_operator('({0} and {1})', 'conjunction')
def and_(a, b):
    return _connective('and_', a, b, decides=False)

@_operator('({0} or {1})', 'disjunction')
def or_(a, b):
    return _connective('or_', a, b, decides=True)

@_operator('(not {0})', 'negation (not of a predicate on a scan variable)')
def not_(a):
    if (lowering := _owner(a)) is not None:
        return lowering.call(OPERATORS['not_'], (a,))
    if not is_symbolic(a):
        return not a
    if hasattr(a, '__kvhit_set__'):
        raise SpecError('negating a predicate of the max_aligned scan variable is not supported')
    return Term(build().not_(_zv(a)))

@_operator('max_aligned({0}, {1}, {2})', 'largest positive multiple of a step, at most a bound, satisfying a predicate (else 0)')
def max_aligned(step: int, hi, pred: Callable[[Any], Any]):
    """The largest ``x = k * step`` with ``0 < x <= hi`` and ``pred(x)``, or 0 if there is none.

    This is the one place the policy searches: every lookup in vLLM scans candidate boundaries from the top
    down and stops at the first one its cache can serve. In Python it is that scan; in Z3 the predicate is
    lowered to a finite union of intervals of ``x`` and the maximum is taken in closed form (no quantifier).
    """
    _positive_divisor(step)
    return (_ACTIVE.get() or _PYTHON).max_aligned(step, hi, pred)
OPERATORS['written'] = Operator('written', 'written_cache({0})', 'the cache a write side leaves: per spec group a Held, or a tuple of Held layers')

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
OPERATORS['passes'] = Operator('passes', 'itertools.count()', 'passes of a fixed-point loop')
OPERATORS['stop'] = Operator('stop', '{0}', 'leave a fixed-point loop once done')
lcm_all = runtime.lcm_all
gcd_all = runtime.gcd_all


# --------------------------------------------------------------------------------------------------
# spec/stage.py
# The staged lowering: the read side specialised to one layout, as Python source.
#
# The third way the spec's functions run, beside the concrete interpreter (and the ``refimpl`` codegen
# writes from it) and the Z3 lowering. As in the Z3 lowering, the layout (:class:`Sizes`, the policy's
# :class:`Rules`) is concrete and the request is symbolic; here a symbolic value is a :class:`Code`, the
# Python source of an expression. Executing :func:`kvhit.spec.policy.hit_tokens` on ``Code`` values runs
# every Python branch on the layout once, at staging time, and leaves only what depends on the request: one
# function of ``(n_tokens, cache)`` without the per-group loops, kind dispatch and attribute lookups of the
# generic code. An engine calls it once per lookup, so that is where the time goes (:func:`stage_hit_tokens`).
#
# What keeps it the same function as the refimpl's:
#
# * Operators lower through the same :data:`kvhit.spec.terms.OPERATORS` source templates codegen uses
#   (``ite`` is ``(a if c else b)``, ``and_`` is ``(a and b)``: the operands a branch does not take are not
#   evaluated, as in ``refimpl``); arithmetic and comparisons lower to the Python operators.
# * A symbolic value in a Python ``if`` raises :class:`kvhit.spec.terms.SymbolicBranchError`, as in Z3.
# * A value used more than once is computed once, into a local, only when that cannot make the function
#   ask the cache anything ``refimpl`` would not ask (:func:`_emit`): pure arithmetic (which cannot raise:
#   divisors are concrete and positive), or a cache query every evaluation of the function makes.
# * The cache's two primitive questions stay calls on the cache object the function is given
#   (``cache.has(k, x)``, ``cache.run_from(k, start, unit, limit)``); ``window`` is unrolled into ``has``
#   calls (:meth:`StagedCache.window`, the loop of :meth:`kvhit.spec.cache.CacheState.window` with its
#   bounds known) and ``last_held`` is the spec's own scan (:func:`kvhit.spec.cache.scan_last_held`).
#   ``tests/properties/test_staged.py`` checks the staged function against ``refimpl.hit_tokens`` on random
#   caches: on random layouts under every policy that stages, and on every catalogue layout under the
#   reference.
#
# A staged function does not track the cache's ``max_query``.
# --------------------------------------------------------------------------------------------------

class Code:
    """A symbolic value of the staged lowering: a node of an expression.

    Attributes:
        fmt: the expression's Python source with ``{0}``, ``{1}``, ... for its operands.
        args: the operands (``Code``, ``int`` or ``bool``).
        lazy: indices of operands the expression may not evaluate (a branch of ``ite``, the second
            operand of ``and``/``or``, a lambda's body).
        asks: whether evaluating it may ask the cache.
        bound: lambda parameters it depends on (it cannot be computed outside their lambda).
        scan: for a ``max_aligned`` call, ``(x, body)``: its scan variable and the predicate's body.
    """
    __slots__ = ('fmt', 'args', 'lazy', 'asks', 'bound', 'scan')

    def __init__(self, fmt: str, args: tuple=(), lazy: frozenset=frozenset(), asks: bool=False, bound: frozenset=frozenset()) -> None:
        self.fmt, self.args, self.lazy = (fmt, args, lazy)
        self.asks = asks or any((isinstance(a, Code) and a.asks for a in args))
        self.bound = bound.union(*(a.bound for a in args if isinstance(a, Code)))
        self.scan = None

    def __bool__(self):
        raise SymbolicBranchError(f'staged value {_preview(self)} used in a Python branch; write the choice with ite()')

    def __repr__(self):
        return f'Code({_preview(self)})'

    def __format__(self, spec):
        raise SpecError(f'staged value {_preview(self)} formatted into a string; pass it as an operand')
    __hash__ = None

    def __add__(self, o):
        if isinstance(o, int) and (not isinstance(o, bool)) and (o < 0):
            return _binary('-', self, -o)
        return self if _is_int(o, 0) else _binary('+', self, o)

    def __radd__(self, o):
        return self if _is_int(o, 0) else _binary('+', o, self)

    def __sub__(self, o):
        return self if _is_int(o, 0) else _binary('-', self, o)

    def __rsub__(self, o):
        return _binary('-', o, self)

    def __mul__(self, o):
        if _is_int(o, 1):
            return self
        if _is_int(o, 0):
            return 0
        return _binary('*', self, o)
    __rmul__ = __mul__

    def __neg__(self):
        return Code('(-{0})', (self,))

    def __floordiv__(self, o):
        _concrete_divisor(o)
        return self if o == 1 else _binary('//', self, o)

    def __rfloordiv__(self, o):
        raise SpecError(f'division by the staged value {_preview(self)}; divisors must be concrete')

    def __mod__(self, o):
        _concrete_divisor(o)
        return 0 if o == 1 else _binary('%', self, o)

    def __rmod__(self, o):
        raise SpecError(f'modulo by the staged value {_preview(self)}; divisors must be concrete')

    def __lt__(self, o):
        return _binary('<', self, o)

    def __le__(self, o):
        return _binary('<=', self, o)

    def __gt__(self, o):
        return _binary('>', self, o)

    def __ge__(self, o):
        return _binary('>=', self, o)

def _is_int(v, value: int) -> bool:
    return isinstance(v, int) and (not isinstance(v, bool)) and (v == value)

def _concrete_divisor(d) -> None:
    if isinstance(d, Code) or not isinstance(d, int) or isinstance(d, bool) or (d <= 0):
        raise SpecError(f'division by {d!r}: the divisor must be a concrete positive integer')

def _check_operand(v):
    if isinstance(v, Code) or isinstance(v, int):
        return v
    raise SpecError(f'cannot stage the operand {v!r} (only integers, booleans and staged values)')

def _binary(op: str, a, b) -> Code:
    return Code(f'({{0}} {op} {{1}})', (_check_operand(a), _check_operand(b)))

def _preview(code: Code, limit: int=120) -> str:
    text = _render(code, {})
    return text if len(text) <= limit else text[:limit] + '...'

class StagedLowering(Lowering):
    """The operators of :mod:`kvhit.spec.terms` while :func:`stage` runs the spec: a call with a staged
    operand becomes the node its ``source`` template makes (:func:`staged_call`), and ``max_aligned``
    is staged even at a concrete bound (its predicate may ask the cache). Each :func:`stage` installs a
    fresh one, so its lambda parameters are named ``x0``, ``x1``, ... from the start."""

    def __init__(self) -> None:
        self.params = itertools.count()

    def owns(self, vals) -> bool:
        return any((isinstance(v, Code) for v in vals))

    def call(self, op, args: tuple):
        return staged_call(op, args, self.params)

    def max_aligned(self, step: int, hi, pred):
        return staged_call(OPERATORS['max_aligned'], (step, hi, pred), self.params)

def staged_call(op, args: tuple, params) -> Any:
    """An operator of ``terms`` (``op``, an :class:`kvhit.spec.terms.Operator`) called on staged values:
    the node its ``source`` template makes of them. Operands a template puts in a branch (``{1}`` and
    ``{2}`` of ``ite``, ``{1}`` of ``and``/``or``) are lazy; ``max_aligned``'s predicate becomes a lambda
    whose parameter is named by the next number of ``params``."""
    name = op.name
    if name == 'max_aligned':
        step, hi, pred = args
        var = f'x{next(params)}'
        x = Code(var, bound=frozenset([var]))
        body = pred(x)
        if not isinstance(body, Code):
            body = bool(body)
        fn = Code(f'(lambda {var}: {{0}})', (body,), lazy=frozenset([0]))
        fn.bound = fn.bound - {var}
        scan = Code(op.source, (step, _check_operand(hi), fn))
        scan.scan = (var, body)
        return scan
    if name in ('and_', 'or_'):
        a, b = args
        decides = name == 'or_'
        if isinstance(a, bool):
            return a if a is decides else b
        if isinstance(b, bool):
            return b if b is decides else a
        return Code(op.source, (_check_operand(a), _check_operand(b)), lazy=frozenset([1]))
    if name == 'ite':
        cond, then, other = args
        if isinstance(then, tuple):
            return tuple((staged_call(op, (cond, t, o), params) for t, o in zip(then, other, strict=True)))
        return Code(op.source, tuple((_check_operand(a) for a in args)), lazy=frozenset([1, 2]))
    return Code(op.source, tuple((_check_operand(a) for a in args)))

def _group(k) -> int:
    if not isinstance(k, int) or isinstance(k, bool):
        raise SpecError(f'a staged cache query needs a concrete spec group, got {k!r}')
    return k

class StagedCache:
    """The cache a staged function is given, as seen while staging: its queries become calls on it."""

    def __init__(self, name: str='cache') -> None:
        self.name = name

    def has(self, k, x):
        return Code(f'{self.name}.has({_group(k)}, {{0}})', (_check_operand(x),), asks=True)

    def run_from(self, k, start, unit, limit):
        return Code(f'{self.name}.run_from({_group(k)}, {{0}}, {{1}}, {{2}})', tuple((_check_operand(v) for v in (start, unit, limit))), asks=True)

    def window(self, k, x, unit, before, after):
        """:meth:`kvhit.spec.cache.CacheState.window` with ``unit``, ``before`` and ``after`` concrete: its
        loop over ``j`` in ``[max(0, i - before), i + after)``, ``i = x // unit``, unrolled as ``j = i + d``
        for each ``d`` in ``[-before, after)``: block ``j`` is cached, or ``j < 0`` (not in the loop)."""
        if not all((isinstance(v, int) and (not isinstance(v, bool)) for v in (unit, before, after))):
            raise SpecError('a staged window needs a concrete unit and block counts')
        i = x // unit
        ok = True
        for d in range(-before, after):
            held = Code('({0} or {1})', (i + d < 0, self.has(k, (i + (d + 1)) * unit)), lazy=frozenset([1]))
            ok = held if ok is True else Code('({0} and {1})', (ok, held), lazy=frozenset([1]))
        return ok

    def last_held(self, k, step, lo, hi, unit, before, after):
        return scan_last_held(self, k, step, lo, hi, unit, before, after)

def _render(node, names: dict) -> str:
    if not isinstance(node, Code):
        return repr(node)
    name = names.get(id(node))
    if name is not None:
        return name
    return node.fmt.format(*(_render(a, names) for a in node.args))

def _emit(outputs: tuple, params: tuple[str, ...], fn_name: str) -> str:
    """The source of ``def fn_name(*params): return outputs``.

    A node used more than once is computed once, into a local at the top of the function, when it does
    not depend on a lambda parameter and either cannot ask the cache or is evaluated by every call (it is
    reachable from the outputs through operands that are always evaluated). Everything else stays inline,
    where it is used: the function asks the cache nothing ``refimpl`` does not ask (a value the spec
    assigns and then uses only in a branch, ``refimpl`` asks at the assignment, this function in the
    branch).
    """
    uses: dict[int, int] = {}
    nodes: dict[int, Code] = {}
    strict: set[int] = set()
    order: list[int] = []

    def visit(node, is_strict: bool) -> None:
        if not isinstance(node, Code):
            return
        key = id(node)
        uses[key] = uses.get(key, 0) + 1
        first = key not in nodes
        nodes[key] = node
        newly_strict = is_strict and key not in strict
        if is_strict:
            strict.add(key)
        if first or newly_strict:
            for i, a in enumerate(node.args):
                visit(a, is_strict and i not in node.lazy)
        if first:
            order.append(key)
    for out in outputs:
        visit(out, True)
    names: dict[int, str] = {}
    lines = []
    for key in order:
        node = nodes[key]
        name = f't{len(names)}'
        if node.scan is not None and key in strict and (not node.bound):
            step, hi, _ = node.args
            x, body = node.scan
            lines += [f'    {x} = {_render(hi, names)} // {step} * {step}', f'    while {x} > 0 and not {_render(body, names)}:', f'        {x} -= {step}', f'    {name} = {x} if {x} > 0 else 0']
            names[key] = name
        elif uses[key] > 1 and node.args and (not node.bound) and (not node.asks or key in strict):
            lines.append(f'    {name} = {_render(node, names)}')
            names[key] = name
    body = '\n'.join(lines + [f"    return ({', '.join((_render(o, names) for o in outputs))},)"])
    return f"def {fn_name}({', '.join(params)}):\n{body}\n"

def stage(fn: Callable, *args, name: str='staged', **kwargs) -> tuple[str, Callable]:
    """``fn(cache, *args)`` staged on a symbolic prompt length and cache: ``(source, function)`` where
    ``function(n_tokens, cache)`` returns what ``fn`` returns, as a tuple. ``args`` may contain the
    marker :data:`N` for the prompt length."""
    n = Code('n_tokens')
    cache = StagedCache()
    args = tuple((n if a is N else a for a in args))
    if active() is not None:
        raise SpecError(f'staging inside another lowering ({type(active()).__name__})')
    with installed(StagedLowering()):
        out = fn(cache, *args, **kwargs)
    outputs = out if isinstance(out, tuple) else (out,)
    source = _emit(tuple(outputs), ('n_tokens', 'cache'), name)
    namespace = {'max_aligned': runtime.max_aligned}
    exec(compile(source, f'<kvhit staged {name}>', 'exec'), namespace)
    return (source, namespace[name])
N = object()

def stage_hit_tokens(layout, speculation, policy: str='reference') -> tuple[str, Callable]:
    """:func:`kvhit.spec.policy.hit_tokens` of one layout and speculative setting under a policy, staged:
    ``(source, hit)`` where ``hit(n_tokens, cache)`` is ``refimpl.hit_tokens(cache, sizes, n_tokens, rules)``
    for that layout's sizes and the policy's rules. ``layout`` and ``speculation`` are the domain types of
    the module that runs it: the spec's here, the refimpl's in ``kvhit.refimpl.staging`` (this function, as
    codegen copies it: what the adapter stages with).

    Raises:
        TypeError: ``layout`` or ``speculation`` is not this module's type;
        SpecError: the policy's hit cannot be staged (vLLM's fixed-point loop branches on the cache: only
            policies whose hit is one scan stage, ``reference`` among them); ValueError: the spec rejects
            the layout.
    """
    for value, cls in ((layout, Layout), (speculation, Speculation)):
        if not isinstance(value, cls):
            raise TypeError(f'stage_hit_tokens needs {cls.__module__}.{cls.__name__}, got {type(value).__module__}.{type(value).__name__} (kvhit.convert moves a value between the spec and refimpl)')
    rules = policy_rules(policy)
    sizes = derive_sizes(layout, speculation, rules.scale_replicated)
    return stage(hit_tokens, sizes, N, rules, name='hit_tokens')


# --------------------------------------------------------------------------------------------------
# spec/sizes.py
# The functions of spec/sizes.py the staged hit reaches that name an operator (or call one that does), as the spec writes them.
# --------------------------------------------------------------------------------------------------

def derive_sizes(layout: Layout, speculation: Speculation, scale_replicated: bool=False) -> Sizes:
    """All derived sizes of a layout, validated.

    vLLM: ``resolve_kv_cache_block_sizes`` (S, h), ``partial_hash_hits_enabled`` and
    ``HybridKVCacheCoordinator._cache_hit_alignment_tokens`` (A), ``verify_and_split_kv_cache_groups``
    (spec groups), ``KVCacheCoordinator.__init__`` (eagle groups, with the all-groups fallback),
    ``eagle_proof_margin`` (margins).

    Raises:
        ValueError: block sizes that the hash unit does not divide, a ``prefix_match_unit`` a single group
            cannot use, or a scheduler block shorter than the prefill lookahead.
    """
    blocks = tuple((effective_block(g, layout.dcp, scale_replicated) for g in layout.groups))
    unitary = len(layout.groups) == 1
    scheduler_block = lcm_all(blocks)
    if unitary:
        if layout.prefix_match_unit not in (None, blocks[0]):
            raise ValueError(f'prefix_match_unit {layout.prefix_match_unit} must equal the block {blocks[0]} of a single-group layout')
        h = blocks[0]
        partial = False
        alignment = blocks[0]
    else:
        h = layout.prefix_match_unit if layout.prefix_match_unit is not None else gcd_all(blocks)
        for i, b in enumerate(blocks):
            if b % h != 0:
                raise ValueError(f'group {i}: effective block {b} is not a multiple of the hash unit {h}')
        partial = partial_hash_hits_enabled(layout, blocks, h)
        alignment = h if partial else scheduler_block
    flagged = any((g.eagle for g in layout.groups))
    merged = []
    for i, (g, b) in enumerate(zip(layout.groups, blocks)):
        drops = speculation.drop and (g.eagle or not flagged)
        key = (g.kind, b, g.window, g.chunk, g.dcp_sharded, g.tokens_per_state)
        for j, (other_key, members, other_drops) in enumerate(merged):
            if other_key == key:
                merged[j] = (key, members + (i,), other_drops or drops)
                break
        else:
            merged.append((key, (i,), drops))
    groups = []
    for (kind, b, window, chunk, _, _), members, drops in merged:
        fine = alignment < b and b % alignment == 0 and fine_grained_capable(kind)
        margin = h if partial and fine_grained_capable(kind) and (b > h) else b
        groups.append(SpecGroup(kind=kind, block=b, window=window, chunk=chunk, members=members, drops=drops, margin=margin, fine=fine))
    groups.sort(key=lambda sg: sg.kind is not Kind.FULL)
    chunked = [sg for sg in groups if sg.kind is Kind.CHUNKED]
    if len(chunked) > 1:
        raise ValueError('chunked local attention beside another chunked-local spec is not modelled by the spec (it models one chunked-local spec group, alone or beside full-attention groups)')
    if chunked and (not unitary):
        if speculation.mode is not Mode.NONE:
            raise ValueError('EAGLE-family speculation with chunked local attention beside other groups is not a layout vLLM builds (it turns its hybrid KV-cache manager off for chunked local attention with EAGLE or MTP, and every layer becomes full attention)')
        if chunked[0].block != alignment:
            raise ValueError(f'chunked-local block {chunked[0].block} differs from the hit alignment {alignment} (vLLM asserts they are equal)')
    for sg in groups:
        if sg.drops and sg.kind is Kind.CHUNKED:
            raise ValueError('EAGLE drop with chunked local attention is not supported (vLLM asserts drop_eagle_block is False for chunked local attention)')
    for i, g in enumerate(layout.groups):
        if alignment % g.tokens_per_state != 0:
            raise ValueError(f'group {i}: hit alignment {alignment} is not a multiple of its tokens_per_state {g.tokens_per_state} (vLLM raises the same)')
    if (flagged or speculation.drop) and speculation.prefill_lookahead > scheduler_block:
        raise ValueError(f'scheduler block {scheduler_block} is shorter than the prefill lookahead {speculation.prefill_lookahead} (vLLM raises the same)')
    cap_group = None
    for k, sg in enumerate(groups):
        if layout.aux_cap_group in sg.members:
            cap_group = k
    return Sizes(scheduler_block=scheduler_block, hash_block=h, partial_hits=partial, alignment=alignment, effective_blocks=blocks, groups=tuple(groups), unitary=unitary, hash_lookahead=speculation.hash_lookahead, prefill_lookahead=speculation.prefill_lookahead, drop=speculation.drop, dcp=layout.dcp, config_block=min((g.block_size for g in layout.groups)), cap_group=cap_group)

def num_hashes(sizes: Sizes, n_tokens):
    """``|H|``: block hashes a request of ``n_tokens`` has. With lookahead hashes a block's hash waits
    for the ``L`` tokens after it. vLLM: ``get_request_block_hasher``."""
    return max_(0, (n_tokens - sizes.hash_lookahead) // sizes.hash_block)

def hash_reach(sizes: Sizes, n_tokens):
    """Tokens the hashes cover: ``|H| * h``; no lookup may read a boundary past it."""
    return num_hashes(sizes, n_tokens) * sizes.hash_block


# --------------------------------------------------------------------------------------------------
# spec/cache.py
# The functions of spec/cache.py the staged hit reaches that name an operator (or call one that does), as the spec writes them.
# --------------------------------------------------------------------------------------------------

def scan_last_held(cache, k, step, lo, hi, unit, before, after):
    """What ``last_held`` means, for every cache state: scan the multiples of ``step`` down from ``hi`` for
    the first above ``lo`` whose window is cached. The Z3 caches lower this scan; a cache state that knows
    its own structure may answer ``last_held`` without it, with the same result and the same ``max_query``
    (the scan asks its highest candidate first)."""
    return max_aligned(step, hi, lambda x: and_(x > lo, cache.window(k, x, unit, before, after)))


# --------------------------------------------------------------------------------------------------
# spec/policy.py
# The functions of spec/policy.py the staged hit reaches that name an operator (or call one that does), as the spec writes them.
# --------------------------------------------------------------------------------------------------

def full_attention_lookup(cache, sizes: Sizes, k, hashes, max_length, drop, rules: Rules):
    """vLLM: ``FullAttentionManager.find_longest_cache_hit``.

    Order: the leading run of cached blocks (at most ``M // b`` blocks and the hashes), then, when the group
    is looked up at hash granularity, the highest cached boundary inside the next block up to ``M``; then
    the drop of ``min(A, b)``; then alignment down to ``A``. With ``probe_past_max`` the run also reads
    the block that holds ``M`` and the probe the whole next block (within the hashes), and the hit is then
    capped at ``M`` before the drop (which then leaves at least 0): a block or boundary cached past ``M``
    vouches for every token before it (hashes are prefix-chained), as the reference's extent says.
    """
    sg = sizes.groups[k]
    b = sg.block
    a = sizes.alignment
    limit = min_(cdiv(max_length, b) if rules.probe_past_max else max_length // b, hashes * sizes.hash_block // b)
    run = cache.run_from(k, start=0, unit=b, limit=limit)
    hit = run * b
    reach = limit * b
    if sg.fine:
        per_block = b // a
        probe = run * per_block + per_block - 1
        if not rules.probe_past_max:
            probe = min_(probe, max_length // a)
        top = min_(probe, hashes * sizes.hash_block // a)
        partial = cache.last_held(k, step=a, lo=hit, hi=top * a, unit=a, before=1, after=0)
        hit = ite(partial > 0, partial, hit)
        reach = max_(reach, top * a)
    dropped = hit - min(a, b)
    if rules.probe_past_max:
        hit = min_(hit, max_length)
        dropped = max_(hit - min(a, b), 0)
    hit = ite(and_(drop, hit > 0), dropped, hit)
    return (floor_to(hit, a), reach)

def sliding_window_lookup(cache, sizes: Sizes, k, hashes, max_length, drop, rules: Rules):
    """vLLM: ``SlidingWindowManager.find_longest_cache_hit`` (DCP 1).

    Scans blocks from ``M // b`` down for the highest run of ``ceil((W - 1) / b)`` cached blocks (one more,
    the EAGLE peek, when dropping) whose right edge passes the alignment gate (the edge, or when dropping
    the edge minus the peek block, is a multiple of ``A``); the hit is that edge, minus the peek block when
    dropping. With no such run (short prompts) it takes the run from block 0, aligns it, and, when
    dropping, pops one block and aligns again (with ``drop_before_align``: pops, then aligns). It reads from block ``M // b - 1`` without checking the
    hashes: ``reach`` can pass ``|H| * h``, which raises ``IndexError`` in vLLM.
    """
    sg = sizes.groups[k]
    b = sg.block
    a = sizes.alignment
    need = cdiv(sg.window - 1, b)
    top = max_length // b * b
    found_keep = cache.last_held(k, step=a, lo=need * b - 1, hi=top, unit=b, before=need, after=0)
    run = cache.run_from(k, start=0, unit=b, limit=max_length // b) * b
    short_keep = floor_to(run, a)
    keep = ite(found_keep > 0, found_keep, short_keep)
    if drop is False:
        return (keep, top)
    found_drop = cache.last_held(k, step=a, lo=need * b - 1, hi=top - b, unit=b, before=need, after=1)
    if rules.drop_before_align:
        short_drop = ite(run >= b, floor_to(run - b, a), 0)
    else:
        gated = floor_to(ite(run >= b, floor_to(run - b, a) + b, 0), a)
        short_drop = ite(gated > 0, floor_to(gated - b, a), 0)
    dropped = ite(found_drop > 0, found_drop, short_drop)
    return (ite(drop, dropped, keep), top)

def mamba_lookup(cache, sizes: Sizes, k, hashes, max_length, drop, rules: Rules):
    """vLLM: ``MambaManager.find_longest_cache_hit``: the highest single cached state at an aligned
    boundary at most ``M``; at hash granularity (capped by the hashes) when partial hits are on. It never
    drops. Without partial hits it reads from block ``M // b - 1`` without checking the hashes."""
    sg = sizes.groups[k]
    a = sizes.alignment
    if sg.fine:
        top = min_(max_length // a, hashes * sizes.hash_block // a) * a
        return (cache.last_held(k, step=a, lo=0, hi=top, unit=a, before=1, after=0), top)
    top = max_length // sg.block * sg.block
    return (cache.last_held(k, step=a, lo=0, hi=top, unit=sg.block, before=1, after=0), top)

def skipped_blocks(sg, max_length):
    """The blocks a chunked-local lookup at ``M`` counts as computed without reading them: those before the
    chunk that holds ``M`` (vLLM ``local_attention_start_idx // block_size``; null blocks, never computed)."""
    return ite(max_length > 0, floor_to(max_length, sg.chunk), 0) // sg.block

def chunked_local_lookup(cache, sizes: Sizes, k, hashes, max_length, drop, rules: Rules):
    """vLLM: ``ChunkedLocalAttentionManager.find_longest_cache_hit``: blocks before the chunk that holds
    ``M`` count as computed; then the run of cached blocks from that chunk's first block up to ``M // b``.
    Reads without checking the hashes."""
    sg = sizes.groups[k]
    b = sg.block
    start = skipped_blocks(sg, max_length)
    end = max_length // b
    run = cache.run_from(k, start=start, unit=b, limit=end)
    reach = ite(start < end, min_(start + run + 1, end) * b, 0)
    return ((start + run) * b, reach)

def lookup(cache, sizes: Sizes, k, hashes, max_length, drop, rules: Rules):
    """The lookup of spec group ``k``'s kind (vLLM: ``manager_cls.find_longest_cache_hit``)."""
    kind = sizes.groups[k].kind
    if kind is Kind.FULL:
        return full_attention_lookup(cache, sizes, k, hashes, max_length, drop, rules)
    if kind is Kind.SWA:
        return sliding_window_lookup(cache, sizes, k, hashes, max_length, drop, rules)
    if kind is Kind.MAMBA:
        return mamba_lookup(cache, sizes, k, hashes, max_length, drop, rules)
    return chunked_local_lookup(cache, sizes, k, hashes, max_length, drop, rules)

def unitary_hit_tokens(cache, sizes: Sizes, n_tokens, rules: Rules):
    """vLLM: ``UnitaryKVCacheCoordinator.find_longest_cache_hit``: one lookup at ``M = N - 1`` with
    alignment = the block, dropping when the group is an EAGLE group. No eagle margin (``unitary_margin``:
    the lookup peeks one drop unit past ``M``, within the hashes, before it drops), no cap by the hashes
    (``cap_at_hashes``: ``M`` at most ``|H| * h``)."""
    hashes = num_hashes(sizes, n_tokens)
    sg = sizes.groups[0]
    bound = capped_length(cache, sizes, n_tokens, rules)
    if sg.drops and sg.kind is not Kind.MAMBA and rules.unitary_margin:
        bound = min_(bound + sg.margin, hash_reach(sizes, n_tokens))
    hit, reach = lookup(cache, sizes, 0, hashes, bound, sg.drops, rules)
    return (hit, reach, hit, True)

def max_length_within_hashes(sizes: Sizes, n_tokens, rules: Rules):
    """Where vLLM's coordinators start: ``M`` (:func:`max_cache_hit_length`), with ``cap_at_hashes`` at
    most ``|H| * h``; the reference's cap (:func:`reference_hit_tokens`) is always within the hashes."""
    m = max_cache_hit_length(n_tokens, rules)
    if rules.cap_at_hashes or rules.declarative:
        return min_(m, hash_reach(sizes, n_tokens))
    return m

def capped_top(cache, sizes: Sizes, bound, covered):
    """``bound``, at most :func:`lookup_cap` on a layout whose lookups are capped (``covered``: the tokens
    the hashes cover)."""
    if sizes.cap_group is None:
        return bound
    return min_(bound, lookup_cap(cache, sizes, covered))

def capped_length(cache, sizes: Sizes, n_tokens, rules: Rules):
    """Where vLLM's coordinators start on ``cache``: :func:`max_length_within_hashes` within the cap
    (:func:`capped_top`)."""
    return capped_top(cache, sizes, max_length_within_hashes(sizes, n_tokens, rules), hash_reach(sizes, n_tokens))

def pass_lookup(cache, sizes: Sizes, k, hashes, c, drop, rules: Rules):
    """Spec group ``k``'s lookup in a pass of vLLM's loop at candidate ``c``: ``(length, reach)``. With
    ``drop`` (the group drops this pass), an EAGLE group other than Mamba peeks one margin past ``c``
    (capped by the hashes) and pops it."""
    sg = sizes.groups[k]
    bound = c
    if sg.drops and sg.kind is not Kind.MAMBA and rules.eagle_margin:
        peek = c + sg.margin
        if rules.peek_within_hashes:
            peek = min_(peek, hashes * sizes.hash_block)
        bound = ite(drop, peek, c)
    return lookup(cache, sizes, k, hashes, bound, and_(drop, rules.pop_after_peek), rules)

def hybrid_pass(cache, sizes: Sizes, hashes, hit_length, verified, lengths, first, rules: Rules):
    """One pass of vLLM's ``HybridKVCacheCoordinator.find_longest_cache_hit`` loop.

    Spec groups in order (full attention first). A full-attention group is looked up on the first pass
    only; later passes trim the candidate to its length (its cache is downward-closed). Any other group is
    looked up at the candidate; an EAGLE group not yet verified peeks one margin past it (capped by the
    hashes) and drops. A drop marks the group verified; a shrink by a lookup that did not drop clears
    every verification (with ``reverify_after_shrink``, every shrink does, before the drop's own mark).

    Returns:
        ``(candidate, verified, lengths, longest, reach)`` after the pass.
    """
    c = hit_length
    verified = list(verified)
    lengths = list(lengths)
    longest = 0
    reach = 0
    for k, sg in enumerate(sizes.groups):
        if sg.kind is Kind.FULL and (not first):
            c = min_(c, lengths[k])
            continue
        drop = sg.drops
        if rules.drop_once:
            drop = and_(sg.drops, not_(verified[k]))
        n, r = pass_lookup(cache, sizes, k, hashes, c, drop, rules)
        cleared = n < c if rules.reverify_after_shrink else and_(not_(drop), n < c)
        verified = [ite(cleared, False, v) for v in verified]
        verified[k] = or_(verified[k], drop)
        c = n
        lengths[k] = n
        longest = max_(longest, c)
        reach = max_(reach, r)
    return (c, tuple(verified), tuple(lengths), longest, reach)

def hybrid_hit_tokens(cache, sizes: Sizes, n_tokens, rules: Rules):
    """vLLM: ``HybridKVCacheCoordinator.find_longest_cache_hit``: passes of :func:`hybrid_pass` from
    ``M = N - 1`` until a pass no longer lowers the candidate, or after one pass when the layout is two
    spec groups led by full attention (the ``simple`` case)."""
    hashes = num_hashes(sizes, n_tokens)
    simple = is_simple(sizes)
    hit_length = capped_length(cache, sizes, n_tokens, rules)
    verified = tuple((False for _ in sizes.groups))
    lengths = tuple((0 for _ in sizes.groups))
    longest = 0
    reach = 0
    done = False
    for index in passes(pass_bound(sizes)):
        c, new_verified, new_lengths, new_longest, new_reach = hybrid_pass(cache, sizes, hashes, hit_length, verified, lengths, index == 0, rules)
        converged = or_(c >= hit_length, simple)
        hit_length, verified, lengths, longest, reach = ite(done, (hit_length, verified, lengths, longest, reach), (ite(c >= hit_length, hit_length, c), new_verified, new_lengths, max_(longest, new_longest), max_(reach, new_reach)))
        done = or_(done, converged)
        if stop(done):
            break
    return (hit_length, reach, longest, done)

def full_attention_extent(cache, sizes: Sizes, k, covered):
    """The longest prefix spec group ``k`` (full attention) can serve, within the ``covered`` tokens the
    hashes cover: its leading run of cached blocks, or, when it is looked up at hash granularity, the
    highest cached boundary inside the next block (as vLLM ``FullAttentionManager.find_longest_cache_hit``
    finds them). Hashes are prefix-chained, so a cached boundary vouches for every token before it: the
    extent is downward-closed."""
    sg = sizes.groups[k]
    b = sg.block
    run = cache.run_from(k, start=0, unit=b, limit=covered // b) * b
    if not sg.fine:
        return run
    a = sizes.alignment
    partial = cache.last_held(k, step=a, lo=run, hi=min_(run + b - a, covered), unit=a, before=1, after=0)
    return max_(run, partial)

def group_serves(cache, sizes: Sizes, k, x, extent, covered, rules: Rules):
    """Whether spec group ``k`` can serve a hit of ``x`` tokens (``x`` a multiple of ``A``).

    * full attention: its cached prefix reaches ``x`` (``extent``, see :func:`full_attention_extent`);
    * sliding window: the ``ceil((W - 1) / b)`` blocks before ``x`` are cached (fewer near the start);
    * Mamba: the state at boundary ``x`` is cached;
    * chunked local: the blocks from ``x``'s chunk start to ``x`` are cached.

    A dropping EAGLE group must also hold its drop unit ``[x, x + margin)``, within the ``covered``
    tokens the hashes cover: that unit is what it recomputes. Mamba never drops (its checkpoints handle
    EAGLE on the write side).
    """
    sg = sizes.groups[k]
    a = sizes.alignment
    b = sg.block
    unit = 0
    if sg.drops and rules.eagle_recompute and (sg.kind is not Kind.MAMBA):
        unit = sg.margin
    if sg.kind is Kind.FULL:
        return x + unit <= extent
    if sg.kind is Kind.SWA:
        after = 1 if unit > 0 else 0
        return and_(x + unit <= covered, cache.window(k, x, unit=b, before=cdiv(sg.window - 1, b), after=after))
    if sg.kind is Kind.MAMBA:
        if sg.fine:
            return cache.window(k, x, unit=a, before=1, after=0)
        return cache.window(k, x, unit=b, before=1, after=0)
    return cache.window(k, x, unit=b, before=x % sg.chunk // b, after=0)

def serves_all(cache, sizes: Sizes, x, extents, covered, rules: Rules):
    """Whether every spec group can serve a hit of ``x`` tokens (see :func:`group_serves`), within the cap
    of a layout whose lookups are capped (:func:`lookup_cap`: a hit past it is not the scheduler's to
    take, though a dropping group's unit past it may be cached, as vLLM's peek finds it)."""
    ok = True
    if sizes.cap_group is not None:
        ok = x <= lookup_cap(cache, sizes, covered)
    for k in range(len(sizes.groups)):
        ok = and_(ok, group_serves(cache, sizes, k, x, extents[k], covered, rules))
    return ok

def group_extents(cache, sizes: Sizes, covered):
    """Each full-attention group's cached prefix (0 for other kinds, which do not use it)."""
    extents = []
    for k, sg in enumerate(sizes.groups):
        if sg.kind is Kind.FULL:
            extents.append(full_attention_extent(cache, sizes, k, covered))
        else:
            extents.append(0)
    return tuple(extents)

def reference_pass(cache, sizes: Sizes, bound, extents, covered, rules: Rules):
    """The longest multiple of ``A`` at most ``bound`` that every group serves (0 if none).

    Full-attention groups are downward-closed, so their extents bound the scan from above before any
    candidate is tried. A chunked-local group (alone, or beside full attention only: the spec models no
    other layout with one) keeps vLLM's lookup up to that bound, which is already the longest: every point
    of the bound's chunk up to the lookup's hit is served (its blocks from the chunk start are cached), the
    next is not (its block is not), and every point of an earlier chunk is at most the chunk start, which
    needs no block.
    """
    top = capped_top(cache, sizes, bound, covered)
    for k, sg in enumerate(sizes.groups):
        if sg.kind is Kind.FULL:
            top = min_(top, extents[k])
    chunked = chunked_group(sizes)
    if chunked is not None:
        return chunked_local_lookup(cache, sizes, chunked, hashes=covered // sizes.hash_block, max_length=top, drop=False, rules=rules)[0]
    return max_aligned(sizes.alignment, top, lambda x: serves_all(cache, sizes, x, extents, covered, rules))

def shared_prefix_tokens(cache, sizes: Sizes, bound, extents, covered, rules: Rules):
    """How far the request shares a servable prefix with the cache: the longest multiple of ``A`` at most
    ``bound`` that every group of :func:`prefix_groups` serves (0 if none), whatever the other groups
    hold.

    When it passes the hit, the groups that lag (sliding window, Mamba: they keep state only at some
    boundaries) are what stops the hit there, and the request records it as its shared-prefix junction
    (vLLM ``num_uncached_common_prefix_tokens``, :func:`kvhit.spec.retention.junction_of`): its write side
    keeps the lagging groups' state at the junction, so the next prompt sharing that prefix hits it (a
    shared system prompt served to diverging requests). vLLM's loop gets the same from its first lookup's
    candidate.
    """
    top = capped_top(cache, sizes, bound, covered)
    members = prefix_groups(sizes)
    for k in members:
        if sizes.groups[k].kind is Kind.FULL:
            top = min_(top, extents[k])

    def serves(x):
        ok = True
        for k in members:
            ok = and_(ok, group_serves(cache, sizes, k, x, extents[k], covered, rules))
        return ok
    return max_aligned(sizes.alignment, top, serves)

def reference_hit_tokens(cache, sizes: Sizes, n_tokens, rules: Rules):
    """kvhit's reference policy: the longest hit that every group can serve, a multiple of ``A``, at most
    ``N - 1`` and ``|H| * h``, with each dropping EAGLE group holding (and recomputing) exactly one drop
    unit past it (see :func:`group_serves` and :func:`reference_pass`). ``longest`` is the shared prefix
    (:func:`shared_prefix_tokens`) where the layout has groups that lag it; one group lags nothing (vLLM's
    Unitary coordinator reports no uncached prefix either). Its ``reach`` is ``covered``: every query it
    makes is bounded by the hashes (its runs by ``covered // b``, its windows by ``x + unit <= covered``),
    but the reach is not measured."""
    covered = hash_reach(sizes, n_tokens)
    cap = max_length_within_hashes(sizes, n_tokens, rules)
    extents = group_extents(cache, sizes, covered)
    hit = reference_pass(cache, sizes, cap, extents, covered, rules)
    if sizes.unitary or not rules.record_junction:
        return (hit, covered, hit, True)
    return (hit, covered, max_(hit, shared_prefix_tokens(cache, sizes, cap, extents, covered, rules)), True)

def hit_tokens(cache, sizes: Sizes, n_tokens, rules: Rules):
    """The hit of a request of ``n_tokens`` prompt tokens under ``rules``:
    ``(hit, reach, longest, converged)``. A setting the policy's engine lacks is refused
    (:func:`check_speculation`)."""
    check_speculation(sizes, rules)
    if rules.declarative:
        return reference_hit_tokens(cache, sizes, n_tokens, rules)
    if sizes.unitary:
        return unitary_hit_tokens(cache, sizes, n_tokens, rules)
    return hybrid_hit_tokens(cache, sizes, n_tokens, rules)
