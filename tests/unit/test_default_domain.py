"""What the default run's domain holds beyond the catalogue (``proofs/domains.py``)."""

import pytest

from kvhit.proofs import runner
from kvhit.proofs.domains import HEAVY, configs, layouts, reference_only
from kvhit.proofs.model import Config
from kvhit.spec.domain import Kind, Mode, Speculation
from kvhit.spec.policy import KNOWN_BAD
from kvhit.spec.retention import write_side_unmodelled
from kvhit.spec.sizes import derive_sizes


@pytest.mark.parametrize("name, unit", [("qwen35", 1600), ("qwen35_pmu160", 160)])
def test_the_qwen35_like_layouts_are_configurations_of_two_spec_groups(name, unit):
    """Full attention holding the MTP layer, and three Mamba (GDN) KV-cache groups of one spec, which the
    coordinator looks up as one spec group: the read side checked in every speculative setting of a layout of
    more than two KV-cache groups; the write side of ``qwen35`` in every write-side setting at R = None, 0 and
    two scheduler blocks (``qwen35_pmu160``'s is --extended's, as ``qwen3next_pmu160``'s, whose dominance lemma
    took minutes on one configuration)."""
    ours = [c for c in configs(extended=False) if c.layout.name == name]
    assert sorted(c.speculation.describe() for c in ours if not c.write_side) == sorted(
        ["none", "lookahead Lp=1", "lookahead Lp=2 mtp2", "lookahead Lp=4 mtp4", "drop Lp=1"])
    written = {(c.speculation.describe(), c.retention) for c in ours if c.write_side}
    assert written == ({(s, r) for s in ("none", "lookahead Lp=1", "lookahead Lp=2 mtp2", "drop Lp=1",
                                         "drop Lp=2 mtp2") for r in (None, 0, 3200)} if name == "qwen35" else set())
    for config in ours:
        sizes = derive_sizes(config.layout, config.speculation)
        full, mamba = sizes.groups
        assert (full.kind, full.members, full.block) == (Kind.FULL, (0,), 1600)
        assert (mamba.kind, mamba.members, mamba.block) == (Kind.MAMBA, (1, 2, 3), 1600)
        assert sizes.hash_block == unit and not sizes.unitary
        assert full.drops == (config.speculation.mode is Mode.DROP) and not mamba.drops  # only the EAGLE group


def test_drop_with_two_mtp_modules_reads_as_drop_on_every_layout():
    """The read side enumerates drop once: on every layout of the extended domain, drop with two MTP modules
    (``Lp = 2``) has a read-side twin, drop with ``Lp = 1``, whose lookups read the same sizes (the prefill
    lookahead aside, which only the write side reads: tests/properties/test_read_twin.py), so the twin's
    read-side verdicts are its own. Non-vacuity: lookahead with two modules has no such twin."""
    read = [c for c in configs(extended=True) if not c.write_side]
    mtp2_drop = Speculation(Mode.DROP, 2, multi_module_mtp=True)
    checked = 0
    for layout in layouts(extended=True):
        try:
            derive_sizes(layout, mtp2_drop)
        except ValueError:
            continue  # the spec rejects drop on this layout (chunked local attention, alone or in Llama 4)
        twin = runner.read_twin(Config(layout, mtp2_drop, None), read)
        assert twin is not None, layout.name
        assert read[twin].speculation == Speculation(Mode.DROP, 1), layout.name
        checked += 1
        lookahead = runner.read_twin(Config(layout, Speculation(Mode.LOOKAHEAD, 2, multi_module_mtp=True), None),
                                     [c for c in read if c.speculation.mode is not Mode.LOOKAHEAD])
        assert lookahead is None, layout.name
    assert checked == len(layouts(extended=True)) - 2  # all but chunked64 and llama4


def test_the_heavy_layouts_are_in_the_default_run_for_the_reference_only():
    """HEAVY layouts' read side is checked by default for the reference in every speculative setting, and the
    write side of DeepSeek-V4's two layouts and three_kind for the reference's first-repeat claim and
    sparseness, at every interval, where the adapter enforces the write side; vLLM's policies, the releases,
    the known-bad variants and the costlier write-side claims there are --extended's."""
    default = configs(extended=False)
    heavy = [c for c in default if c.layout.name in HEAVY]
    assert {c.layout.name for c in heavy} == set(HEAVY)
    written = [c for c in heavy if c.write_side]
    assert {c.layout.name for c in written} == {"dsv4_cuda", "dsv4_report", "three_kind"}
    assert {c.retention for c in written if c.layout.name == "dsv4_report"} == {None, 0, 32768}
    # three_kind with two MTP modules in drop mode is left to vLLM (its Mamba group, read at hash granularity,
    # drops), and only there
    assert {c.speculation.describe() for c in written if c.layout.name == "three_kind"} == {
        "none", "lookahead Lp=1", "lookahead Lp=2 mtp2", "drop Lp=1"}
    assert all(not write_side_unmodelled(derive_sizes(c.layout, c.speculation)) for c in written)
    assert all(reference_only(c, extended=False) and not reference_only(c, extended=True) for c in heavy)
    assert {c.speculation.describe() for c in heavy if c.layout.name == "dsv4_cuda" and not c.write_side} == {
        "none", "lookahead Lp=1", "lookahead Lp=2 mtp2", "lookahead Lp=4 mtp4", "drop Lp=1"}
    old = runner.EXTENDED, runner._CONFIGS
    try:
        runner.EXTENDED, runner._CONFIGS = False, None
        on_heavy = {(name, policy) for name, policy, i, scenario in runner.tasks()
                    if scenario is None and runner._configs()[i].layout.name in HEAVY}
    finally:
        runner.EXTENDED, runner._CONFIGS = old
    assert {policy for _, policy in on_heavy} == {"reference"}
    read_side = {inv.name for inv in runner.INVARIANTS if not inv.write_side}
    assert {name for name, _ in on_heavy} == read_side | {"scheduler_and_mask_boundaries_agree",
                                                           "retention_is_sparse"}


def test_each_write_side_known_bad_variant_runs_once_by_default():
    """Non-vacuity needs one refutation: each write-side known-bad variant of an invariant runs on one
    configuration of the default run, the report's layout in drop mode at R = 0, with two MTP modules only
    for retain_prompt_end (PROVED with one). `make prove` fails unless each such row is REFUTED."""
    cfgs = runner._configs()
    write = {inv.name for inv in runner.INVARIANTS if inv.write_side}
    bad = {}
    for name, policy, index, scenario in runner.tasks():
        if name in write and policy in KNOWN_BAD and scenario is None:
            bad.setdefault((name, policy), []).append(cfgs[index].label)
    assert {key[0] for key in bad} == write
    for (name, policy), labels in bad.items():
        expected = "qwen3next drop Lp=2 mtp2 R=0" if policy == "retain_prompt_end" else "qwen3next drop Lp=1 R=0"
        assert labels == [expected], (name, policy, labels)
