"""kvhit plan: the ranking is what the refimpl gives when each setting is evaluated directly."""

import pytest

from kvhit import plan, refimpl
from kvhit.cli import main
from kvhit.explain import speculation
from kvhit.layouts import catalogue, configure
from kvhit.refimpl import CacheState, Speculation

POLICIES = ("reference", "vllm_0_33", "historical")


def _direct_mean(layout, spec, workload, policy):
    """Expected cached tokens per request through refimpl's public ``hit`` with a plain up_to cache."""
    groups = len(refimpl.derive_sizes(layout, spec).groups)
    return sum(refimpl.hit(layout, spec, n, CacheState.up_to([p] * groups), policy) for n, p in workload) / len(workload)


@pytest.mark.parametrize("name, spec, workload_args", [
    ("qwen3next", speculation("drop", 2, True), ("uniform:2000:30000", "uniform:0:3000", 300, 1)),
    ("gemma", speculation("drop", 1), ("uniform:100:5000", "fixed:0", 300, 2)),
    ("three_kind", speculation("lookahead", 1), ("normal:12000:4000", "choice:0,500", 200, 3)),
])
@pytest.mark.parametrize("policy", POLICIES)
def test_top_setting_really_gives_the_most_cached_tokens(name, spec, workload_args, policy):
    workload = plan.synthetic_workload(*workload_args)
    cands = plan.evaluate(plan.candidates(catalogue()[name], spec), workload)
    ranked, _ = plan.rank(cands, policy)
    direct = {s.label: _direct_mean(s.layout, s.speculation, workload, policy) for s in ranked}
    assert direct[ranked[0].label] == max(direct.values())
    for s in ranked:
        assert s.mean[policy] == pytest.approx(direct[s.label])
    assert [direct[s.label] for s in ranked] == sorted(direct.values(), reverse=True)


def test_block_size_candidates_follow_the_operator_groups():
    workload = [(n, n) for n in range(100, 3000, 37)]
    layout = catalogue()["llama_eagle"]
    cands = plan.evaluate(plan.candidates(layout, speculation("drop", 1), block_sizes=[16, 32, 64],
                                          operator_groups=(0, 1)), workload)
    blocks = {s.block_size: s.sizes.effective_blocks for s in cands.settings}
    assert blocks[32] == (32, 32) and blocks[64] == (64, 64)
    for s in cands.settings:
        direct_layout = configure(layout, block_size=s.block_size, operator_groups=(0, 1))
        assert s.mean["vllm_0_33"] == pytest.approx(
            _direct_mean(direct_layout, Speculation(s.mode, 1), workload, "vllm_0_33"))


def test_block_sizes_without_operator_groups_is_refused(capsys):
    assert main(["plan", "qwen3next", "--shared-prefix", "fixed:100", "--block-sizes", "16,32"]) == 2
    assert "no group of this layout follows --block-size" in capsys.readouterr().err


def test_impossible_settings_are_listed_as_rejected_with_the_domain_reason():
    cands = plan.candidates(catalogue()["dsv4_report"], speculation("drop", 1), prefix_match_units=["none", 8])
    assert [s.label for s in cands.settings] == ["pmu none, lookahead", "pmu none, drop"]
    assert ("pmu 8, drop", "group 5: effective block 4 is not a multiple of the hash unit 8") in cands.rejected


def test_settings_with_identical_sizes_are_evaluated_once():
    cands = plan.candidates(catalogue()["qwen3next"], speculation("none"), prefix_match_units=["none", 1600, 160])
    assert [s.label for s in cands.settings] == ["pmu none, none", "pmu 160, none"]
    assert cands.settings[0].same_as == ["pmu 1600, none"]


def test_plan_writes_the_png_and_prints_the_table(tmp_path, capsys):
    png = tmp_path / "plan.png"
    assert main(["plan", "dsv4_report", "--speculative", "drop", "--shared-prefix", "uniform:8000:70000",
                 "--requests", "200", "--plot", str(png)]) == 0
    out = capsys.readouterr().out
    assert "pmu none, lookahead" in out and "pmu none, drop" in out
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    import matplotlib.image

    height, width = matplotlib.image.imread(str(png)).shape[:2]
    assert width > 500 and height > 500


def test_workload_file_is_read_and_bad_lines_are_named(tmp_path):
    good = tmp_path / "w.txt"
    good.write_text("# prompts\n1000\n2000 1500  # shares 1500\n\n")
    assert plan.read_workload(str(good)) == [(1000, 1000), (2000, 1500)]
    for text, message in [("12 x\n", "w.txt:1: expected integers"), ("100 200\n", "between 0 and the prompt"),
                          ("0\n", "at least one token"), ("# nothing\n", "no requests"), ("1 2 3\n", "'N' or 'N P'")]:
        good.write_text(text)
        with pytest.raises(ValueError, match=message):
            plan.read_workload(str(good))


def test_synthetic_workload_is_seeded_and_checks_its_distribution():
    assert plan.synthetic_workload("uniform:10:20", "fixed:5", 50, 7) == plan.synthetic_workload(
        "uniform:10:20", "fixed:5", 50, 7)
    assert all(n == p + 5 and 10 <= p <= 20 for n, p in plan.synthetic_workload("uniform:10:20", "fixed:5", 50, 7))
    with pytest.raises(ValueError, match="cannot read distribution 'gauss:1'"):
        plan.synthetic_workload("gauss:1", "fixed:0", 5, 0)
