"""The repairs as patches against vLLM 0.33.0 (``docs/upstream/``): applied to a copy of the installed
``vllm/v1/core`` and run in a subprocess (:mod:`.patched`), the patched engine matches the repaired model
(``vllm_0_33_repaired``) on every read-side scenario of the differential suite and on every write-side
scenario of :mod:`.test_write_side_matches_vllm` (and the counterexamples of the divergences once found,
:data:`.patched.FORMER_DIVERGENCES`), and the F1, F2, F5, F6 and W1-W4 reproductions no longer show their
defect, nor Candidate C1 its hit. The same comparisons without the patches fail, so they can.

The number of scenarios is ``KVHIT_PATCHED_SCENARIOS`` (read side, default 2,200, of which vLLM and the spec
both reject some configurations; at least 2,000 are compared) and ``KVHIT_PATCHED_WRITE_SCENARIOS`` (write
side, default 2,200).
"""

import json
import os
import re

import pytest

from kvhit.refimpl import (CacheState, Group, Layout, Speculation, derive_sizes, hit_tokens, repeat_hits,
                           request_writes, written_cache)

from .patched import (FORMER_DIVERGENCES, READ_SIDE_PATCHES, SERIES, UPSTREAM, WRITE_SIDE_PATCH, PatchFailed,
                      patch_core, run_patched)
from .test_findings_reproduce import (DSV4_REPORT, F1_LAYOUTS, F2_LAYOUTS, F5_LAYOUTS, GEMMA, QWEN3NEXT, REFERENCE,
                                      REPAIRED, VLLM, _boundaries, _predict, _retention, _served)

SCENARIOS = int(os.environ.get("KVHIT_PATCHED_SCENARIOS", "2200"))
WRITE_SCENARIOS = int(os.environ.get("KVHIT_PATCHED_WRITE_SCENARIOS", "2200"))
CONTROL_SCENARIOS = 400
WRITE_CONTROL_SCENARIOS = 300


@pytest.fixture(scope="module")
def patched(tmp_path_factory):
    return patch_core(tmp_path_factory.mktemp("patched"))


@pytest.fixture(scope="module")
def stock(tmp_path_factory):
    return patch_core(tmp_path_factory.mktemp("stock"), patches=())


@pytest.fixture(scope="module")
def read_side_only(tmp_path_factory):
    return patch_core(tmp_path_factory.mktemp("read_side"), patches=READ_SIDE_PATCHES)


def _summary(core, count, command="differential"):
    out = run_patched(core, command, str(count))
    assert out.returncode == 0, out.stderr[-4000:]
    line = [x for x in out.stdout.splitlines() if x.startswith("summary=")]
    assert line, out.stdout[-2000:]
    return json.loads(line[-1].removeprefix("summary="))


def _rows(core, script):
    return _scripts_rows(core, script)[script]


def _scripts_rows(core, *scripts):
    """Each script's rows (``case=...`` lines), the scripts run one after another in one subprocess."""
    out = run_patched(core, "repro", *scripts)
    assert out.returncode == 0, out.stderr[-3000:]
    assert re.search(r"patched_modules=[1-9]", out.stdout), out.stdout
    rows, script = {}, None
    for line in out.stdout.splitlines():
        if line.startswith("script="):
            script = line.removeprefix("script=")
            rows[script] = []
        elif "case=" in line:
            rows[script].append(dict(re.findall(r"(\w+)=(\S+)", line)))
    for script in scripts:
        assert rows.get(script), out.stdout
        assert "vllm=0.33.0" in out.stdout.split(f"script={script}")[1].split("script=")[0], out.stdout
    return rows


W_REPROS = ("w1_qwen3next_mtp_drop_first_repeat.py", "w2_gemma_sibling_loses_block.py",
            "w3_gemma_lookahead_first_repeat.py", "w4_dsv4_report_first_repeat.py")


@pytest.fixture(scope="module")
def w_rows(patched):
    return _scripts_rows(patched, *W_REPROS)


def test_the_patches_apply_in_series_order_and_only_to_vllm_v1_core(tmp_path):
    assert READ_SIDE_PATCHES == ("reverify_after_shrink.patch", "cap_at_hashes.patch", "unitary_margin.patch",
                                 "drop_before_align.patch", "probe_past_max.patch")
    assert SERIES == READ_SIDE_PATCHES + (WRITE_SIDE_PATCH,)
    for name in SERIES:
        paths = re.findall(r"^(?:---|\+\+\+) (\S+)", (UPSTREAM / name).read_text(), flags=re.M)
        assert paths and all(re.fullmatch(r"[ab]/vllm/v1/core/(sched/)?\w+\.py", p) for p in paths), (name, paths)
    # A patch that does not apply exactly (here: one already applied) is refused.
    with pytest.raises(PatchFailed):
        patch_core(tmp_path, patches=("cap_at_hashes.patch", "cap_at_hashes.patch"))


def test_patched_vllm_matches_vllm_0_33_repaired_on_every_read_side_scenario(patched):
    summary = _summary(patched, SCENARIOS)
    print("patched vLLM 0.33.0 vs vllm_0_33_repaired:", {k: v for k, v in summary.items() if k != "first_mismatches"})
    assert summary["policy"] == "vllm_0_33_repaired" and summary["patched_modules"] > 0
    assert summary["mismatches"] == 0, "\n\n".join(summary["first_mismatches"])
    assert summary["scenarios"] >= 2000 and summary["positive_hits"] > 0


def test_unpatched_vllm_does_not_match_vllm_0_33_repaired(stock):
    """The control: the same comparison on an unpatched copy finds the defects the patches remove."""
    summary = _summary(stock, CONTROL_SCENARIOS)
    assert summary["mismatches"] > 0, summary


def test_c1_is_gone_on_patched_vllm_the_drop_is_verified_again_below_a_shrink(patched, stock):
    """Candidate C1 (docs/findings.md): swa32_mamba64, drop, N = 352, the sliding window holding blocks 0, 4-5
    and 7-9 and the Mamba group its state at 32. Stock vLLM keeps the sliding window's verification made at
    320 after the Mamba group's drop to 32 and hits 32, without the block past it; patched, the shrink clears
    it, the window is looked up with the drop again at 32, and the hit is the reference's 0."""
    cache = {"0": [{"unit": 32, "blocks": [[0, 1], [4, 6], [7, 10]]}], "1": [{"unit": 32, "blocks": [[0, 1]]}]}
    hits = {}
    for name, core in (("patched", patched), ("stock", stock)):
        out = run_patched(core, "seeded", "swa32_mamba64 drop Lp=1", "352", json.dumps(cache))
        assert out.returncode == 0, out.stderr[-3000:]
        hits[name] = int(re.search(r"hit=(\d+)", out.stdout).group(1))
    assert hits == {"patched": 0, "stock": 32}


def test_f1_is_gone_on_patched_vllm_no_index_error_and_the_repaired_hit(patched):
    mtp2 = Speculation("lookahead", 2, True)
    for row in _rows(patched, "f1_index_error.py"):
        layout, n = F1_LAYOUTS[row["case"]], int(row["N"])
        empty = CacheState.from_sets([set()] * len(derive_sizes(layout, mtp2).groups))
        model = _predict(layout, mtp2, n, empty, REPAIRED)
        assert not model["crash"] and "error" not in row, row
        assert int(row["hit"]) == model["hit"] == _predict(layout, mtp2, n, empty, REFERENCE)["hit"], row


def test_f2_is_gone_on_patched_vllm_the_unitary_drop_keeps_the_block(patched):
    drop, none = Speculation("drop", 1), Speculation("none")
    kept = 0
    for row in _rows(patched, "f2_unitary_drop.py"):
        layout, n = F2_LAYOUTS[row["case"]], int(row["N"])
        groups = len(derive_sizes(layout, none).groups)
        cache = CacheState.up_to([int(row["cached"]) * 16] * groups)
        hit = int(row["hit_drop"])
        assert hit == _predict(layout, drop, n, cache, REPAIRED)["hit"] == _predict(layout, drop, n, cache,
                                                                                   REFERENCE)["hit"], row
        kept += hit > _predict(layout, drop, n, cache, VLLM)["hit"]
    assert kept == 2  # unitary N = 32 and 1024: the block vLLM 0.33.0 drops is kept


def test_f5_is_gone_on_patched_vllm_the_short_window_drop_keeps_the_alignment_unit(patched):
    drop = Speculation("drop", 1)
    kept = 0
    for row in _rows(patched, "f5_swa_drop_align.py"):
        layout, n = F5_LAYOUTS[row["case"]], int(row["N"])
        cache = CacheState.from_sets([_boundaries(row["full"]), _boundaries(row["swa"])])
        hit = int(row["hit"])
        assert hit == _predict(layout, drop, n, cache, REPAIRED)["hit"], row
        kept += hit > _predict(layout, drop, n, cache, VLLM)["hit"]
    assert kept == 4


def test_f6_is_gone_on_patched_vllm_the_block_past_the_last_token_is_read(patched):
    none = Speculation("none")
    kept = 0
    for row in _rows(patched, "f6_full_probe_past_max.py"):
        layout = Layout((Group("full", 1600), Group("mamba", 1600)), dcp=int(row["case"].removeprefix("dcp")),
                        name="qwen3next")
        n = int(row["N"])
        cache = CacheState.from_sets([_boundaries(row["full"]), _boundaries(row["mamba"])])
        hit = int(row["hit"])
        assert hit == _predict(layout, none, n, cache, REPAIRED)["hit"], row
        kept += hit > _predict(layout, none, n, cache, VLLM)["hit"]
    assert kept == 4


def test_the_repaired_unitary_margin_never_takes_a_mamba_group_past_the_last_token():
    """A Mamba-only layout in drop mode, served once with dense retention (states at 16 and 32) and resent:
    stock and patched vLLM hit 16. The repaired model once gave the Mamba group the Unitary margin and read
    the state at 32 = N (found by the 20,000-scenario patched run); a Mamba group never drops, so it takes
    no margin, as in vLLM's Hybrid loop."""
    sizes = derive_sizes(Layout((Group("mamba", 16),)), Speculation("drop", 1))
    n = 32
    cache = CacheState.from_sets([{16, 32}])
    hit = hit_tokens(cache, sizes, n, REPAIRED)[0]
    assert hit <= n - 1 and hit == hit_tokens(cache, sizes, n, VLLM)[0]


# ----------------------------------------------------------------------------------------------------
# The write side (replay_at_resume.patch)
# ----------------------------------------------------------------------------------------------------


def test_the_write_side_patch_states_no_kvhit_import():
    text = (UPSTREAM / WRITE_SIDE_PATCH).read_text()
    assert "kvhit" not in text and "refimpl" not in text


def test_patched_vllm_matches_vllm_0_33_repaired_on_every_write_side_scenario(patched):
    summary = _summary(patched, WRITE_SCENARIOS, "write-differential")
    print("patched vLLM 0.33.0 vs vllm_0_33_repaired, write side:",
          {k: v for k, v in summary.items() if k not in ("first_mismatches", "by_layout")})
    assert summary["policy"] == "vllm_0_33_repaired" and summary["patched_modules"] > 0
    assert summary["mismatches"] == 0, "\n\n".join(summary["first_mismatches"])
    assert summary["scenarios"] >= 2000 and summary["positive"] > 0
    assert summary["former_divergences"] == {name: "compared" for name in FORMER_DIVERGENCES}, \
        summary["former_divergences"]


def test_vllm_with_the_read_side_patches_only_does_not_match_the_repaired_write_side(read_side_only):
    """The control: vLLM's own write side (replay_boundaries, its Mamba checkpoint and chunk stops) keeps state
    where vllm_0_33_repaired does not, and loses what it keeps."""
    summary = _summary(read_side_only, WRITE_CONTROL_SCENARIOS, "write-differential")
    assert summary["mismatches"] > 0, summary


def _hits(row):
    return [int(row["first"]), *map(int, row["resends"].split(","))]


def test_w1_is_gone_on_patched_vllm_the_first_resend_after_mtp_drop_hits(w_rows):
    seen = {}
    for row in w_rows["w1_qwen3next_mtp_drop_first_repeat.py"]:
        mode, retention, n = row["case"].split("_")[0], _retention(row["case"]), int(row["N"])
        speculation = Speculation("drop", 2, True) if mode == "drop" else Speculation("none")
        hits = _hits(row)
        assert hits == _served(QWEN3NEXT, speculation, n, retention, REPAIRED) and hits[1] == hits[2], row
        seen[row["case"]] = hits
    # vLLM 0.33.0: [0, 0, 4800, 4800] in drop mode (the first resend recomputes the whole prompt).
    assert seen["drop_retention_0"] == seen["drop_retention_None"] == [0, 4800, 4800, 4800]
    assert seen["drop_retention_0"] == _served(QWEN3NEXT, Speculation("drop", 2, True), 8000, 0, REFERENCE)


def test_w2_is_gone_on_patched_vllm_the_sibling_keeps_the_block(w_rows):
    none = Speculation("none")
    sizes = derive_sizes(GEMMA, none)
    sibling = {}
    for row in w_rows["w2_gemma_sibling_loses_block.py"]:
        retention, n, longer = _retention(row["case"]), int(row["N"]), int(row["sibling"])
        cache = written_cache(request_writes(sizes, n, retention, REPAIRED))
        assert int(row["sibling_hit"]) == hit_tokens(cache, sizes, longer, REPAIRED)[0], row
        assert int(row["resend_hit"]) == repeat_hits(sizes, n, retention, REPAIRED, 1)[0], row
        sibling[retention] = int(row["sibling_hit"])
    # vLLM 0.33.0: 640 with R = 0 (the sliding-window block ending at N is not kept).
    assert sibling == {0: 704, None: 704}


def test_w3_is_gone_on_patched_vllm_the_first_resend_under_lookahead_hashes_hits(w_rows):
    mtp2 = Speculation("lookahead", 2, True)
    for row in w_rows["w3_gemma_lookahead_first_repeat.py"]:
        retention, n = _retention(row["case"]), int(row["N"])
        hits = _hits(row)
        assert hits == _served(GEMMA, mtp2, n, retention, REPAIRED) and hits[1] == hits[2], row
        # vLLM 0.33.0 with R = 0: [0, 0, 512, 512].
        assert hits == [0, 512, 512, 512], row


def test_w4_is_gone_on_patched_vllm_the_deepseek_v4_report_hits_in_full_on_the_first_resend(w_rows):
    drop = Speculation("drop", 1)
    for row in w_rows["w4_dsv4_report_first_repeat.py"]:
        retention, n = _retention(row["case"]), int(row["N"])
        hits = _hits(row)
        assert hits == _served(DSV4_REPORT, drop, n, retention, REPAIRED) and hits[1] == hits[2], row
        # vLLM 0.33.0 with R = 0: [0, 16384, 32768, 32768].
        assert hits == [0, 32768, 32768, 32768], row
