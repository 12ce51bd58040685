"""The claims of ``make prove`` evaluated on one concrete request and cache, through the generated refimpl.

A claim function ``claim(ctx) -> (assumption, claim)`` is the one definition of its invariant. The prover
runs it on symbols (:class:`kvhit.proofs.model.SymbolicContext`) and replays a counterexample with it
(:class:`kvhit.proofs.model.ReplayContext`); :func:`violation` runs it on inputs the caller chooses: a
configuration, a policy, a prompt length and a cache state. ``kvhit explain --compare`` names with it the
invariants a policy's hit breaks, and ``tests/properties/test_invariants_concrete.py`` checks the
reference with it on random layouts and caches.

Extra symbols. A claim that draws a symbol (``ctx.fresh("y")``, ``ctx.fresh("N2")``) speaks of every value
of it: at a given ``N`` and cache it is violated when *some* value makes the assumption hold and the claim
fail. A concrete evaluation cannot try every integer, so the caller names the values to try, per symbol
(``candidates``), and the verdict is exact over those values: every combination is tried, in order, and the
first at which the claim fails is the violation. A symbol the caller gives no values for is an error (the
claim needs a witness the caller did not think of), never a silent pass. The callers choose:

* ``kvhit explain`` tries, for ``hit_is_the_longest_valid``'s ``y``, the reference's hit on the same cache:
  ``make prove`` proves (on the configurations it enumerates; the property tests check it beyond them) that
  the reference's hit is valid, aligned, within ``min(N - 1, |H| * h)`` and the longest such, so a longer
  valid ``y`` exists exactly when the reference's hit is one, and one evaluation decides what a scan of every
  multiple of ``A`` would (at a fraction of its cost on a 46,240-token prompt with ``A = 16``). For
  ``scheduler_and_mask_boundaries_agree``'s ``N2`` it tries the one sibling it shows (``--sibling``, default
  ``N + S``): it reports on the requests it traces, not on every longer prompt;
* the property tests try every multiple of ``A`` from 0 up to the cap for ``y``: they check the reference
  itself, so its own hit cannot be the witness (``y = 0`` is never longer than a hit; it makes the claim run,
  and its assumption be checked, when the cap is below ``A``).
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import product

from kvhit.convert import to_spec

from .model import Config, ReplayContext


@dataclass(frozen=True)
class Violation:
    """Where a claim fails: the values of its symbols (``N`` and the extra ones) and what it showed there."""

    values: dict
    shown: dict


class ConcreteContext(ReplayContext):
    """A :class:`ReplayContext` on a cache the caller gives, with each hit computed once (a lookup changes
    nothing in a cache state but its ``max_query`` record, which no claim reads), so that trying many
    candidates for a symbol does not rerun the policy.

    Args:
        dense_premises: False to take every ``ctx.dense(...)`` premise ("every group holds every block up to
            ``extent``") as false, whatever the cache holds: what is left of a claim is then its part about an
            arbitrary cache (``kvhit explain`` tells the two parts of the eagle claim apart with it).
    """

    def __init__(self, config: Config, rules, n_tokens: int, cache, dense_premises: bool = True):
        super().__init__(config, rules, {"N": n_tokens}, cache)
        self.dense_premises = dense_premises
        self._hits: dict = {}

    def hit(self, speculation=None, rules=None):
        key = (speculation, rules)
        if key not in self._hits:
            self._hits[key] = super().hit(speculation, rules)
        return self._hits[key]

    def dense(self, extent, speculation=None):
        """The premise "every group holds every block up to ``extent`` tokens" of :class:`ReplayContext`, or
        False when the caller takes such premises as false (``dense_premises``)."""
        return self.dense_premises and super().dense(extent, speculation)

    def fresh(self, name: str):
        if name not in self.values:
            raise KeyError(f"the claim draws the symbol {name!r}; name the values to try for it (candidates)")
        return self.values[name]

    fresh_bool = fresh


def config_of(layout, speculation, retention=None, write_side: bool = False) -> Config:
    """The :class:`Config` of a refimpl (or spec) layout and speculative setting; ``write_side``: with the
    retention interval ``retention`` (None dense, 0, or a multiple of the scheduler block)."""
    layout, speculation = to_spec(layout), to_spec(speculation)
    return Config(layout, speculation, retention) if write_side else Config(layout, speculation)


@dataclass(frozen=True)
class Outcome:
    """One evaluation of a claim: the values of its symbols, whether its assumption and its claim hold there,
    and what it showed."""

    values: dict
    assumption: bool
    holds: bool
    shown: dict


def outcomes(claim, config: Config, rules, n_tokens: int, cache, candidates: dict | None = None,
             dense_premises: bool = True):
    """``claim`` for policy ``rules`` on a prompt of ``n_tokens`` and the cache state ``cache`` (a
    ``refimpl.CacheState``; a write-side claim builds its own), once per combination of ``candidates`` (per
    extra symbol the claim draws, the values to try), in order."""
    candidates = dict(candidates or {})
    names = list(candidates)
    ctx = ConcreteContext(config, rules, n_tokens, cache, dense_premises)
    for combination in product(*(candidates[name] for name in names)):
        ctx.values = {"N": n_tokens, **dict(zip(names, combination))}
        ctx.shown = {}
        assumption, holds = claim(ctx)
        yield Outcome(dict(ctx.values), bool(assumption), bool(holds), dict(ctx.shown))


def violation(claim, config: Config, rules, n_tokens: int, cache, candidates: dict | None = None,
              dense_premises: bool = True) -> Violation | None:
    """Where ``claim`` fails (its assumption holds and its claim does not) at the first combination of
    ``candidates`` that makes it fail, or None where it holds at every one (:func:`outcomes`; the module
    docstring says why the verdict is exact over the candidates only)."""
    for outcome in outcomes(claim, config, rules, n_tokens, cache, candidates, dense_premises):
        if outcome.assumption and not outcome.holds:
            return Violation(outcome.values, outcome.shown)
    return None
