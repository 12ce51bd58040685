"""What EAGLE/MTP may cost: one drop unit of cached tokens, then alignment, and nothing more."""

from kvhit.spec.domain import NO_SPECULATION, Mode
from kvhit.spec.terms import and_, floor_to, min_, not_, or_

from .model import SAME_HIT, Invariant


def eagle_loses_at_most_one_block_beyond_alignment(ctx):
    """For every N and cache state, with H0 the hit without speculation and H1 the hit with it:
    (a) if H0 <= R1 and every group serves H0 with speculation (each dropping EAGLE group holds its drop
    unit past H0), then H1 >= H0; and (b) if every group holds every block up to N's hashes, then
    H1 >= floor_A(min(N - 1, R1 - D, C1)). Here R1 = |H| * h with speculation (lookahead hashes make |H| =
    (N - L) // h), D, "one eagle block", is the drop unit: in drop mode the largest eagle margin of a
    dropping group (its block, or h when it is looked up at hash granularity); 0 in lookahead mode; and C1
    the scheduler's cap with speculation, where auxiliary outputs cap lookups (the capped group's whole
    blocks within R1, so lookahead hashes can cost a whole block of it: full 1600 at hash unit 160, N = 3200,
    L = 1 hits 1600 where 3040 without); R1 without them. (Both hits are of runs of vLLM's loop that stop, as
    every loop claim assumes.)"""
    sizes1 = ctx.sizes()
    h0, _, _, converged0 = ctx.hit(NO_SPECULATION)
    h1, _, _, converged = ctx.hit()
    ctx.show("hit_without_speculation", h0)
    ctx.show("hit", h1)
    sizes0 = ctx.sizes(NO_SPECULATION)
    r1 = ctx.P.num_hashes(sizes1, ctx.n) * sizes1.hash_block
    r0 = ctx.P.num_hashes(sizes0, ctx.n) * sizes0.hash_block
    peek_held = and_(h0 <= r1, ctx.serves(h0))
    part_a = or_(not_(peek_held), h1 >= h0)
    top = ctx.P.capped_top(ctx.cache, sizes1, min_(ctx.n - 1, r1 - sizes1.eagle_unit), r1)
    bound = ctx.probe(floor_to(top, sizes1.alignment))
    part_b = or_(not_(ctx.dense(r0)), h1 >= bound)
    return and_(converged0, converged), and_(part_a, part_b)


INVARIANTS = (
    Invariant("eagle_loses_at_most_one_block_beyond_alignment",
              eagle_loses_at_most_one_block_beyond_alignment, "eagle",
              applies=lambda config: config.speculation.mode is not Mode.NONE,
              refuted_by=("historical",), hits=2, witnesses=1,
              # vllm_0_33_repaired: composed by default (59 s and 2.0 G units of checks whole), whole in --extended
              by_lemma=(("vllm_0_33_repaired", SAME_HIT),)),
)
