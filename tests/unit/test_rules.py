"""The policies' rules are enums: a misspelt rule is refused rather than read as vLLM's, and the spec's rules
mean the same in the generated refimpl (the proofs replay refimpl with the spec's rules)."""

import pytest

from kvhit import refimpl
from kvhit.spec import policy as spec_policy


@pytest.mark.parametrize("module", [spec_policy, refimpl], ids=["spec", "refimpl"])
@pytest.mark.parametrize("field, value, enum", [("replay", "resum", "Replay"), ("junction", "next-block", "Junction")])
def test_a_misspelt_rule_is_refused(module, field, value, enum):
    with pytest.raises(ValueError, match=f"'{value}' is not a valid {enum}"):
        module.Rules("typo", **{field: value})


def test_a_rule_given_by_its_value_becomes_the_member():
    rules = refimpl.Rules("by_value", replay="resume", junction="next_block")
    assert (rules.replay, rules.junction) == (refimpl.Replay.RESUME, refimpl.Junction.NEXT_BLOCK)
    assert rules.replay is refimpl.Replay.RESUME


@pytest.mark.parametrize("name", sorted(refimpl.ALL_POLICIES))
def test_the_spec_rules_write_in_refimpl_as_refimpl_rules_do(name):
    """Qwen3-Next with MTP 2 in drop mode, where every replay rule keeps state somewhere else and the
    junction rules differ: what a first request leaves and the hits of its resends are the same whether
    refimpl is given its own rules or the spec's."""
    layout = refimpl.Layout((refimpl.Group("full", 1600), refimpl.Group("mamba", 1600)))
    speculation = refimpl.Speculation("drop", 2, multi_module_mtp=True)
    ours, theirs = refimpl.ALL_POLICIES[name], spec_policy.ALL_POLICIES[name]
    sizes = refimpl.derive_sizes(layout, speculation, ours.scale_replicated)
    for n in (4800, 8000, 11910):
        for interval in (0, 3200):
            assert (refimpl.request_writes(sizes, n, interval, theirs)
                    == refimpl.request_writes(sizes, n, interval, ours)), (n, interval)
            assert (refimpl.repeat_hits(sizes, n, interval, theirs, 3)
                    == refimpl.repeat_hits(sizes, n, interval, ours, 3)), (n, interval)
