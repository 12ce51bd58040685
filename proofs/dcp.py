"""Decode context parallelism: it scales sharded groups' blocks, and nothing else."""

from kvhit.spec.terms import and_

from .model import Invariant


def dcp_scales_only_sharded_groups(ctx):
    """For every configuration: each KV-cache group is looked up in exactly one spec group, whose block (what
    its manager looks it up with) is the group's ``block_size`` times the DCP size if the group is sharded,
    and its ``block_size`` if it is replicated (draft groups marked so, and Mamba). Read from the layout's
    own fields and the spec groups, not from ``effective_block``; the other invariants are checked at every
    DCP size of the domain."""
    sizes = ctx.sizes()
    layout = ctx.config.layout
    looked_up_with = {}
    for sg in sizes.groups:
        for member in sg.members:
            looked_up_with.setdefault(member, []).append(sg.block)
    ok = sorted(looked_up_with) == list(range(len(layout.groups)))
    ok = ok and all(len(blocks) == 1 for blocks in looked_up_with.values())
    seen = tuple(looked_up_with.get(i, [0])[0] for i in range(len(layout.groups)))
    for group, block in zip(layout.groups, seen):
        ok = and_(ok, block == group.block_size * (layout.dcp if group.dcp_sharded else 1))
    ctx.show("effective_blocks", seen)  # the block each KV-cache group is looked up with
    return True, ok


INVARIANTS = (
    Invariant("dcp_scales_only_sharded_groups", dcp_scales_only_sharded_groups, "dcp",
              refuted_by=("dcp_scales_replicated",)),
)
