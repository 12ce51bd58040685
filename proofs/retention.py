"""The write side agrees with the read side: what is retained is what a later request resumes at."""

from kvhit.spec.domain import Kind
from kvhit.spec.terms import and_, eq

from .model import Invariant


def _writes(ctx):
    sizes = ctx.sizes()
    return sizes, ctx.P.request_writes(sizes, ctx.n, ctx.config.retention, ctx.rules)


def scheduler_and_mask_boundaries_agree(ctx):
    """For every N, after one request with prompt N has run on an empty cache and been cached under the
    policy's own write side (retention interval R): (a) a resend of the N tokens and (b) every longer
    prompt N2 > N that extends them hit exactly what they would hit if every state the request computed
    had been retained (each group holding every boundary up to what it caches)."""
    sizes, groups = _writes(ctx)
    kept = ctx.written(groups)
    dense = ctx.written(ctx.P.dense_groups(sizes, ctx.n))
    n2 = ctx.fresh("N2")
    resend, _, _, c1 = ctx.P.hit_tokens(kept, sizes, ctx.n, ctx.rules)
    resend_dense, _, _, c2 = ctx.P.hit_tokens(dense, sizes, ctx.n, ctx.rules)
    sibling, _, _, c3 = ctx.P.hit_tokens(kept, sizes, n2, ctx.rules)
    sibling_dense, _, _, c4 = ctx.P.hit_tokens(dense, sizes, n2, ctx.rules)
    ctx.show("retained", tuple(g.points + g.ends for g in groups if g.kind in (Kind.MAMBA, Kind.SWA)))
    ctx.show("resume_point", resend_dense)
    ctx.show("first_repeat_hit", resend)
    ctx.show("sibling_hit_dense", sibling_dense)
    ctx.show("sibling_hit", sibling)
    assumption = and_(and_(and_(c1, c2), and_(c3, c4)), n2 > ctx.n)
    return assumption, and_(eq(resend, resend_dense), eq(sibling, sibling_dense))


def retention_is_sparse(ctx):
    """For every N, the first request with prompt N retains, in each Mamba group, at most ceil(N / R) + |B|
    states with retention interval R > 0 and at most |B| with R = 0, where B is the policy's replay
    boundaries (no junction exists on a first request); in each sliding-window group at most that many
    tails of the ``need`` blocks a hit reads (counted in blocks, every block when it keeps them all)."""
    sizes, groups = _writes(ctx)
    boundaries = len(ctx.P.replay_boundaries(sizes, ctx.n, ctx.rules))
    ok = True
    counts, bounds = [], []
    for g in groups:
        if g.kind in (Kind.SWA, Kind.MAMBA):
            count = ctx.P.retained_states(g)
            bound = ctx.P.retention_bound(sizes, g, ctx.n, ctx.config.retention, boundaries)
            counts.append(count)
            bounds.append(bound)
            ok = and_(ok, count <= bound)
    ctx.show("retained", tuple(counts))
    ctx.show("bound", tuple(bounds))
    return True, ok


def second_repeat_is_stable(ctx):
    """For every N, resending a prompt after its first request: the third repeat hits what the second did
    and records the same junction, so the cache stops changing and every k-th repeat (k >= 2) hits what
    the second did."""
    sizes, groups = _writes(ctx)
    interval = ctx.config.retention
    h1, j1, groups = ctx.P.repeat(sizes, ctx.n, interval, ctx.rules, groups)
    h2, j2, groups = ctx.P.repeat(sizes, ctx.n, interval, ctx.rules, groups)
    h3, j3, groups = ctx.P.repeat(sizes, ctx.n, interval, ctx.rules, groups)
    ctx.show("repeat_hits", (h1, h2, h3))
    ctx.show("junctions", (j1, j2, j3))
    return True, and_(eq(h3, h2), eq(j3, j2))


def _has_sparse_group(config):
    return any(g.kind in (Kind.SWA, Kind.MAMBA) for g in config.layout.groups)


INVARIANTS = (
    Invariant("scheduler_and_mask_boundaries_agree", scheduler_and_mask_boundaries_agree, "retention",
              applies=lambda config: config.write_side, refuted_by=("historical", "retain_prompt_end"),
              write_side=True),
    Invariant("retention_is_sparse", retention_is_sparse, "retention",
              applies=lambda config: config.write_side and config.retention is not None
              and _has_sparse_group(config), refuted_by=("retain_every_boundary",), write_side=True),
    # Three requests through vLLM's loop, each reading sliding-window tails at two junctions more, take
    # 30-45 s per drop-mode sliding-window configuration: those run with --extended.
    Invariant("second_repeat_is_stable", second_repeat_is_stable, "retention",
              applies=lambda config: config.write_side, refuted_by=("junction_past_hit",), write_side=True,
              heavy=lambda config: config.speculation.drop and any(g.kind is Kind.SWA
                                                                   for g in config.layout.groups)),
)
