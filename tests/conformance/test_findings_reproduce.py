"""Each reproduction under docs/repro/ runs against the installed vLLM, 0.33.0 or 0.32.0 (as a separate process,
with no kvhit import) and prints what vLLM does; the numbers must be what the generated refimpl predicts for
that release's policy (``vllm_0_33`` or ``vllm_0_32``, :data:`.vllm_harness.SEAMS`) on the same layout, prompt
and cache state, and must differ from the ``reference`` policy's prediction as docs/findings.md says (the
predictions are computed here, not copied from the scripts).

F1 and W3 need lookahead block hashes, which vLLM 0.32.0 does not have: their tests are defined on 0.33.0 only,
and on 0.32.0 one test checks that both scripts refuse to run, saying why."""

import inspect
import re
import subprocess
import sys
from pathlib import Path

import pytest
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.core.kv_cache_utils import get_request_block_hasher

from kvhit.refimpl import (CacheState, Group, Layout, Speculation, derive_sizes, hit_tokens, policy_rules,
                           repeat_hits, request_writes, written_cache)
from kvhit.refimpl.policy import num_hashes

from .vllm_harness import SEAMS, VLLM_VERSION

REPRO = Path(__file__).resolve().parents[2] / "docs" / "repro"
VLLM, REFERENCE = policy_rules(SEAMS.policy), policy_rules("reference")


def _process(script):
    assert "from kvhit" not in (REPRO / script).read_text() and "import kvhit" not in (REPRO / script).read_text()
    return subprocess.run([sys.executable, str(REPRO / script)], capture_output=True, text=True, timeout=600)


def _run(script):
    out = _process(script)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.splitlines()
    header = [line for line in lines if line.startswith("vllm=")]  # vLLM may log to stdout before it
    assert header and dict(re.findall(r"(\w+)=(\S+)", header[0])).get("vllm") == VLLM_VERSION, out.stdout
    rows = []
    for line in lines:
        fields = dict(re.findall(r"(\w+)=(\S+)", line))
        if "case" in fields:
            rows.append(fields)
    assert rows, out.stdout
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


if SEAMS.hash_lookahead:  # F1 needs lookahead block hashes (vLLM 0.33.0; see the 0.32.0 test below)

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


def test_f2_repro_loses_one_block_on_the_unitary_drop_exactly_as_the_vllm_policy_predicts():
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


# ----------------------------------------------------------------------------------------------------
# W1-W3: the write side (what a request leaves cached), served through the scheduler's own chunk clipping.
# ----------------------------------------------------------------------------------------------------

QWEN3NEXT = Layout((Group("full", 1600), Group("mamba", 1600)), name="qwen3next")
GEMMA = Layout((Group("full", 64), Group("swa", 32, window=512)), name="gemma")


def _retention(case):
    value = case.rsplit("_", 1)[1]
    return None if value == "None" else int(value)


def _served(layout, speculation, n, retention, rules, resends=3):
    """The first request's hit on an empty cache, then the resends' hits, as the write side predicts."""
    sizes = derive_sizes(layout, speculation)
    return [0, *repeat_hits(sizes, n, retention, rules, resends)]


def test_w1_repro_first_resend_misses_under_mtp_drop_exactly_as_the_vllm_policy_predicts():
    rows = _run("w1_qwen3next_mtp_drop_first_repeat.py")
    seen = {}
    for row in rows:
        mode, retention, n = row["case"].split("_")[0], _retention(row["case"]), int(row["N"])
        speculation = Speculation("drop", 2, True) if mode == "drop" else Speculation("none")
        vllm_hits = [int(row["first"]), *map(int, row["resends"].split(","))]
        assert vllm_hits == _served(QWEN3NEXT, speculation, n, retention, VLLM), row
        seen[row["case"]] = (vllm_hits, _served(QWEN3NEXT, speculation, n, retention, REFERENCE))
    # With MTP 2 in drop mode the first resend recomputes the whole prompt; the reference hits 4800 from
    # the first resend on (dense and sparse alike); without speculation vLLM hits at once.
    assert seen["drop_retention_0"] == ([0, 0, 4800, 4800], [0, 4800, 4800, 4800])
    assert seen["drop_retention_None"][0] == [0, 0, 4800, 4800]
    assert seen["none_retention_0"][0][1] > 0


def test_w2_repro_sibling_loses_a_block_under_sparse_retention_exactly_as_the_vllm_policy_predicts():
    rows = _run("w2_gemma_sibling_loses_block.py")
    none = Speculation("none")
    sizes = derive_sizes(GEMMA, none)
    swa = [k for k, sg in enumerate(sizes.groups) if sg.kind.value == "swa"][0]
    sibling = {}
    for row in rows:
        retention, n, longer = _retention(row["case"]), int(row["N"]), int(row["sibling"])
        predicted = {}
        for name, rules in (("vllm", VLLM), ("reference", REFERENCE)):
            cache = written_cache(request_writes(sizes, n, retention, rules))
            predicted[name] = (hit_tokens(cache, sizes, longer, rules)[0],
                               repeat_hits(sizes, n, retention, rules, 1)[0], int(cache.has(swa, n)))
        vllm = (int(row["sibling_hit"]), int(row["resend_hit"]), int(row["swa_block_ending_at_N_cached"]))
        assert vllm == predicted["vllm"], row
        sibling[retention] = (vllm[0], predicted["reference"][0])
    # R = 0: the sibling of 800 tokens hits 640 where the reference (and vLLM with dense retention) hits 704.
    assert sibling == {0: (640, 704), None: (704, 704)}


if SEAMS.hash_lookahead:  # W3 needs lookahead block hashes (vLLM 0.33.0; see the 0.32.0 test below)

    def test_w3_repro_first_resend_misses_under_lookahead_hashes_exactly_as_vllm_0_33_predicts():
        rows = _run("w3_gemma_lookahead_first_repeat.py")
        mtp2 = Speculation("lookahead", 2, True)
        seen = {}
        for row in rows:
            retention, n = _retention(row["case"]), int(row["N"])
            vllm_hits = [int(row["first"]), *map(int, row["resends"].split(","))]
            assert vllm_hits == _served(GEMMA, mtp2, n, retention, VLLM), row
            seen[retention] = (vllm_hits, _served(GEMMA, mtp2, n, retention, REFERENCE))
        assert seen[0] == ([0, 0, 512, 512], [0, 512, 512, 512])
        assert seen[None][0] == [0, 512, 512, 512]


DSV4_REPORT = Layout((Group("full", 16384, tokens_per_state=128), Group("full", 512, tokens_per_state=4),
                      Group("full", 512, tokens_per_state=4), Group("swa", 128, window=128, eagle=True),
                      Group("swa", 8, window=128), Group("swa", 4, window=8)), name="dsv4_report")


def test_w4_repro_the_deepseek_v4_report_returns_on_the_first_resend_exactly_as_the_vllm_policy_predicts():
    rows = _run("w4_dsv4_report_first_repeat.py")
    drop = Speculation("drop", 1)
    seen = {}
    for row in rows:
        retention, n = _retention(row["case"]), int(row["N"])
        vllm_hits = [int(row["first"]), *map(int, row["resends"].split(","))]
        assert vllm_hits == _served(DSV4_REPORT, drop, n, retention, VLLM), row
        seen[retention] = (vllm_hits, _served(DSV4_REPORT, drop, n, retention, REFERENCE))
    assert seen[0] == ([0, 16384, 32768, 32768], [0, 32768, 32768, 32768])
    assert seen[None][0] == [0, 32768, 32768, 32768]


# ----------------------------------------------------------------------------------------------------
# F5, F6: read-side defects the repaired policy (``vllm_0_33_repaired``) removes.
# ----------------------------------------------------------------------------------------------------

REPAIRED = policy_rules("vllm_0_33_repaired")


def _boundaries(field):
    return set() if field == "-" else {int(x) for x in field.split(",")}


F5_LAYOUTS = {
    "gemma": GEMMA,
    "full32+swa16w64": Layout((Group("full", 32), Group("swa", 16, window=64))),
}


def test_f5_repro_loses_an_alignment_unit_on_the_short_window_drop_exactly_as_the_vllm_policy_predicts():
    rows = _run("f5_swa_drop_align.py")
    drop = Speculation("drop", 1)
    lost = {}
    for row in rows:
        layout, n = F5_LAYOUTS[row["case"]], int(row["N"])
        sizes = derive_sizes(layout, drop)
        assert [sg.kind.value for sg in sizes.groups] == ["full", "swa"]
        cache = CacheState.from_sets([_boundaries(row["full"]), _boundaries(row["swa"])])
        hit = int(row["hit"])
        assert hit == _predict(layout, drop, n, cache, VLLM)["hit"], row
        # The cache the engine left is the one the model's write side says a served prompt leaves.
        assert hit == repeat_hits(sizes, n, 0, VLLM, 1)[0], row
        repaired, reference = (_predict(layout, drop, n, cache, rules)["hit"] for rules in (REPAIRED, REFERENCE))
        assert repaired == reference, row
        lost[(row["case"], n)] = (repaired - hit, sizes.alignment)
    # Below a full window the resend loses one alignment unit; with a full window cached (gemma 576,
    # full32+swa16w64 96) the drop takes the found-window path and nothing is lost.
    for case, (tokens, unit) in lost.items():
        assert tokens == (0 if case in {("gemma", 576), ("full32+swa16w64", 96)} else unit), (case, tokens)


def test_f6_repro_misses_the_full_block_past_the_last_token_exactly_as_the_vllm_policy_predicts():
    rows = _run("f6_full_probe_past_max.py")
    none = Speculation("none")
    lost = {}
    for row in rows:
        dcp, n = int(row["case"].removeprefix("dcp")), int(row["N"])
        layout = Layout((Group("full", 1600), Group("mamba", 1600)), dcp=dcp, name="qwen3next")
        sizes = derive_sizes(layout, none)
        assert sizes.partial_hits and sizes.groups[0].block == 1600 * dcp
        assert int(row["hashes"]) == num_hashes(sizes, n)
        cache = CacheState.from_sets([_boundaries(row["full"]), _boundaries(row["mamba"])])
        hit = int(row["hit"])
        assert hit == _predict(layout, none, n, cache, VLLM)["hit"], row
        repaired, reference = (_predict(layout, none, n, cache, rules)["hit"] for rules in (REPAIRED, REFERENCE))
        assert repaired == reference, row
        lost[(row["case"], int(row["first"]), n)] = repaired - hit
    # A prompt ending at the end of a cached full block past N - 1 loses the block; a plain resend (its
    # last boundary inside the block is cached) loses nothing.
    assert {case for case, tokens in lost.items() if tokens > 0} == {
        ("dcp2", 4800, 3200), ("dcp2", 8000, 6400), ("dcp4", 6400, 4800), ("dcp4", 8000, 6400)}
    assert lost[("dcp2", 4800, 4800)] == 0
    assert all(tokens % 1600 == 0 for tokens in lost.values())


if not SEAMS.hash_lookahead:

    def test_f1_and_w3_repros_refuse_on_a_vllm_without_lookahead_hashes():
        """vLLM 0.32.0's KVCacheManager and get_request_block_hasher take no num_hash_lookahead_tokens, so F1 and
        W3 cannot occur on it: the model refuses their settings and the scripts exit saying why (no TypeError)."""
        for fn in (KVCacheManager, get_request_block_hasher):
            assert "num_hash_lookahead_tokens" not in inspect.signature(fn).parameters, fn
        mtp2 = Speculation("lookahead", 2, True)
        f1_layout = F1_LAYOUTS["swa16w64"]
        empty = CacheState.from_sets([set()] * len(derive_sizes(f1_layout, mtp2).groups))
        with pytest.raises(ValueError, match="no lookahead block hashes"):
            _predict(f1_layout, mtp2, 33, empty, VLLM)
        with pytest.raises(ValueError, match="no lookahead block hashes"):
            _served(GEMMA, mtp2, 577, 0, VLLM)
        for finding, script in (("F1", "f1_index_error.py"), ("W3", "w3_gemma_lookahead_first_repeat.py")):
            out = _process(script)
            assert out.returncode == 1 and "case=" not in out.stdout, (script, out.stdout, out.stderr[-3000:])
            assert f"{finding} needs lookahead block hashes, which vLLM {VLLM_VERSION} does not have" in out.stderr
            assert "Traceback" not in out.stderr, out.stderr[-3000:]
