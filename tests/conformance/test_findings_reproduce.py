"""Each reproduction under docs/repro/ runs against the installed vLLM 0.33.0 (as a separate process, with
no kvhit import) and prints what vLLM does; the numbers must be what the generated refimpl predicts for
``vllm_0_33`` on the same layout, prompt and cache state, and must differ from the ``reference`` policy's
prediction as docs/findings.md says (the predictions are computed here, not copied from the scripts)."""

import re
import subprocess
import sys
from pathlib import Path

from kvhit.refimpl import CacheState, Group, Layout, Speculation, derive_sizes, hit_tokens, policy_rules
from kvhit.refimpl.policy import num_hashes

REPRO = Path(__file__).resolve().parents[2] / "docs" / "repro"
VLLM, REFERENCE = policy_rules("vllm_0_33"), policy_rules("reference")


def _run(script):
    out = subprocess.run([sys.executable, str(REPRO / script)], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "from kvhit" not in (REPRO / script).read_text() and "import kvhit" not in (REPRO / script).read_text()
    rows = []
    for line in out.stdout.splitlines():
        fields = dict(re.findall(r"(\w+)=(\S+)", line))
        if "case" in fields:
            rows.append(fields)
    assert rows, out.stdout
    assert "vllm=0.33.0" in out.stdout
    return rows


def _predict(layout, speculation, n, cache, rules):
    sizes = derive_sizes(layout, speculation)
    hit, reach, _, _ = hit_tokens(cache, sizes, n, rules)
    covered = num_hashes(sizes, n) * sizes.hash_block
    return {"hit": hit, "crash": reach > covered, "hashes": num_hashes(sizes, n)}


F1_LAYOUTS = {
    "swa16w64": Layout((Group("swa", 16, window=64),)),
    "chunked16c64": Layout((Group("chunked", 16, chunk=64),)),
    "swa32w64+mamba64": Layout((Group("swa", 32, window=64), Group("mamba", 64))),
}


def test_f1_repro_raises_index_error_exactly_where_vllm_0_33_reads_past_the_hashes():
    rows = _run("f1_index_error.py")
    mtp2 = Speculation("lookahead", 2, True)
    crashes = 0
    for row in rows:
        layout, n = F1_LAYOUTS[row["case"]], int(row["N"])
        empty = CacheState.from_sets([set()] * len(derive_sizes(layout, mtp2).groups))
        model = _predict(layout, mtp2, n, empty, VLLM)
        reference = _predict(layout, mtp2, n, empty, REFERENCE)
        assert int(row["hashes"]) == model["hashes"]
        assert not reference["crash"]
        if model["crash"]:
            assert row.get("error", "").startswith("IndexError"), row
            crashes += 1
        else:
            assert int(row["hit"]) == model["hit"] == reference["hit"], row
    assert crashes == 3


F2_LAYOUTS = {
    "unitary": Layout((Group("full", 16),)),
    "hybrid": Layout((Group("full", 16), Group("full", 16, dcp_sharded=False, eagle=True))),
}


def test_f2_repro_loses_one_block_on_the_unitary_drop_exactly_as_vllm_0_33_predicts():
    rows = _run("f2_unitary_drop.py")
    drop, none = Speculation("drop", 1), Speculation("none")
    lost = {}
    for row in rows:
        layout, n = F2_LAYOUTS[row["case"]], int(row["N"])
        cached = int(row["cached"])
        assert cached == int(row["hashes"]) == n // 16       # the served prompt's every block is cached
        groups = len(derive_sizes(layout, none).groups)
        cache = CacheState.up_to([cached * 16] * groups)
        assert int(row["hit_drop"]) == _predict(layout, drop, n, cache, VLLM)["hit"], row
        assert int(row["hit_no_speculation"]) == _predict(layout, none, n, cache, VLLM)["hit"], row
        lost[(row["case"], n)] = _predict(layout, drop, n, cache, REFERENCE)["hit"] - int(row["hit_drop"])
    # One block lost by the Unitary coordinator when the block divides N, none by the Hybrid one.
    assert lost == {("unitary", 32): 16, ("unitary", 1024): 16, ("unitary", 1000): 0,
                    ("hybrid", 32): 0, ("hybrid", 1024): 0, ("hybrid", 1000): 0}
