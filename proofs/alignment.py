"""Where a hit may land: on the alignment, below the last token, within the hashes."""

from kvhit.spec.terms import and_, eq, max_

from .model import Invariant


def hit_is_aligned_and_capped(ctx):
    """For every prompt length N >= 1 and cache state: hit % A == 0 and 0 <= hit <= N - 1 and
    hit <= |H| * h (the hit is a multiple of the alignment, leaves the last token to recompute, and never
    passes the request's block hashes)."""
    sizes = ctx.sizes()
    hit, _, _, converged = ctx.hit()
    ctx.show("hit", hit)
    hashes = ctx.P.num_hashes(sizes, ctx.n)
    claim = and_(and_(eq(hit % sizes.alignment, 0), hit >= 0),
                 and_(hit <= max_(ctx.n - 1, 0), hit <= hashes * sizes.hash_block))
    return converged, claim


def lookup_stays_within_hashes(ctx):
    """For every N and cache state: every boundary any lookup reads is at most |H| * h (a read past the
    hashes raises IndexError in vLLM; the hit is then no hit at all but a crashed scheduler step)."""
    sizes = ctx.sizes()
    _, reach, _, converged = ctx.hit()
    ctx.show("reach", reach)
    ctx.show("hash_reach", ctx.P.num_hashes(sizes, ctx.n) * sizes.hash_block)
    return converged, reach <= ctx.P.num_hashes(sizes, ctx.n) * sizes.hash_block


INVARIANTS = (
    Invariant("hit_is_aligned_and_capped", hit_is_aligned_and_capped, "alignment",
              refuted_by=("no_last_token_cap",)),
    Invariant("lookup_stays_within_hashes", lookup_stays_within_hashes, "alignment",
              refuted_by=("peek_past_hashes",)),
)
