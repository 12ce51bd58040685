"""The read-side repairs as patches against vLLM 0.33.0 (``docs/upstream/``): applied to a copy of the installed
``vllm/v1/core`` and run in a subprocess (:mod:`.patched`), the patched engine matches the repaired model
(``vllm_0_33_repaired``) on every read-side scenario of the differential suite, and the F1, F2, F5 and F6
reproductions no longer show their defect. The same comparison with the unpatched copy fails, so it can.

The number of scenarios is ``KVHIT_PATCHED_SCENARIOS`` (default 2,200, of which vLLM and the spec both
reject some configurations; at least 2,000 are compared).
"""

import json
import os
import re

import pytest

from kvhit.refimpl import CacheState, Group, Layout, Speculation, derive_sizes, hit_tokens

from .patched import READ_SIDE_PATCHES, UPSTREAM, PatchFailed, patch_core, run_patched
from .test_findings_reproduce import (F1_LAYOUTS, F2_LAYOUTS, F5_LAYOUTS, REFERENCE, REPAIRED, VLLM, _boundaries,
                                      _predict)

SCENARIOS = int(os.environ.get("KVHIT_PATCHED_SCENARIOS", "2200"))
CONTROL_SCENARIOS = 400


@pytest.fixture(scope="module")
def patched(tmp_path_factory):
    return patch_core(tmp_path_factory.mktemp("patched"))


@pytest.fixture(scope="module")
def stock(tmp_path_factory):
    return patch_core(tmp_path_factory.mktemp("stock"), patches=())


def _summary(core, count):
    out = run_patched(core, "differential", str(count))
    assert out.returncode == 0, out.stderr[-4000:]
    line = [x for x in out.stdout.splitlines() if x.startswith("summary=")]
    assert line, out.stdout[-2000:]
    return json.loads(line[-1].removeprefix("summary="))


def _rows(core, script):
    out = run_patched(core, "repro", script)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "vllm=0.33.0" in out.stdout and re.search(r"patched_modules=[1-9]", out.stdout), out.stdout
    rows = [dict(re.findall(r"(\w+)=(\S+)", line)) for line in out.stdout.splitlines()]
    rows = [r for r in rows if "case" in r]
    assert rows, out.stdout
    return rows


def test_the_read_side_patches_apply_in_series_order_and_only_to_vllm_v1_core(tmp_path):
    assert READ_SIDE_PATCHES == ("cap_at_hashes.patch", "unitary_margin.patch", "drop_before_align.patch",
                                 "probe_past_max.patch")
    for name in READ_SIDE_PATCHES:
        paths = re.findall(r"^(?:---|\+\+\+) (\S+)", (UPSTREAM / name).read_text(), flags=re.M)
        assert paths and all(re.fullmatch(r"[ab]/vllm/v1/core/\w+\.py", p) for p in paths), (name, paths)
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
