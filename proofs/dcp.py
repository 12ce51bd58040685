"""Decode context parallelism: it scales sharded groups' blocks, and nothing else."""

from kvhit.spec.terms import and_

from .model import Invariant


def dcp_scales_only_sharded_groups(ctx):
    """For every configuration: each group's effective block is block * DCP if the group is sharded and
    block otherwise (replicated draft groups and Mamba are never scaled); the other invariants are checked
    at every DCP size of the domain."""
    sizes = ctx.sizes()
    layout = ctx.config.layout
    ok = True
    for group, effective in zip(layout.groups, sizes.effective_blocks):
        expected = group.block_size * layout.dcp if group.dcp_sharded else group.block_size
        ok = and_(ok, effective == expected)
    ctx.show("effective_blocks", sizes.effective_blocks)
    return True, ok


INVARIANTS = (
    Invariant("dcp_scales_only_sharded_groups", dcp_scales_only_sharded_groups, "dcp",
              refuted_by=("dcp_scales_replicated",)),
)
