"""The main job, as `make prove` runs it: every invariant PROVED for reference, the expected divergences,
non-vacuity, and the DeepSeek-V4 report's numbers."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

FINDINGS = Path(__file__).resolve().parents[1] / "docs" / "findings.md"


@pytest.fixture(scope="module")
def prove():
    out = subprocess.run([sys.executable, "-m", "kvhit.cli", "prove", "--json", "--findings"], capture_output=True,
                         text=True, timeout=2400)
    assert out.returncode == 0, out.stderr[-4000:]
    return json.loads(out.stdout)


def test_kvhit_prove_passes_and_reproduces_the_deepseek_v4_report(prove):
    rows = {(r["invariant"], r["policy"]): r for r in prove["verdicts"]}
    assert all(r["verdict"] == "PROVED" for (inv, pol), r in rows.items() if pol == "reference")
    assert not any(r["verdict"] == "UNKNOWN" for r in rows.values())
    # every hybrid layout of the default run is vLLM's simple case: no verdict rests on unrolled passes
    assert not any(r["bounded_configs"] for r in rows.values())
    report = rows[("eagle_loses_at_most_one_block_beyond_alignment@dsv4_report_46240", "historical")]
    assert report["verdict"] == "REFUTED"
    cex = report["counterexample"]
    assert cex["N"] == 46240
    assert cex["replayed"] == {"hit_without_speculation": 32768, "hit": 16384}
    assert cex["reference_hit"] == 32768
    qwen = rows[("scheduler_and_mask_boundaries_agree@qwen3next_11910", "historical")]
    assert qwen["verdict"] == "REFUTED"
    shown = qwen["counterexample"]["replayed"]
    assert qwen["counterexample"]["N"] == 11910
    assert 11200 in shown["retained"][0] and 9600 not in shown["retained"][0]
    assert (shown["resume_point"], shown["first_repeat_hit"]) == (9600, 0)
    assert rows[("scheduler_and_mask_boundaries_agree@qwen3next_11910", "vllm_0_33")]["verdict"] == "PROVED"
    w4 = rows[("scheduler_and_mask_boundaries_agree@dsv4_report_46240_retention0", "vllm_0_33")]
    assert w4["verdict"] == "REFUTED"
    assert (w4["counterexample"]["replayed"]["resume_point"],
            w4["counterexample"]["replayed"]["first_repeat_hit"]) == (32768, 16384)


def test_the_repaired_policy_is_proved_everywhere_and_every_vllm_refutation_is_a_defect(prove):
    rows = prove["verdicts"]
    assert all(r["verdict"] == "PROVED" for r in rows if r["policy"] == "vllm_0_33_repaired")
    refuted = {(r["invariant"], c["config"]) for r in rows if r["policy"] == "vllm_0_33" for c in r["refuted_configs"]}
    attributed = [tuple(c.split(" / ", 1)) for d in prove["defects"] for c in d["configs"]]
    assert len(attributed) == len(set(attributed)) and set(attributed) == refuted
    for d in prove["defects"]:  # the smallest counterexample is no longer than any configuration's first one
        assert d["smallest"]["N"] <= min(c["N"] for r in rows if r["policy"] == "vllm_0_33"
                                         for c in r["refuted_configs"] if f"{r['invariant']} / {c['config']}"
                                         in d["configs"]), d


def test_vllm_0_32_shares_every_finding_of_0_33_that_needs_no_lookahead_hashes(prove):
    """vLLM 0.32.0 has no lookahead block hashes: its rows cover only the other settings, F1 (reads past the
    hashes with L >= 2) and W3 (a resend below N - 1 with lookahead) cannot occur, and the findings of 0.33's
    read and write side elsewhere (F2, F5, F6; W1, W2, W4) are refuted on exactly the configurations
    vllm_0_33's are."""
    rows = {(r["invariant"], r["policy"]): r for r in prove["verdicts"]}
    ours = {inv: r for (inv, policy), r in rows.items() if policy == "vllm_0_32"}
    assert set(ours) == {inv for inv, policy in rows if policy == "vllm_0_33"}
    for inv, r in ours.items():
        refuted = {c["config"] for c in r["refuted_configs"]}
        theirs = {c["config"] for c in rows[(inv, "vllm_0_33")]["refuted_configs"]}
        assert refuted == {c for c in theirs if "lookahead" not in c}, inv
        assert r["configs"] < rows[(inv, "vllm_0_33")]["configs"] or "@" in inv, inv
    for inv in ("hit_is_aligned_and_capped", "lookup_stays_within_hashes", "hit_is_valid_in_every_group"):
        assert (ours[inv]["verdict"], rows[(inv, "vllm_0_33")]["verdict"]) == ("PROVED", "REFUTED")  # F1
    assert ours["scheduler_and_mask_boundaries_agree@dsv4_report_46240_retention0"]["verdict"] == "REFUTED"  # W4


def test_docs_findings_lists_exactly_the_defects_of_the_table(prove):
    """docs/findings.md has one section per defect (``## F1: ...``, ``## W: ...``), no more, no fewer."""
    documented = set(re.findall(r"^## (F\d+|W\d*):", FINDINGS.read_text(), flags=re.M))
    assert documented == {d["id"] for d in prove["defects"]}
