"""The checking engine: configurations, contexts, verdicts, counterexamples and their replay.

An invariant is a *claim function* ``claim(ctx) -> (assumption, claim)`` written against a context. The
same function runs twice:

* symbolically (:class:`SymbolicContext`): ``ctx.P`` is :mod:`kvhit.spec.policy` executed by the Z3
  lowering, the prompt length and the cache are symbolic; Z3 searches for an input where the assumption
  holds and the claim fails;
* concretely (:class:`ReplayContext`): ``ctx.P`` is the generated :mod:`kvhit.refimpl`, and the input is a
  Z3 counterexample. A counterexample counts only if this replay violates the claim too.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

from kvhit import refimpl
from kvhit.convert import to_refimpl
from types import SimpleNamespace

from kvhit.spec import policy as spec_policy
from kvhit.spec import retention as spec_retention
from kvhit.spec import sizes as spec_sizes
from kvhit.spec.domain import NO_SPECULATION, Kind, Layout, Speculation
from kvhit.spec.lower_z3 import SymbolicCache, SymbolicWrittenCache, fresh_int
from kvhit.spec.policy import Rules, pass_bound
from kvhit.spec.sizes import Sizes, derive_sizes
from kvhit.spec.terms import Term, _zv, installed


def _z3():
    """Z3, imported when a check needs the solver: replaying a claim concretely (:class:`ReplayContext`,
    ``kvhit explain --compare``) does not, so the operator's install needs no solver for it."""
    import z3

    return z3


# The spec's functions under the names the generated refimpl gives them (one flat module there).
SPEC = SimpleNamespace(**{**vars(spec_sizes), **vars(spec_policy), **vars(spec_retention)})

# A configuration of the read side only (no retention interval: the cache state is arbitrary).
READ_SIDE = "read side"


@dataclass(frozen=True)
class Config:
    """One enumerated configuration: a layout, a speculative setting and, for the write side, a retention
    interval (``None`` dense, 0, or a multiple of the scheduler block)."""

    layout: Layout
    speculation: Speculation
    retention: object = READ_SIDE

    @property
    def write_side(self) -> bool:
        return self.retention != READ_SIDE

    @property
    def label(self) -> str:
        dcp = f" dcp{self.layout.dcp}" if self.layout.dcp > 1 else ""
        ret = f" R={self.retention}" if self.write_side else ""
        return f"{self.layout.name}{dcp} {self.speculation.describe()}{ret}"


# A lemma with no check of its own (``Invariant.by_lemma``): on every cache and N of a read-side configuration
# and of its twin without speculation, the policy's hit is the reference's. It holds where both policies have
# every premise PROVED there (every run of vLLM's loop): each hit is then 0 or served, aligned and within
# min(N - 1, |H| * h), no longer aligned length is served, and the loop stops, so each is the largest served
# aligned length within that cap (0 if there is none), which is one number (README, "Read-side claims of
# vllm_0_33_repaired, composed").
SAME_HIT = "hit_is_the_references"
SAME_HIT_PREMISES = ("hit_is_valid_in_every_group", "hit_is_aligned_and_capped", "hit_is_the_longest_valid",
                     "hit_loop_terminates")


@dataclass(frozen=True)
class Invariant:
    """A named claim checked for every configuration it applies to.

    Attributes:
        name: the claim, as a sentence in snake case.
        claim: ``claim(ctx) -> (assumption, claim)``; its docstring states the formula.
        concern: the proofs module it lives in.
        applies: which configurations it speaks about.
        refuted_by: known-bad variants that must refute it (non-vacuity).
        write_side: it speaks about the cache a request leaves (configurations with a retention interval).
        heavy: configurations checked only by ``kvhit prove --extended`` (too slow for the default run).
        policies: the modelled policies it speaks about (None: every one); a claim that compares a policy
            with ``vllm_0_33`` says nothing of ``vllm_0_33`` itself.
        extended_policies: more policies it speaks about in ``kvhit prove --extended`` only (too slow for
            the default run).
        by_lemma: ``(policy, lemma)`` pairs: the default run does not check the claim for ``policy`` itself
            but composes its verdict, configuration by configuration, from the reference's and the
            invariant ``lemma``'s (which says the policy computes what the reference does wherever the claim
            looks; :data:`SAME_HIT`: a lemma read off other rows); ``--extended`` checks it whole
            (:func:`kvhit.proofs.runner.compose`).
        default_only: a lemma of such a composition: ``--extended``, which checks the composed claims
            whole, leaves it out.
        by_contract: ``(configuration, policy rules)`` whose checks try the scans' contracts first
            (:func:`kvhit.proofs.loop.check_by_contract`); off where they were measured not to decide the
            claim, or to cost more than the exact check alone, which saves the try.
        lemmas: ``(invariant, policy)`` rows from whose verdicts a configuration the run does not check the
            claim on for the reference gets the reference's verdict (PROVED when every one is PROVED there,
            a read-side lemma on the configuration's read-side twin): only where the first lemma was checked
            (:func:`kvhit.proofs.runner.compose_by_lemmas`).
    """

    name: str
    claim: Callable
    concern: str
    applies: Callable[[Config], bool] = lambda config: True
    refuted_by: tuple = ()
    hits: int = 1
    witnesses: int = 1
    write_side: bool = False
    heavy: Callable[[Config], bool] = lambda config: False
    policies: tuple | None = None
    extended_policies: tuple = ()
    by_lemma: tuple = ()
    default_only: bool = False
    by_contract: Callable[[Config, Rules], bool] = lambda config, rules: True
    lemmas: tuple = ()

    @property
    def formula(self) -> str:
        return " ".join((self.claim.__doc__ or "").split())


@dataclass(frozen=True)
class Scenario:
    """An invariant pinned to one reported case: a configuration and a prompt length. A read-side scenario's
    cache holds the whole prompt (what one served request leaves with dense retention); a write-side one
    builds its own. ``pinned`` fixes other symbols of the claim (e.g. a sibling's length ``N2``)."""

    name: str
    invariant: str
    config: Config
    n_tokens: int
    pinned: tuple = ()
    concrete: bool = False  # every input pinned: decided by running the spec on them, no solver


def serves(P, cache, sizes: Sizes, x, n_tokens):
    """Whether every group serves a hit of ``x`` (the reference's notion of validity,
    ``hit_is_valid_in_every_group``'s) to a prompt of ``n_tokens`` tokens on ``cache``; ``P``: the spec's
    functions or refimpl's."""
    covered = P.hash_reach(sizes, n_tokens)
    extents = P.group_extents(cache, sizes, covered)
    return P.serves_all(cache, sizes, x, extents, covered, spec_policy.REFERENCE)


class _Context:
    """What a claim function sees. Subclasses bind it to symbols or to a counterexample."""

    P = None
    cache = None
    n = None
    config: Config
    rules: Rules

    def probe(self, value):
        """``value``, named to the scans' contracts as a point to state maximality at
        (:class:`~kvhit.spec.lower_z3.ContractLowering`): a claim compares a hit with it. Only a symbolic
        check records it."""
        return value

    def sizes(self, speculation: Speculation | None = None) -> Sizes:
        layout, speculation = self.config.layout, speculation or self.config.speculation
        if self.P is refimpl:  # the generated code has its own domain types
            layout, speculation = to_refimpl(layout), to_refimpl(speculation)
        return self.P.derive_sizes(layout, speculation, self.rules.scale_replicated)

    def hit(self, speculation: Speculation | None = None, rules: Rules | None = None):
        """``(hit, reach, longest, converged)`` of the policy (or ``rules``) under a speculative setting."""
        return self.P.hit_tokens(self.cache, self.sizes(speculation), self.n, rules or self.rules)

    def serves(self, x, speculation: Speculation | None = None, cache=None, n=None):
        """Whether every group serves a hit of ``x`` (the reference's notion of validity) to a prompt of
        ``n`` tokens (the claim's ``N``) on ``cache`` (the claim's cache)."""
        cache, n = self.cache if cache is None else cache, self.n if n is None else n
        sizes = self.sizes(speculation)
        valid = serves(self.P, cache, sizes, x, n)
        self._asked(cache, sizes, n, x, valid)
        return valid

    def _asked(self, cache, sizes, n, x, valid) -> None:
        """A validity question the claim asked (:meth:`serves`) and its answer: the symbolic context keeps
        it for the loop summary's facts (:func:`kvhit.proofs.loop.loop_facts`)."""

    def dense(self, extent, speculation: Speculation | None = None):
        """Every group holds every block up to ``extent`` tokens, at each unit its lookups read."""
        sizes = self.sizes(speculation)
        out = True
        for k, sg in enumerate(sizes.groups):
            units = [sizes.alignment] if sg.kind == Kind.MAMBA and sg.fine else [sg.block]
            if sg.kind == Kind.FULL and sg.fine:  # == : refimpl's sizes carry refimpl's Kind
                units.append(sizes.alignment)  # the boundaries inside a block, for partial hits
            for unit in units:
                blocks = extent // unit
                out = spec_policy.and_(out, self.cache.run_from(k, 0, unit, blocks) >= blocks)
        return out


    def written(self, groups):
        """The cache a write side's :class:`kvhit.spec.cache.Held` descriptions say."""
        if self.P is refimpl:
            return refimpl.written_cache(groups)
        from kvhit.spec.cache import written

        return written(groups)  # symbolic under the Z3 lowering, plain loops otherwise


class SymbolicContext(_Context):
    def __init__(self, config: Config, rules: Rules, runs: int):
        self.config, self.rules = config, rules
        self.P = SPEC
        self.cache = SymbolicCache(runs)
        self.n = fresh_int("N")
        self.symbols: dict[str, Term] = {"N": self.n}
        self.shown: dict[str, object] = {}
        self.probes: list[Term] = []
        # the loop summary's lemmas this check may use (kvhit.proofs.loop.LEMMAS), the summarised runs that
        # use them and the validity questions the claim asked (kvhit.proofs.loop.loop_facts)
        self.loop_lemmas: dict = {}
        self.loop_runs: list = []
        self.served: list = []

    def _asked(self, cache, sizes, n, x, valid) -> None:
        # only then: holding these terms alive changes how Z3 numbers its terms, and so the units it spends
        if self.loop_lemmas:
            self.served.append((cache, sizes, n, x, valid))

    def fresh(self, name: str) -> Term:
        self.symbols[name] = fresh_int(name)
        return self.symbols[name]

    def fresh_bool(self, name: str) -> Term:
        self.symbols[name] = Term(_z3().Bool(f"{name}!{len(self.symbols)}"))
        return self.symbols[name]

    def show(self, name: str, value):
        self.shown[name] = value
        return value

    def probe(self, value):
        self.probes.append(value)
        return value


class ReplayContext(_Context):
    def __init__(self, config: Config, rules: Rules, values: dict, cache):
        self.config, self.rules = config, rules
        self.P = refimpl
        self.values = values
        self.cache = cache
        self.n = values["N"]
        self.shown: dict[str, object] = {}

    def fresh(self, name: str):
        return self.values[name]

    fresh_bool = fresh

    def show(self, name: str, value):
        self.shown[name] = value
        return value


def accepts(rules: Rules, config: Config) -> bool:
    """Whether the policy's engine has the configuration's speculative setting (vLLM 0.32 has no lookahead
    hashes: :func:`kvhit.spec.policy.check_speculation`, which its hit and write side call)."""
    try:
        spec_policy.check_speculation(derive_sizes(config.layout, config.speculation, rules.scale_replicated), rules)
    except ValueError:
        return False
    return True


def runs_needed(invariant: Invariant, rules: Rules, config: Config, summary: bool = False) -> int:
    """Cached runs per (group, unit) that make the symbolic cache complete for a check (the small-model
    argument in :mod:`kvhit.spec.lower_z3`): one per place whose validity the check relies on. Each hit
    relies on one place per lookup of a group (one lookup for the reference and a single group, one per
    unrolled pass in vLLM's Hybrid loop, two in its summary); each witness on one; and the leading run
    from block 0 on one."""
    sizes = derive_sizes(config.layout, config.speculation)
    per_hit = 1 if (rules.declarative or sizes.unitary) else pass_bound(sizes)
    if summary:
        per_hit = min(per_hit, 2)
    return invariant.hits * per_hit + invariant.witnesses + 1


# Z3's arithmetic solvers differ by orders of magnitude on these linear problems full of division by
# constants, and neither wins everywhere: try the older simplex solver first, then the default one.
# Each try is bounded by Z3's resource units (rlimit), never by the clock, so that a verdict does not depend
# on how loaded the machine is. Calibrated on the default run: the simplex solver spends 15-60 million
# units a second, the default one 2-15 million, so a check the simplex solver decides is cheaper there even
# at many more units. A first bound too low sends it to the default solver: at 40 million one check the
# simplex solver decides in 60 million took 395 s there; at 400 million the dominance lemma on gemma took
# 4.9 billion over its five settings and about 590 s of checks (drop, MTP 2: 1,792 million over both tries),
# where the simplex solver alone decides them in 2.9 billion and 71 s (drop, MTP 2: 904 million, 23 s);
# the dominance claim on the EAGLE sliding window (no speculation, R = 0), which the default solver did not
# decide in 18 minutes, the simplex solver decides in 1,334 million and 36 s. With a
# first bound of 1.5 billion the default run's costliest check takes 998 million, and the run takes 327 s
# on two idle cores with 599 s of checks, where the 400 million bound took 570 s with 1,048 s of checks for
# fewer configurations (gemma's dominance lemma was --extended). The default solver stays the second try:
# the simplex solver gives some checks up before its bound (the whole dominance claim on the EAGLE sliding
# window in drop mode, --extended: unknown after 3.7 billion units of an 8 billion bound).
# Each try first runs Z3's ``simplify`` tactic (the third field), which rewrites the formula into an equivalent
# one (so it changes no verdict; a model of it is a model of the formula): on 2026-12-06 the default run
# spent 10.7 G units and 625 s of checks with it, 12.6 G and 685 s without (337 s wall against 394, run
# after each other). It halves the EAGLE claim's units and the non-vacuity witness of the dominance claim's,
# and saves a tenth of the dominance lemma's (qwen3next at R = 3200 costs more). The scans' contracts do
# without it (CONTRACT_PORTFOLIO): there it left the repaired policy's write-side lemma undecided within its
# bound on four configurations (2.4 G units where it takes 0.4 G).
PORTFOLIO = ((2, 1_500_000_000, True), (6, 3_000_000_000, True))


def isolated_map(fn, items, jobs: int) -> list:
    """``[fn(item) for item in items]`` (in completion order), each call in a process of its own forked from
    this one, ``jobs`` at a time. A Z3 query's resource count depends on the terms its process built before
    (their ids order the solver's choices): a check decided in 14 M units in a worker once took over 400 M
    in one that had run other checks first. A call in a fresh process starts from the same state whatever
    ran elsewhere, so its checks' verdicts and units are one number per commit; the parent must build no Z3
    terms itself."""
    import multiprocessing

    if not items:
        return []
    _z3()  # imported once here, not in every child (importing builds no terms)
    with multiprocessing.get_context("fork").Pool(max(1, min(jobs, len(items))), maxtasksperchild=1) as pool:
        return list(pool.imap_unordered(fn, items, chunksize=1))


def _rlimit_count() -> int:
    """The resource units this process's Z3 context has spent so far."""
    return _z3().Solver().statistics().get_key_value("rlimit count")


# A check under scan contracts (ContractLowering) that its first solver does not decide within this many units
# goes to the exact lowering instead of the second solver: a contract check is cheap when it proves the claim.
CONTRACT_PORTFOLIO = ((2, 300_000_000, False),)


def solve(formulas, portfolio=PORTFOLIO):
    """``(result, model, reason, rlimit)`` of the conjunction of ``formulas``, by the solver portfolio
    (``(arithmetic solver, resource bound, simplify first)`` tries); ``rlimit``: the resource units spent,
    over every try."""
    z3 = _z3()
    reason = ""
    start = _rlimit_count()
    for arith, limit, simplify in portfolio:
        z3.set_param("smt.arith.solver", arith)
        solver = z3.Then("simplify", "smt").solver() if simplify else z3.Solver()
        solver.set("rlimit", limit)
        solver.add(*formulas)
        result = solver.check()
        if result != z3.unknown:
            return result, solver.model() if result == z3.sat else None, "", _rlimit_count() - start
        reason = solver.reason_unknown()
    return z3.unknown, None, reason, _rlimit_count() - start


@dataclass
class Verdict:
    invariant: str
    policy: str
    verdict: str  # PROVED | REFUTED | UNKNOWN | REPLAY-MISMATCH | ERROR
    configs: list = field(default_factory=list)
    refuted: int = 0
    seconds: float = 0.0
    rlimit: int = 0
    max_rlimit: int = 0
    counterexample: dict | None = None
    note: str = ""
    composed_from: str = ""  # a verdict composed from two others' (Invariant.by_lemma): which
    refutations: list = field(default_factory=list)  # every refuted configuration: brief(cex) with its label
    # PROVED configurations whose verdict covers only the runs of vLLM's loop within its unrolled passes
    # (kvhit.proofs.loop): label and how many passes
    bounded: list = field(default_factory=list)

    def as_json(self) -> dict:
        return {"invariant": self.invariant, "policy": self.policy, "verdict": self.verdict,
                "configs": len(self.configs), "seconds": round(self.seconds, 3), "rlimit": self.rlimit, "max_rlimit": self.max_rlimit,
                "layouts": sorted({label.split()[0] for label in self.configs}), "composed_from": self.composed_from,
                "counterexample": self.counterexample, "refuted_configs": self.refutations,
                "bounded_configs": self.bounded}


def brief(label: str, cex: dict) -> dict:
    """One refuted configuration in a line: its label, the inputs and what each policy hits on them."""
    out = {"config": label, "N": cex.get("N"), "witnesses": cex.get("witnesses"), "shown": cex.get("replayed")}
    if "repeat_hits" in cex:
        out["repeat_hits"] = cex["repeat_hits"]
    else:
        out["hits"] = cex.get("hits")
    return out


def _as_python(value, model):
    if isinstance(value, Term):
        v = model.eval(value.z, model_completion=True)
        z3 = _z3()
        if z3.is_bool(v):
            return z3.is_true(v)
        return v.as_long()
    if isinstance(value, tuple):
        return tuple(_as_python(v, model) for v in value)
    return value


def _flat(values):
    """The values of ``values``, tuples opened."""
    for v in values:
        if isinstance(v, tuple):
            yield from _flat(v)
        else:
            yield v


def cache_from_runs(runs: dict) -> tuple:
    """A concrete cache from runs of cached blocks ``{(group, unit): [(start, end), ...]}``.

    Boundary ``x`` of group ``k`` is read from the run list of the largest unit that divides ``x`` (the
    units of one group never read each other's boundaries). Returns the cache and a JSON description.
    """
    by_group: dict[int, list] = {}
    for (k, unit), spans in runs.items():
        by_group.setdefault(k, []).append((unit, list(spans)))
    for lists in by_group.values():
        lists.sort(key=lambda item: -item[0])

    def has(k, x):
        for unit, spans in by_group.get(k, []):
            if x % unit == 0:
                j = x // unit - 1
                return any(s <= j < e for s, e in spans)
        return False

    described = {str(k): [{"unit": unit, "blocks": [[s, e] for s, e in spans if e > s]}
                          for unit, spans in lists] for k, lists in by_group.items()}
    return refimpl.CacheState(has), described


def model_runs(cache: SymbolicCache, model) -> dict:
    return {key: [(model.eval(s.z, True).as_long(), model.eval(e.z, True).as_long()) for s, e in lst]
            for key, lst in cache.lists.items()}


def check_concrete(invariant: Invariant, rules: Rules, scenario: Scenario):
    """A scenario whose every input is pinned: run the claim through the spec interpreter and through the
    generated refimpl; they must agree, and the verdict is what they say."""
    start = time.perf_counter()
    config = scenario.config
    values = {"N": scenario.n_tokens, **dict(scenario.pinned)}
    interpreted = ReplayContext(config, rules, values, None)
    interpreted.P = SPEC
    s_assumption, s_claim = invariant.claim(interpreted)
    replay = ReplayContext(config, rules, values, None)
    r_assumption, r_claim = invariant.claim(replay)
    seconds = time.perf_counter() - start
    if not (s_assumption and not s_claim):
        verdict = "PROVED"
    else:
        verdict = "REFUTED"
    if (bool(s_assumption), bool(s_claim), interpreted.shown) != (bool(r_assumption), bool(r_claim), replay.shown):
        verdict = "REPLAY-MISMATCH"
    if verdict == "PROVED":
        return verdict, seconds, None, 0
    return verdict, seconds, counterexample(config, rules, values, None, {}, dict(interpreted.shown), replay.shown), 0


def counterexample(config: Config, rules: Rules, values: dict, cache, described: dict, shown: dict,
                   replayed: dict) -> dict:
    """The record of a refuted check: the inputs, what the check showed and its replay, and every
    policy's hits on the same inputs (the first three repeats on the write side)."""
    cex = {
        "layout": config.layout.name, "dcp": config.layout.dcp,
        "speculation": config.speculation.describe(), "policy": rules.name, "N": values["N"],
        "retention": config.retention if config.write_side else None,
        "cache": described, "z3": shown, "replayed": dict(replayed),
        "witnesses": {k: v for k, v in values.items() if k != "N"},
    }
    if config.write_side:
        # The cache is what the first request left; each policy's hits on its first three repeats.
        cex["repeat_hits"] = {name: list(refimpl.repeat_hits(ReplayContext(config, other, values, cache).sizes(),
                                                              values["N"], config.retention, other, 3))
                              for name, other in spec_policy.POLICIES.items()}
    else:
        ref = ReplayContext(config, spec_policy.REFERENCE, values, cache)
        cex["reference_hit"] = ref.hit()[0]
        cex["reference_hit_without_speculation"] = ref.hit(NO_SPECULATION)[0]
        cex["hits"] = {name: ReplayContext(config, other, values, cache).hit()[0]
                       for name, other in spec_policy.POLICIES.items()}
    return cex


def check(invariant: Invariant, rules: Rules, config: Config, scenario: Scenario | None = None,
          max_n: int | None = None, max_blocks: int | None = None, summary: bool = False,
          contract: bool = False, loop_lemmas: dict | None = None):
    """Check one invariant for one policy and configuration. Returns ``(verdict, seconds, cex,
    rlimit)`` (``rlimit``: Z3's resource units spent; 0 for a scenario decided without the solver).
    ``max_n`` bounds the prompt length and ``max_blocks`` the blocks the arbitrary cache holds
    (:meth:`~kvhit.spec.lower_z3.SymbolicCache.blocks`), to search for the smallest counterexample.
    With ``summary``, vLLM's Hybrid loop is its two-pass summary (:mod:`kvhit.proofs.loop`): PROVED then holds
    for every run, REFUTED is no verdict (the summary admits unreachable states); a claim running the loop
    elsewhere raises :class:`kvhit.proofs.loop.LoopNotSummarised`. With ``contract``, every scan
    (``max_aligned``) is its contract (:class:`~kvhit.spec.lower_z3.ContractLowering`), its maximality stated
    at every scan's result and at the claim's symbols, shown values and probes: PROVED then holds, anything
    else is no verdict ("UNDECIDED"; the exact lowering decides). ``loop_lemmas`` (with ``summary``): the
    summary's lemmas proved on this configuration and policy, by the sizes of the runs they hold for
    (:func:`kvhit.proofs.loop.proved_lemmas`), which the summary may then use."""
    if scenario is not None and scenario.concrete:
        return check_concrete(invariant, rules, scenario)
    from .loop import loop_facts, lowering_for, summary_spec

    z3 = _z3()
    start = time.perf_counter()
    with installed(lowering_for(summary, contract)) as active:
        # A scenario's cache holds every block up to the hashes (one run) and no lookup reads past them.
        runs = 1 if scenario is not None else runs_needed(invariant, rules, config, summary)
        ctx = SymbolicContext(config, rules, runs)
        if summary:
            ctx.P = summary_spec(ctx, SPEC)
            ctx.loop_lemmas = dict(loop_lemmas or {})
        assumption, claim = invariant.claim(ctx)
        formulas = [_zv(assumption), z3.Not(_zv(claim)), *(_zv(f) for f in loop_facts(ctx))]
        if contract:  # before the cache's well-formedness: a predicate evaluated here may read new runs
            formulas += active.facts([*ctx.symbols.values(), *_flat(ctx.shown.values()), *ctx.probes])
        formulas = [ctx.n.z >= 1, ctx.cache.well_formed(), *formulas]
        if max_n is not None:
            formulas.append(ctx.n.z <= max_n)
        if max_blocks is not None:
            formulas.append(ctx.cache.blocks() <= max_blocks)
        if scenario is not None:
            formulas.append(ctx.n.z == scenario.n_tokens)
            for name, value in scenario.pinned:
                formulas.append(ctx.symbols[name].z == value)
            if not config.write_side:  # a write-side check builds its own caches
                formulas.append(_zv(ctx.dense(ctx.P.num_hashes(ctx.sizes(), ctx.n) * ctx.sizes().hash_block)))
        result, model, reason, spent = solve(formulas, CONTRACT_PORTFOLIO if contract else PORTFOLIO)
    seconds = time.perf_counter() - start
    if result == z3.unsat:
        return "PROVED", seconds, None, spent
    if summary or contract:  # the model may be a state no run reaches or break a scan's maximality: no verdict
        return "UNDECIDED", seconds, None, spent
    if result == z3.unknown:
        return "UNKNOWN", seconds, {"reason": reason, "rlimit": spent}, spent
    values = {name: _as_python(term, model) for name, term in ctx.symbols.items()}
    symbolic_shown = {name: _as_python(v, model) for name, v in ctx.shown.items()}
    cache, described = cache_from_runs(model_runs(ctx.cache, model))
    replay = ReplayContext(config, rules, values, cache)
    r_assumption, r_claim = invariant.claim(replay)
    cex = counterexample(config, rules, values, cache, described, symbolic_shown, replay.shown)
    if not (r_assumption and not r_claim) or symbolic_shown != replay.shown:
        return "REPLAY-MISMATCH", seconds, cex, spent
    return "REFUTED", seconds, cex, spent
