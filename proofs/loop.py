"""vLLM's Hybrid loop for every run, not only the runs that stop within the unrolled passes.

The Z3 lowering unrolls :func:`kvhit.spec.policy.hybrid_hit_tokens` to ``pass_bound`` passes, and a claim
about a loop policy assumes the run stopped within them (``converged``). On layouts beyond vLLM's simple case
no such bound exists (two groups can lower each other's candidate as often as the cache lets them), so those
verdicts said nothing of longer runs. Here the loop is *summarised* by two passes of the same
:func:`~kvhit.spec.policy.hybrid_pass`:

* pass 1 from the loop's start, exactly; a run that stops there (``c >= L``) returns ``L``;
* otherwise the run's *last* pass, from any state the loop can be in when it starts a later pass: a candidate
  ``L`` with ``0 <= L <= c1`` (pass 1's candidate) and ``L % A == 0``; the full-attention lengths pass 1 set
  (later passes only trim by them, never look those groups up again); any EAGLE-verified set; that pass
  returns ``c >= L`` (it is the last one) and the run's hit is ``L``. The passes in between contribute to
  ``longest`` at most their start (``<= c1``) and to ``reach`` anything.

Why every run is covered: by :func:`kvhit.proofs.termination.hit_loop_terminates` (which
:func:`check_every_run` checks first, on the same configuration and policy) the first pass leaves aligned
full-attention lengths, every pass from such a state returns a multiple of ``A`` between 0 and its start, and
no lookup of a pass returns more than its start; so every candidate after pass 1 lies in ``[0, c1]``, the
passes in between add at most ``c1`` to ``longest``, and a run that does
not stop at pass 1 stops at some pass ``m >= 2`` from a state of the set above, with the values of ``longest``
and ``reach`` the summary allows. Every such state is one of the summary's inputs, and the claim is checked
for all of them: a PROVED verdict holds for every run. The summary admits states no run reaches, so its
REFUTED is not a verdict: the caller then runs the unrolled check, whose counterexample is a real run
(replayed by refimpl), or whose PROVED covers the runs within the unrolled passes only (reported as such).

Only claims whose every loop goes through the context's ``hit_tokens`` are summarised; a loop the spec runs
inside another function (a write side's repeat) raises :class:`LoopNotSummarised` and the caller falls back.
"""

from __future__ import annotations

from types import SimpleNamespace

from kvhit.spec import policy as spec_policy
from kvhit.spec.domain import Kind
from kvhit.spec.lower_z3 import ContractLowering, Z3Lowering
from kvhit.spec.terms import and_, eq, ite, max_, or_


class LoopNotSummarised(Exception):
    """A claim ran vLLM's Hybrid loop somewhere the summary does not reach (unrolled passes asked for)."""


class SummaryLowering(Z3Lowering):
    """The Z3 lowering, refusing to unroll a fixed-point loop beyond one pass."""

    def passes(self, bound: int):
        if bound > 1:
            raise LoopNotSummarised(f"a fixed-point loop of {bound} passes outside the context's hit_tokens")
        return range(bound)


class ContractSummaryLowering(ContractLowering, SummaryLowering):
    """The summary's lowering, every scan its contract (:class:`~kvhit.spec.lower_z3.ContractLowering`)."""


def lowering_for(summary: bool, contract: bool) -> Z3Lowering:
    """The lowering a check runs under: the loop summarised or not, each scan exact or its contract."""
    if contract:
        return ContractSummaryLowering() if summary else ContractLowering()
    return SummaryLowering() if summary else Z3Lowering()


def summarised(sizes, rules) -> bool:
    """Whether the policy runs vLLM's Hybrid loop on these sizes beyond its simple case (where the one
    unrolled pass is already the whole loop)."""
    return not (rules.declarative or sizes.unitary or spec_policy.is_simple(sizes))


def hit_tokens_summary(ctx, cache, sizes, n_tokens, rules):
    """``(hit, reach, longest, converged)`` of vLLM's Hybrid loop over every run (module docstring);
    ``converged`` says the summary's inputs describe a run (the claim assumes it, as it assumes the unrolled
    loop's)."""
    P = spec_policy
    hashes = P.num_hashes(sizes, n_tokens)
    start = P.max_length_within_hashes(sizes, n_tokens, rules)
    groups = range(len(sizes.groups))
    c1, _, lengths1, longest1, reach1 = P.hybrid_pass(
        cache, sizes, hashes, start, tuple(False for _ in groups), tuple(0 for _ in groups), True, rules)
    stops_at_once = c1 >= start
    # the last pass of a longer run, from any state the loop can reach (module docstring)
    tag = len(ctx.symbols)
    last = ctx.fresh(f"loop{tag}_L")
    verified = tuple(ctx.fresh_bool(f"loop{tag}_verified{k}") for k in groups)
    lengths = tuple(lengths1[k] if sg.kind is Kind.FULL else ctx.fresh(f"loop{tag}_length{k}")
                    for k, sg in enumerate(sizes.groups))
    c, _, _, longest_last, reach_last = P.hybrid_pass(cache, sizes, hashes, last, verified, lengths, False, rules)
    longest_between, reach_between = ctx.fresh(f"loop{tag}_longest_between"), ctx.fresh(f"loop{tag}_reach_between")
    reachable = and_(and_(last >= 0, last <= c1), eq(last % sizes.alignment, 0))
    later = and_(and_(reachable, c >= last), longest_between <= c1)
    hit = ite(stops_at_once, start, last)
    longest = ite(stops_at_once, longest1, max_(max_(longest1, longest_between), longest_last))
    reach = ite(stops_at_once, reach1, max_(max_(reach1, reach_between), reach_last))
    return hit, reach, longest, or_(stops_at_once, later)


def summary_spec(ctx, spec):
    """``spec`` (the spec's functions, as :data:`kvhit.proofs.model.SPEC`) with ``hit_tokens`` running
    :func:`hit_tokens_summary` wherever the policy runs the loop beyond its simple case."""

    def hit_tokens(cache, sizes, n_tokens, rules):
        if not summarised(sizes, rules):
            return spec.hit_tokens(cache, sizes, n_tokens, rules)
        spec_policy.check_speculation(sizes, rules)  # as spec.hit_tokens refuses a setting the engine lacks
        return hit_tokens_summary(ctx, cache, sizes, n_tokens, rules)

    return SimpleNamespace(**{**vars(spec), "hit_tokens": hit_tokens})


# The key of a PROVED check's ``cex`` saying its verdict covers only the runs of vLLM's loop within the unrolled
# passes (its value: how many).
WITHIN_PASSES = "loop"


def proved_for_every_run(verdict: str, cex) -> bool:
    """Whether a result of :func:`check_every_run` is PROVED for every run of vLLM's loop, not only for the runs
    within its unrolled passes: what a composition may build on (:mod:`kvhit.proofs.runner`)."""
    return verdict == "PROVED" and not (cex and WITHIN_PASSES in cex)


def check_every_run(invariant, rules, config):
    """:func:`kvhit.proofs.model.check` of a read- or write-side claim, every run of vLLM's loop covered where
    the summary proves it: ``(verdict, seconds, cex, rlimit)``. Where the policy runs the loop beyond its
    simple case, the summary is tried first; if it does not prove the claim, the unrolled check decides, and
    a PROVED from it carries ``cex = {"loop": ...}`` saying it covers only the runs within its passes. Each
    check is tried under the scans' contracts first (:func:`check_by_contract`)."""
    from kvhit.spec.sizes import derive_sizes

    sizes = derive_sizes(config.layout, config.speculation, rules.scale_replicated)
    if not summarised(sizes, rules):
        return check_by_contract(invariant, rules, config)
    # The summary is sound where every pass stays within its start (hit_loop_terminates, on the
    # configuration's read side): checked here first, not assumed.
    terminates, seconds, spent = _terminates(rules, config)
    if terminates:
        try:
            verdict, more_seconds, cex, more_spent = check_by_contract(invariant, rules, config, summary=True)
            seconds, spent = seconds + more_seconds, spent + more_spent
            if verdict == "PROVED":
                return verdict, seconds, None, spent
        except LoopNotSummarised:
            pass
    verdict, more_seconds, cex, more_spent = check_by_contract(invariant, rules, config)
    if verdict == "PROVED":
        cex = {WITHIN_PASSES: f"runs within {spec_policy.pass_bound(sizes)} passes"}
    return verdict, seconds + more_seconds, cex, spent + more_spent


def check_by_contract(invariant, rules, config, summary: bool = False):
    """:func:`kvhit.proofs.model.check`, tried first with every scan replaced by its contract (sound for
    PROVED: :class:`~kvhit.spec.lower_z3.ContractLowering`); where that does not prove the claim, the exact
    lowering decides. Seconds and units count both tries. Where ``invariant.by_contract`` says the try was
    measured not to decide the claim, the exact lowering decides alone."""
    from .model import check

    if not invariant.by_contract(config):
        return check(invariant, rules, config, summary=summary)
    verdict, seconds, cex, spent = check(invariant, rules, config, summary=summary, contract=True)
    if verdict == "PROVED":
        return verdict, seconds, cex, spent
    verdict, more_seconds, cex, more_spent = check(invariant, rules, config, summary=summary)
    return verdict, seconds + more_seconds, cex, spent + more_spent


def _terminates(rules, config):
    """``(PROVED, seconds, rlimit)`` of :func:`kvhit.proofs.termination.hit_loop_terminates` for the policy
    on the configuration's read side."""
    from dataclasses import replace

    from .model import READ_SIDE
    from .termination import INVARIANTS

    verdict, seconds, _, spent = check_by_contract(INVARIANTS[0], rules, replace(config, retention=READ_SIDE))
    return verdict == "PROVED", seconds, spent
