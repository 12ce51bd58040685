"""What the default run's domain holds beyond the catalogue (``proofs/domains.py``)."""

import pytest

from kvhit.proofs.domains import configs
from kvhit.spec.domain import Kind, Mode
from kvhit.spec.sizes import derive_sizes


@pytest.mark.parametrize("name, unit", [("qwen35", 1600), ("qwen35_pmu160", 160)])
def test_the_qwen35_like_layouts_are_read_side_configurations_of_two_spec_groups(name, unit):
    """Full attention holding the MTP layer, and three Mamba (GDN) KV-cache groups of one spec, which the
    coordinator looks up as one spec group: checked in every speculative setting of a layout of more than two
    KV-cache groups, on the read side only."""
    ours = [c for c in configs(extended=False) if c.layout.name == name]
    assert sorted(c.speculation.describe() for c in ours) == sorted(
        ["none", "lookahead Lp=1", "lookahead Lp=2 mtp2", "drop Lp=1"])
    assert not any(c.write_side for c in ours)
    for config in ours:
        sizes = derive_sizes(config.layout, config.speculation)
        full, mamba = sizes.groups
        assert (full.kind, full.members, full.block) == (Kind.FULL, (0,), 1600)
        assert (mamba.kind, mamba.members, mamba.block) == (Kind.MAMBA, (1, 2, 3), 1600)
        assert sizes.hash_block == unit and not sizes.unitary
        assert full.drops == (config.speculation.mode is Mode.DROP) and not mamba.drops  # only the EAGLE group
