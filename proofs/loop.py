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
:func:`check_every_run` checks first, on the same configuration and policy, with and without its speculation,
since the EAGLE loss summarises a run of each) the first pass leaves aligned
full-attention lengths, every pass from such a state returns a multiple of ``A`` between 0 and its start, and
no lookup of a pass returns more than its start; so every candidate after pass 1 lies in ``[0, c1]``, the
passes in between add at most ``c1`` to ``longest``, and a run that does
not stop at pass 1 stops at some pass ``m >= 2`` from a state of the set above, with the values of ``longest``
and ``reach`` the summary allows. Every such state is one of the summary's inputs, and the claim is checked
for all of them: a PROVED verdict holds for every run. The summary admits states no run reaches, so its
REFUTED is not a verdict: the caller then runs the unrolled check, whose counterexample is a real run
(replayed by refimpl), or whose PROVED covers the runs within the unrolled passes only (reported as such).

The summary alone cannot decide a claim about where the run stops (``hit_is_the_longest_valid``, the EAGLE
loss: it lets the run stop at any fixed point below pass 1's candidate) nor one about what the passes in
between read. Two facts about single passes narrow that (:data:`LEMMAS`), each a claim of its own checked on the
configuration's read side and policy before the summary uses it (:func:`proved_lemmas`):
:func:`later_passes_read_within_hashes` (a later pass from any state above reads within the request's hashes,
so the passes in between do) and :func:`passes_keep_valid_lengths` (pass 1 returns at least every valid length
``t`` at or below its start, and a later pass from any state above at least every valid ``t`` at or below its
candidate; by induction over the passes every candidate of the run stays at or above ``t``, so the run stops
there or above, which :func:`loop_facts` states at the points the claim asks about). A third,
:func:`verified_groups_hold_their_drop`, lets the summary take the last pass's EAGLE-verified set as one
whose groups hold their dropping lookup at its candidate (:func:`verified_hold`) rather than as arbitrary:
pass 1 leaves such a set and every later pass from one leaves one (by induction, the last pass starts from
one); it holds with Candidate C1's repair and is refuted by C1 itself. The lemmas quantify over every state
the summary admits, so a REFUTED lemma may speak of a state no run reaches: it is then not used, and nothing
else changes.

Only claims whose every loop goes through the context's ``hit_tokens`` are summarised; a loop the spec runs
inside another function (a write side's repeat) raises :class:`LoopNotSummarised` and the caller falls back.
"""

from __future__ import annotations

from types import SimpleNamespace

from kvhit.spec import policy as spec_policy
from kvhit.spec.domain import Kind
from kvhit.spec.lower_z3 import ContractLowering, Z3Lowering
from kvhit.spec.terms import and_, eq, ite, max_, not_, or_


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


def _later_pass(P, ctx, cache, sizes, n_tokens, rules, tag: str):
    """Pass 1 from the loop's start, exactly, and one later pass from any state the loop can be in when it
    starts a later pass (module docstring): ``(first, later, reachable)``. ``first``: the loop's ``start``,
    and pass 1's candidate ``c``, ``verified`` set, ``longest`` and ``reach``; ``later``: the pass's start
    ``L`` and ``verified`` set, and its ``c``, ``verified_after``, ``longest`` and ``reach``; ``reachable``
    the condition on ``L``. The one definition of that set of states, which the summary and its lemmas
    (:data:`LEMMAS`) share. ``P``: the spec's functions, or refimpl's when a lemma's counterexample is
    replayed."""
    hashes = P.num_hashes(sizes, n_tokens)
    start = P.max_length_within_hashes(sizes, n_tokens, rules)
    groups = range(len(sizes.groups))
    c1, verified1, lengths1, longest1, reach1 = P.hybrid_pass(
        cache, sizes, hashes, start, tuple(False for _ in groups), tuple(0 for _ in groups), True, rules)
    last = ctx.fresh(f"{tag}_L")
    verified = tuple(ctx.fresh_bool(f"{tag}_verified{k}") for k in groups)
    # == : refimpl's sizes carry refimpl's Kind
    lengths = tuple(lengths1[k] if sg.kind == Kind.FULL else ctx.fresh(f"{tag}_length{k}")
                    for k, sg in enumerate(sizes.groups))
    c, verified_after, _, longest, reach = P.hybrid_pass(cache, sizes, hashes, last, verified, lengths, False,
                                                         rules)
    reachable = and_(and_(last >= 0, last <= c1), eq(last % sizes.alignment, 0))
    first = SimpleNamespace(start=start, c=c1, verified=verified1, longest=longest1, reach=reach1)
    later = SimpleNamespace(L=last, verified=verified, c=c, verified_after=verified_after, longest=longest,
                            reach=reach)
    return first, later, reachable


def verified_hold(P, cache, sizes, n_tokens, candidate, verified, rules):
    """Every EAGLE group in ``verified`` serves its dropping lookup at ``candidate``: looked up as a pass
    looks a dropping group up (:func:`kvhit.spec.policy.pass_lookup`), it returns at least ``candidate``.
    What a verification is meant to certify, and what :func:`verified_groups_hold_their_drop` proves a
    pass keeps."""
    hashes = P.num_hashes(sizes, n_tokens)
    held = True
    for k, sg in enumerate(sizes.groups):
        if sg.drops:
            n, _ = P.pass_lookup(cache, sizes, k, hashes, candidate, True, rules)
            held = and_(held, or_(not_(verified[k]), n >= candidate))
    return held


def hit_tokens_summary(ctx, cache, sizes, n_tokens, rules):
    """``(hit, reach, longest, converged)`` of vLLM's Hybrid loop over every run (module docstring);
    ``converged`` says the summary's inputs describe a run (the claim assumes it, as it assumes the unrolled
    loop's). With the lemmas (:data:`LEMMAS`) proved for these sizes (``ctx.loop_lemmas[sizes]``), the
    passes in between read within the hashes (:func:`later_passes_read_within_hashes`), the last pass starts
    from verified groups that hold (:func:`verified_groups_hold_their_drop`), and the run is recorded
    (``ctx.loop_runs``) so that :func:`loop_facts` can say it stops at or above every valid length below its
    start (:func:`passes_keep_valid_lengths`)."""
    tag = f"loop{len(ctx.symbols)}"
    first, last, reachable = _later_pass(spec_policy, ctx, cache, sizes, n_tokens, rules, tag)
    stops_at_once = first.c >= first.start
    longest_between, reach_between = ctx.fresh(f"{tag}_longest_between"), ctx.fresh(f"{tag}_reach_between")
    later = and_(and_(reachable, last.c >= last.L), longest_between <= first.c)
    lemmas = getattr(ctx, "loop_lemmas", {}).get(sizes, ())
    if WITHIN_HASHES in lemmas:
        later = and_(later, reach_between <= spec_policy.num_hashes(sizes, n_tokens) * sizes.hash_block)
    if VERIFIED_HOLD in lemmas:
        later = and_(later, verified_hold(spec_policy, cache, sizes, n_tokens, last.L, last.verified, rules))
    hit = ite(stops_at_once, first.start, last.L)
    if KEEPS_VALID in lemmas:
        ctx.loop_runs.append((cache, sizes, n_tokens, first.start, hit))
    longest = ite(stops_at_once, first.longest, max_(max_(first.longest, longest_between), last.longest))
    reach = ite(stops_at_once, first.reach, max_(max_(first.reach, reach_between), last.reach))
    return hit, reach, longest, or_(stops_at_once, later)


# -- the summary's lemmas -----------------------------------------------------------------------------
# The summary lets every pass between the first and the last do anything a pass can. Three facts about single
# passes narrow that, each proved by a check of its own on the configuration's read side before the summary
# relies on it (:func:`check_every_run`): a pass from any state the summary admits reads within the request's
# hashes, keeps every valid length at or below its start, and leaves verified groups that hold if it started
# from such. By induction over the passes, every run then reads within the hashes, stops at or above every
# valid length below the loop's start, and starts its last pass from verified groups that hold, which is what
# the summary is told (and nothing else), so its PROVED still holds for every run.

def later_passes_read_within_hashes(ctx):
    """For every N and cache state, a later pass of vLLM's loop from any state the loop's summary admits
    (candidate L a multiple of A with 0 <= L <= c1, pass 1's candidate; the full-attention lengths pass 1 set;
    any EAGLE-verified set) reads no block hash past the request's: its reach is at most |H| * h."""
    sizes = ctx.sizes()
    _, later, reachable = _later_pass(ctx.P, ctx, ctx.cache, sizes, ctx.n, ctx.rules, "later")
    ctx.show("reach", later.reach)
    return reachable, later.reach <= ctx.P.num_hashes(sizes, ctx.n) * sizes.hash_block


def passes_keep_valid_lengths(ctx):
    """For every N and cache state, and every multiple t of A with 0 < t that every group serves (in the
    sense of hit_is_valid_in_every_group): pass 1 of vLLM's loop, from its start, returns at least t if t is
    at most that start; and a later pass from any state the loop's summary admits (as in
    later_passes_read_within_hashes) returns at least t if t is at most its candidate L."""
    sizes = ctx.sizes()
    first, later, reachable = _later_pass(ctx.P, ctx, ctx.cache, sizes, ctx.n, ctx.rules, "later")
    t = ctx.fresh("t") * sizes.alignment
    valid = and_(t > 0, ctx.serves(t))
    ctx.show("t", t)
    ctx.show("passes", (first.c, later.c))
    keeps_first = or_(t > first.start, first.c >= t)
    keeps_later = or_(or_(not_(reachable), t > later.L), later.c >= t)
    return valid, and_(keeps_first, keeps_later)


def verified_groups_hold_their_drop(ctx):
    """For every N and cache state: when pass 1 of vLLM's loop does not stop the loop, every EAGLE group it
    leaves verified serves its dropping lookup at the candidate it returns (:func:`verified_hold`); and a
    later pass from any state the loop's summary admits whose verified groups hold at its candidate ``L``
    leaves, when it does not stop the loop, verified groups that hold at the candidate it returns. By
    induction, the last pass of every run starts from verified groups that hold."""
    sizes = ctx.sizes()
    first, later, reachable = _later_pass(ctx.P, ctx, ctx.cache, sizes, ctx.n, ctx.rules, "later")

    def hold(candidate, verified):
        return verified_hold(ctx.P, ctx.cache, sizes, ctx.n, candidate, verified, ctx.rules)

    ctx.show("passes", (first.c, later.c))
    keeps_first = or_(first.c >= first.start, hold(first.c, first.verified))
    premise = and_(reachable, hold(later.L, later.verified))
    keeps_later = or_(or_(not_(premise), later.c >= later.L), hold(later.c, later.verified_after))
    return True, and_(keeps_first, keeps_later)


WITHIN_HASHES, KEEPS_VALID = "later_passes_read_within_hashes", "passes_keep_valid_lengths"
VERIFIED_HOLD = "verified_groups_hold_their_drop"
# each lemma's name and claim
LEMMAS = {WITHIN_HASHES: later_passes_read_within_hashes, KEEPS_VALID: passes_keep_valid_lengths,
          VERIFIED_HOLD: verified_groups_hold_their_drop}


def loop_facts(ctx) -> list:
    """What :func:`passes_keep_valid_lengths` gives each summarised run the context recorded: at every point x
    the claim asked validity of on the run's cache and sizes (``ctx.served``), and at the claim's probes
    (``ctx.probes``, the values it compares a hit with) on the run's cache, if x is a positive multiple of A
    that every group serves to the run's prompt and x is at most the run's start, the run stops at or above
    x (by induction over its passes). A fact at any point is sound; these are the points a claim needs."""
    from .model import SPEC, serves

    facts = []
    for cache, sizes, n_tokens, start, hit in ctx.loop_runs:
        points = [(x, and_(eq(p_n, n_tokens), valid)) for p_cache, p_sizes, p_n, x, valid in ctx.served
                  if p_cache is cache and p_sizes == sizes]
        points += [(x, serves(SPEC, cache, sizes, x, n_tokens)) for x in ctx.probes]
        for x, valid in points:
            premise = and_(valid, and_(and_(x > 0, eq(x % sizes.alignment, 0)), x <= start))
            facts.append(or_(not_(premise), x <= hit))
    return facts


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
    simple case, the summary is tried first, alone and then with the lemmas proved on the configuration
    (:func:`proved_lemmas`); if it does not prove the claim, the unrolled check decides, and a PROVED from it
    carries ``cex = {"loop": ...}`` saying it covers only the runs within its passes. Each check is tried
    under the scans' contracts first (:func:`check_by_contract`)."""
    from kvhit.spec.sizes import derive_sizes

    sizes = derive_sizes(config.layout, config.speculation, rules.scale_replicated)
    if not summarised(sizes, rules):
        return check_by_contract(invariant, rules, config)
    # The summary is sound where every pass stays within its start (hit_loop_terminates, on the
    # configuration's read side, with and without its speculation): checked here first, not assumed.
    terminates, seconds, spent = _terminates(rules, config)
    if terminates:
        try:
            verdict, more_seconds, cex, more_spent = check_by_contract(invariant, rules, config, summary=True)
            seconds, spent = seconds + more_seconds, spent + more_spent
            if verdict == "PROVED":
                return verdict, seconds, None, spent
            # the summary with what single passes are proved to keep (LEMMAS)
            proved, more_seconds, more_spent = proved_lemmas(rules, config)
            seconds, spent = seconds + more_seconds, spent + more_spent
            if any(proved.values()):
                verdict, more_seconds, cex, more_spent = check_by_contract(
                    invariant, rules, config, summary=True, loop_lemmas=proved)
                seconds, spent = seconds + more_seconds, spent + more_spent
                if verdict == "PROVED":
                    return verdict, seconds, None, spent
        except LoopNotSummarised:
            pass
    verdict, more_seconds, cex, more_spent = check_by_contract(invariant, rules, config)
    if verdict == "PROVED":
        cex = {WITHIN_PASSES: f"runs within {spec_policy.pass_bound(sizes)} passes"}
    return verdict, seconds + more_seconds, cex, spent + more_spent


def check_by_contract(invariant, rules, config, summary: bool = False, loop_lemmas=None):
    """:func:`kvhit.proofs.model.check`, tried first with every scan replaced by its contract (sound for
    PROVED: :class:`~kvhit.spec.lower_z3.ContractLowering`); where that does not prove the claim, the exact
    lowering decides. Seconds and units count both tries. Where ``invariant.by_contract`` says the try was
    measured not to decide the claim, the exact lowering decides alone."""
    from .model import check

    if not invariant.by_contract(config, rules):
        return check(invariant, rules, config, summary=summary, loop_lemmas=loop_lemmas)
    verdict, seconds, cex, spent = check(invariant, rules, config, summary=summary, contract=True,
                                         loop_lemmas=loop_lemmas)
    if verdict == "PROVED":
        return verdict, seconds, cex, spent
    verdict, more_seconds, cex, more_spent = check(invariant, rules, config, summary=summary,
                                                   loop_lemmas=loop_lemmas)
    return verdict, seconds + more_seconds, cex, spent + more_spent


def _read_sides(config):
    """The configuration's read side under each speculative setting a claim on it runs the loop with: the
    configuration's own and none (the EAGLE loss compares the two runs)."""
    from dataclasses import replace

    from kvhit.spec.domain import NO_SPECULATION

    from .model import READ_SIDE

    return [replace(config, speculation=speculation, retention=READ_SIDE)
            for speculation in dict.fromkeys((config.speculation, NO_SPECULATION))]


def _terminates(rules, config):
    """``(PROVED, seconds, rlimit)`` of :func:`kvhit.proofs.termination.hit_loop_terminates` for the policy
    on the configuration's read side, under each speculative setting a claim on it runs the loop with (the
    summary stands in for every such run)."""
    from .termination import INVARIANTS

    seconds, spent = 0.0, 0
    for read in _read_sides(config):
        verdict, more_seconds, _, more_spent = check_by_contract(INVARIANTS[0], rules, read)
        seconds, spent = seconds + more_seconds, spent + more_spent
        if verdict != "PROVED":
            return False, seconds, spent
    return True, seconds, spent


def lemma_invariants():
    from .model import Invariant

    return tuple(Invariant(name, claim, "loop") for name, claim in LEMMAS.items())


# (policy, configuration's read side) -> the lemmas proved there, with the seconds and units that took: a
# process checks them once, however many claims on that configuration fall back to them.
_PROVED: dict = {}


def proved_lemmas(rules, config):
    """``(lemmas, seconds, rlimit)``: ``lemmas`` maps the sizes of each speculative setting a claim on the
    configuration runs the loop under (the configuration's and none, which the EAGLE loss compares with) to
    the names of :data:`LEMMAS` PROVED for the policy on the configuration's read side under that setting
    (checked once per process; the seconds and units of the first asking only). A lemma speaks of single
    passes, so no loop is unrolled, and a REFUTED is a real counterexample to the lemma (replayed by
    refimpl), though perhaps from a state no run reaches."""
    from kvhit.spec.sizes import derive_sizes

    lemmas, seconds, spent = {}, 0.0, 0
    for read in _read_sides(config):
        key = (rules, read)
        if key not in _PROVED:
            proved = []
            for lemma in lemma_invariants():
                verdict, more_seconds, _, more_spent = check_by_contract(lemma, rules, read)
                seconds, spent = seconds + more_seconds, spent + more_spent
                if verdict == "PROVED":
                    proved.append(lemma.name)
            _PROVED[key] = tuple(proved)
        lemmas[derive_sizes(read.layout, read.speculation, rules.scale_replicated)] = _PROVED[key]
    return lemmas, seconds, spent
