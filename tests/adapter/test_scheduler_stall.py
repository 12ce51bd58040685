"""S1 (docs/findings.md): vLLM 0.33.0's real ``Scheduler`` stalls a prefill at 0 scheduled tokens exactly where
the ``vllm_0_33`` model predicts it (``tests.conformance.write_side.stall_predicted``: one of the scheduler's
mandatory Mamba stops lies within the prefill lookahead ``Lp`` of the prompt's end).

Runs the standalone reproduction ``docs/repro/s1_scheduler_stall.py`` (stock vLLM, no kvhit import) in a
process of its own, as a maintainer would, and compares each printed outcome with the model's prediction for
the layout vLLM's planner built (full attention 1600 holding the MTP layers, Mamba 1600).
"""

import os
import re
import subprocess
import sys
from pathlib import Path

from kvhit.refimpl import Group, Layout, Speculation, derive_sizes
from tests.conformance.differential import VLLM_0_33
from tests.conformance.write_side import stall_predicted

ROOT = Path(__file__).resolve().parents[2]
LINE = re.compile(r"^(mtp2-\w+)\s+prefix_match_unit=(\w+)\s+N=(\d+)\s+scheduled per step \[([\d, ]*)\] (\w+)")


def test_the_scheduler_stalls_exactly_where_the_model_predicts():
    env = dict(os.environ, VLLM_TARGET_DEVICE="cpu")
    out = subprocess.run([sys.executable, "docs/repro/s1_scheduler_stall.py"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [LINE.match(line) for line in out.stdout.splitlines() if line.startswith("mtp2-")]
    assert len(rows) == 12 and all(rows), out.stdout
    stalls = 0
    for row in rows:
        mode, pmu, n, outcome = row[1], row[2], int(row[3]), row[5]
        layout = Layout((Group("full", 1600, eagle=True), Group("mamba", 1600)),
                        prefix_match_unit=None if pmu == "None" else int(pmu))
        speculation = Speculation("lookahead" if mode.endswith("lookahead") else "drop", 2, True)
        predicted = stall_predicted(derive_sizes(layout, speculation), n, 0, -1, VLLM_0_33)
        assert (outcome == "STALLED") == predicted, row[0]
        stalls += predicted
    assert 0 < stalls < len(rows)  # both outcomes occur, so the comparison can fail either way
