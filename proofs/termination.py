"""The hit computation terminates, with an explicit bound on its passes."""

from kvhit.spec.domain import Kind
from kvhit.spec.terms import and_, eq

from .model import Invariant


def hit_loop_terminates(ctx):
    """For every N, cache state and loop state (candidate L >= 0 on the first pass and a multiple of A on
    later ones, any eagle-verified set, any aligned full-attention lengths), one pass returns c with
    0 <= c <= L and c % A == 0. So L is a non-negative
    multiple of A after the first pass and falls by at least A on every pass that does not stop: the loop
    stops within floor((N - 1) / A) + 2 passes. No lookup of a Hybrid pass returns more than the pass's
    start (its longest is at most L), and the first pass leaves non-negative aligned full-attention lengths
    (the state later passes are checked from), which the loop's two-pass summary relies on
    (kvhit.proofs.loop).
    (The reference's pass is its candidate scan; a single group's pass is its lookup.)"""
    sizes = ctx.sizes()
    P = ctx.P
    hashes = P.num_hashes(sizes, ctx.n)
    covered = hashes * sizes.hash_block
    bound = ctx.fresh("L")
    assumption = bound >= 0
    outs = []
    claim = True
    if ctx.rules.declarative:
        extents = P.group_extents(ctx.cache, sizes, covered)
        outs.append((P.reference_pass(ctx.cache, sizes, bound, extents, covered, ctx.rules), bound))
    elif sizes.unitary:
        outs.append((P.lookup(ctx.cache, sizes, 0, hashes, bound, sizes.groups[0].drops, ctx.rules)[0], bound))
    else:
        verified = tuple(ctx.fresh_bool(f"verified{k}") for k in range(len(sizes.groups)))
        lengths = tuple(ctx.fresh(f"length{k}") for k in range(len(sizes.groups)))
        for length in lengths:
            assumption = and_(assumption, and_(length >= 0, eq(length % sizes.alignment, 0)))
        later = ctx.fresh("L_after_first_pass")  # after the first pass the candidate is aligned
        assumption = and_(assumption, and_(later >= 0, eq(later % sizes.alignment, 0)))
        for first, start in ((True, bound), (False, later)):
            c, _, new_lengths, longest, _ = P.hybrid_pass(ctx.cache, sizes, hashes, start, verified, lengths,
                                                          first, ctx.rules)
            outs.append((c, start))
            # no lookup of a pass returns more than its start, and the first pass leaves the full-attention
            # lengths the later passes assume (the loop's summary relies on both)
            claim = and_(claim, longest <= start)
            for k, sg in enumerate(sizes.groups):
                if first and sg.kind is Kind.FULL:
                    claim = and_(claim, and_(new_lengths[k] >= 0, eq(new_lengths[k] % sizes.alignment, 0)))
    for k, (c, start) in enumerate(outs):
        ctx.show(f"pass{k}", c)
        claim = and_(claim, and_(and_(c >= 0, c <= start), eq(c % sizes.alignment, 0)))
    return assumption, claim


INVARIANTS = (
    Invariant("hit_loop_terminates", hit_loop_terminates, "termination",
              refuted_by=("peek_without_pop",)),
)
