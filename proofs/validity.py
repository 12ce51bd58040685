"""Soundness and optimality: the hit is one every group can serve, and no longer one is."""

from kvhit.spec.terms import and_, eq, min_, not_, or_

from .model import Invariant


def hit_is_valid_in_every_group(ctx):
    """For every N and cache state: hit == 0 or every group serves the hit (full attention: its cached
    prefix reaches it; sliding window: the window before it is cached; Mamba: the state at it is cached),
    and every dropping EAGLE group also holds its drop unit [hit, hit + margin) within the hashes, which it
    recomputes. A violation means the engine computes with KV it does not have: wrong outputs."""
    hit, _, _, converged = ctx.hit()
    ctx.show("hit", hit)
    return converged, or_(eq(hit, 0), ctx.serves(hit))


def hit_is_the_longest_valid(ctx):
    """For every N and cache state there is no y with y % A == 0, hit < y <= min(N - 1, |H| * h) that
    every group serves (in the sense of hit_is_valid_in_every_group): the hit is the longest valid one."""
    sizes = ctx.sizes()
    hit, _, _, converged = ctx.hit()
    ctx.show("hit", hit)
    y = ctx.fresh("y")
    cap = min_(ctx.n - 1, ctx.P.num_hashes(sizes, ctx.n) * sizes.hash_block)
    longer = and_(and_(eq(y % sizes.alignment, 0), y > hit), and_(y <= cap, ctx.serves(y)))
    return converged, not_(longer)


INVARIANTS = (
    Invariant("hit_is_valid_in_every_group", hit_is_valid_in_every_group, "validity",
              refuted_by=("eagle_never_recomputes",)),
    Invariant("hit_is_the_longest_valid", hit_is_the_longest_valid, "validity",
              refuted_by=("historical", "historical_repeat_drop")),
)
