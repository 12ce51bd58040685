"""The main job, as `make prove` runs it: every invariant PROVED for reference, the expected divergences,
non-vacuity, and the DeepSeek-V4 report's numbers."""

import json
import subprocess
import sys


def test_kvhit_prove_passes_and_reproduces_the_deepseek_v4_report():
    out = subprocess.run([sys.executable, "-m", "kvhit.cli", "prove", "--json"], capture_output=True,
                         text=True, timeout=1800)
    assert out.returncode == 0, out.stderr[-4000:]
    rows = {(r["invariant"], r["policy"]): r for r in json.loads(out.stdout)}
    assert all(r["verdict"] == "PROVED" for (inv, pol), r in rows.items() if pol == "reference")
    assert not any(r["verdict"] == "UNKNOWN" for r in rows.values())
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
