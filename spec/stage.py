"""The staged lowering: the read side specialised to one layout, as Python source.

The third way the spec's functions run, beside the concrete interpreter (and the ``refimpl`` codegen
writes from it) and the Z3 lowering. As in the Z3 lowering, the layout (:class:`Sizes`, the policy's
:class:`Rules`) is concrete and the request is symbolic; here a symbolic value is a :class:`Code`, the
Python source of an expression. Executing :func:`kvhit.spec.policy.hit_tokens` on ``Code`` values runs
every Python branch on the layout once, at staging time, and leaves only what depends on the request: one
function of ``(n_tokens, cache)`` without the per-group loops, kind dispatch and attribute lookups of the
generic code. An engine calls it once per lookup, so that is where the time goes (:func:`stage_hit_tokens`).

What keeps it the same function as the refimpl's:

* Operators lower through the same :data:`kvhit.spec.terms.OPERATORS` source templates codegen uses
  (``ite`` is ``(a if c else b)``, ``and_`` is ``(a and b)``: the operands a branch does not take are not
  evaluated, as in ``refimpl``); arithmetic and comparisons lower to the Python operators.
* A symbolic value in a Python ``if`` raises :class:`kvhit.spec.terms.SymbolicBranchError`, as in Z3.
* A value used more than once is computed once, into a local, only when that cannot make the function
  ask the cache anything ``refimpl`` would not ask (:func:`_emit`): pure arithmetic (which cannot raise:
  divisors are concrete and positive), or a cache query every evaluation of the function makes.
* The cache's two primitive questions stay calls on the cache object the function is given
  (``cache.has(k, x)``, ``cache.run_from(k, start, unit, limit)``); ``window`` is unrolled into ``has``
  calls (:meth:`StagedCache.window`, the loop of :meth:`kvhit.spec.cache.CacheState.window` with its
  bounds known) and ``last_held`` is the spec's own scan (:func:`kvhit.spec.cache.scan_last_held`).
  ``tests/properties/test_staged.py`` checks the staged function against ``refimpl.hit_tokens`` on random
  caches: on random layouts under every policy that stages, and on every catalogue layout under the
  reference.

A staged function does not track the cache's ``max_query``.
"""

from __future__ import annotations

import itertools
from typing import Any, Callable

from . import runtime
from .api import policy_rules
from .cache import scan_last_held
from .domain import Layout, Speculation
from .policy import hit_tokens
from .sizes import derive_sizes
from .terms import OPERATORS, Lowering, SpecError, SymbolicBranchError, active, installed


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

    __slots__ = ("fmt", "args", "lazy", "asks", "bound", "scan")

    def __init__(self, fmt: str, args: tuple = (), lazy: frozenset = frozenset(), asks: bool = False,
                 bound: frozenset = frozenset()) -> None:
        self.fmt, self.args, self.lazy = fmt, args, lazy
        self.asks = asks or any(isinstance(a, Code) and a.asks for a in args)
        self.bound = bound.union(*(a.bound for a in args if isinstance(a, Code)))
        self.scan = None

    def __bool__(self):
        raise SymbolicBranchError(f"staged value {_preview(self)} used in a Python branch; write the choice "
                                  "with ite()")

    def __repr__(self):
        return f"Code({_preview(self)})"

    def __format__(self, spec):
        raise SpecError(f"staged value {_preview(self)} formatted into a string; pass it as an operand")

    __hash__ = None  # equality is eq(), never ==

    # arithmetic: folded when an operand makes it trivial -----------------------------------------------
    def __add__(self, o):
        if isinstance(o, int) and not isinstance(o, bool) and o < 0:
            return _binary("-", self, -o)
        return self if _is_int(o, 0) else _binary("+", self, o)

    def __radd__(self, o):
        return self if _is_int(o, 0) else _binary("+", o, self)

    def __sub__(self, o):
        return self if _is_int(o, 0) else _binary("-", self, o)

    def __rsub__(self, o):
        return _binary("-", o, self)

    def __mul__(self, o):
        if _is_int(o, 1):
            return self
        if _is_int(o, 0):
            return 0
        return _binary("*", self, o)

    __rmul__ = __mul__

    def __neg__(self):
        return Code("(-{0})", (self,))

    def __floordiv__(self, o):
        _concrete_divisor(o)
        return self if o == 1 else _binary("//", self, o)

    def __rfloordiv__(self, o):
        raise SpecError(f"division by the staged value {_preview(self)}; divisors must be concrete")

    def __mod__(self, o):
        _concrete_divisor(o)
        return 0 if o == 1 else _binary("%", self, o)

    def __rmod__(self, o):
        raise SpecError(f"modulo by the staged value {_preview(self)}; divisors must be concrete")

    def __lt__(self, o):
        return _binary("<", self, o)

    def __le__(self, o):
        return _binary("<=", self, o)

    def __gt__(self, o):
        return _binary(">", self, o)

    def __ge__(self, o):
        return _binary(">=", self, o)


def _is_int(v, value: int) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v == value


def _concrete_divisor(d) -> None:
    if isinstance(d, Code) or not isinstance(d, int) or isinstance(d, bool) or d <= 0:
        raise SpecError(f"division by {d!r}: the divisor must be a concrete positive integer")


def _check_operand(v):
    if isinstance(v, Code) or (isinstance(v, int)):
        return v
    raise SpecError(f"cannot stage the operand {v!r} (only integers, booleans and staged values)")


def _binary(op: str, a, b) -> Code:
    return Code(f"({{0}} {op} {{1}})", (_check_operand(a), _check_operand(b)))


def _preview(code: Code, limit: int = 120) -> str:
    text = _render(code, {})
    return text if len(text) <= limit else text[:limit] + "..."


class StagedLowering(Lowering):
    """The operators of :mod:`kvhit.spec.terms` while :func:`stage` runs the spec: a call with a staged
    operand becomes the node its ``source`` template makes (:func:`staged_call`), and ``max_aligned``
    is staged even at a concrete bound (its predicate may ask the cache). Each :func:`stage` installs a
    fresh one, so its lambda parameters are named ``x0``, ``x1``, ... from the start."""

    def __init__(self) -> None:
        self.params = itertools.count()  # lambda parameter names: x0, x1, ...

    def owns(self, vals) -> bool:
        return any(isinstance(v, Code) for v in vals)

    def call(self, op, args: tuple):
        return staged_call(op, args, self.params)

    def max_aligned(self, step: int, hi, pred):
        return staged_call(OPERATORS["max_aligned"], (step, hi, pred), self.params)


def staged_call(op, args: tuple, params) -> Any:
    """An operator of ``terms`` (``op``, an :class:`kvhit.spec.terms.Operator`) called on staged values:
    the node its ``source`` template makes of them. Operands a template puts in a branch (``{1}`` and
    ``{2}`` of ``ite``, ``{1}`` of ``and``/``or``) are lazy; ``max_aligned``'s predicate becomes a lambda
    whose parameter is named by the next number of ``params``."""
    name = op.name
    if name == "max_aligned":
        step, hi, pred = args
        var = f"x{next(params)}"
        x = Code(var, bound=frozenset([var]))
        body = pred(x)
        if not isinstance(body, Code):  # a predicate the layout decides: True or False for every x
            body = bool(body)
        fn = Code(f"(lambda {var}: {{0}})", (body,), lazy=frozenset([0]))
        fn.bound = fn.bound - {var}
        scan = Code(op.source, (step, _check_operand(hi), fn))
        scan.scan = (var, body)
        return scan
    if name in ("and_", "or_"):
        a, b = args
        decides = name == "or_"  # the operand value that decides: False for and, True for or
        if isinstance(a, bool):
            return a if a is decides else b
        if isinstance(b, bool):  # a is a staged bool: ``a and True`` is a, ``a and False`` is False
            return b if b is decides else a
        return Code(op.source, (_check_operand(a), _check_operand(b)), lazy=frozenset([1]))
    if name == "ite":
        cond, then, other = args
        if isinstance(then, tuple):
            return tuple(staged_call(op, (cond, t, o), params) for t, o in zip(then, other, strict=True))
        return Code(op.source, tuple(_check_operand(a) for a in args), lazy=frozenset([1, 2]))
    return Code(op.source, tuple(_check_operand(a) for a in args))


def _group(k) -> int:
    if not isinstance(k, int) or isinstance(k, bool):
        raise SpecError(f"a staged cache query needs a concrete spec group, got {k!r}")
    return k


class StagedCache:
    """The cache a staged function is given, as seen while staging: its queries become calls on it."""

    def __init__(self, name: str = "cache") -> None:
        self.name = name

    def has(self, k, x):
        return Code(f"{self.name}.has({_group(k)}, {{0}})", (_check_operand(x),), asks=True)

    def run_from(self, k, start, unit, limit):
        return Code(f"{self.name}.run_from({_group(k)}, {{0}}, {{1}}, {{2}})",
                    tuple(_check_operand(v) for v in (start, unit, limit)), asks=True)

    def window(self, k, x, unit, before, after):
        """:meth:`kvhit.spec.cache.CacheState.window` with ``unit``, ``before`` and ``after`` concrete: its
        loop over ``j`` in ``[max(0, i - before), i + after)``, ``i = x // unit``, unrolled as ``j = i + d``
        for each ``d`` in ``[-before, after)``: block ``j`` is cached, or ``j < 0`` (not in the loop)."""
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in (unit, before, after)):
            raise SpecError("a staged window needs a concrete unit and block counts")
        i = x // unit
        ok = True
        for d in range(-before, after):
            held = Code("({0} or {1})", (i + d < 0, self.has(k, (i + (d + 1)) * unit)), lazy=frozenset([1]))
            ok = held if ok is True else Code("({0} and {1})", (ok, held), lazy=frozenset([1]))
        return ok

    def last_held(self, k, step, lo, hi, unit, before, after):
        return scan_last_held(self, k, step, lo, hi, unit, before, after)


# ----------------------------------------------------------------------------------------------------
# Emission
# ----------------------------------------------------------------------------------------------------


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
    order: list[int] = []  # post-order: operands before the nodes that use them

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
        name = f"t{len(names)}"
        if node.scan is not None and key in strict and not node.bound:
            # a scan every call makes: a loop, without a call of the predicate per candidate
            step, hi, _ = node.args
            x, body = node.scan
            lines += [f"    {x} = {_render(hi, names)} // {step} * {step}",
                      f"    while {x} > 0 and not {_render(body, names)}:",
                      f"        {x} -= {step}",
                      f"    {name} = {x} if {x} > 0 else 0"]
            names[key] = name
        elif uses[key] > 1 and node.args and not node.bound and (not node.asks or key in strict):
            lines.append(f"    {name} = {_render(node, names)}")
            names[key] = name
    body = "\n".join(lines + [f"    return ({', '.join(_render(o, names) for o in outputs)},)"])
    return f"def {fn_name}({', '.join(params)}):\n{body}\n"


def stage(fn: Callable, *args, name: str = "staged", **kwargs) -> tuple[str, Callable]:
    """``fn(cache, *args)`` staged on a symbolic prompt length and cache: ``(source, function)`` where
    ``function(n_tokens, cache)`` returns what ``fn`` returns, as a tuple. ``args`` may contain the
    marker :data:`N` for the prompt length."""
    n = Code("n_tokens")
    cache = StagedCache()
    args = tuple(n if a is N else a for a in args)
    if active() is not None:
        raise SpecError(f"staging inside another lowering ({type(active()).__name__})")
    with installed(StagedLowering()):
        out = fn(cache, *args, **kwargs)
    outputs = out if isinstance(out, tuple) else (out,)
    source = _emit(tuple(outputs), ("n_tokens", "cache"), name)
    namespace = {"max_aligned": runtime.max_aligned}
    exec(compile(source, f"<kvhit staged {name}>", "exec"), namespace)  # noqa: S102 - our own source
    return source, namespace[name]


N = object()  # stands for the prompt length in stage()'s arguments


def stage_hit_tokens(layout, speculation, policy: str = "reference") -> tuple[str, Callable]:
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
        if not isinstance(value, cls):  # the other module's type (spec and refimpl each have one) or none
            raise TypeError(f"stage_hit_tokens needs {cls.__module__}.{cls.__name__}, got {type(value).__module__}."
                            f"{type(value).__name__} (kvhit.convert moves a value between the spec and refimpl)")
    rules = policy_rules(policy)
    sizes = derive_sizes(layout, speculation, rules.scale_replicated)
    return stage(hit_tokens, sizes, N, rules, name="hit_tokens")
