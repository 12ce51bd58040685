"""``kvhit diff``: where two policies' hits can differ (kvhit.proofs.diff).

The expected numbers are the findings', not the command's: F2 (README's findings and docs/findings.md, "F2":
full attention, block 16, drop mode, a resend of ``N = 32`` with its 2 blocks cached hits 0 under vLLM
0.33's Unitary coordinator, 16 where the drop is taken past the candidate). The last test replays what the
command prints on vLLM 0.33.0's own classes and on the patched copy of docs/upstream.
"""

import json
from concurrent.futures import ThreadPoolExecutor

import pytest

from kvhit.cli import main as kvhit
from kvhit.proofs.diff import READ, domain, diff
from kvhit.spec.policy import REFERENCE, VLLM_0_33, VLLM_0_33_REPAIRED


def _printed(capsys, *argv) -> list[dict]:
    assert kvhit(["diff", *argv, "--json", "--jobs", "1"]) == 0
    return json.loads(capsys.readouterr().out)


def test_a_policy_is_identical_to_itself_on_every_setting_of_a_layout():
    configs = domain(["full16"])
    rows = diff(REFERENCE, REFERENCE, configs, jobs=1)
    assert len(rows) == len(configs) >= 4 and all(r.identical for r in rows)


def test_the_repairs_change_nothing_on_full_attention_without_the_drop():
    # F2 is the only repair full attention at DCP 1 sees, and it acts on the EAGLE drop alone
    rows = diff(VLLM_0_33, VLLM_0_33_REPAIRED, domain(["full16"], ["none", "lookahead"]), jobs=1)
    assert rows and all(r.identical for r in rows)


def test_f2_is_the_least_difference_of_vllm_0_33_and_its_repair_on_full16_drop(capsys):
    rows = _printed(capsys, "vllm_0_33", "vllm_0_33_repaired", "--layout", "full16", "--mode", "drop")
    row = next(r for r in rows if r["dcp"] == 1)
    assert (row["side"], row["mode"], row["identical"]) == (READ, "drop Lp=1", False)
    assert (row["N"], row["cached_blocks"]) == (32, 2)
    assert row["hits"] == {"vllm_0_33": 0, "vllm_0_33_repaired": 16} and row["reads_past_hashes"] == []


def test_a_policy_without_lookahead_hashes_is_compared_without_the_lookahead_mode(capsys):
    """vLLM 0.32 has no lookahead block hashes: its lookahead configurations are left out, and said so."""
    assert kvhit(["diff", "vllm_0_32", "vllm_0_33", "--layout", "full16", "--json", "--jobs", "1"]) == 0
    out = capsys.readouterr()
    rows = json.loads(out.out)
    assert rows and {r["mode"].split()[0] for r in rows} == {"none", "drop"}
    assert "8 lookahead configurations left out: vllm_0_32 has no lookahead block hashes" in out.err


def test_another_mode_for_one_policy_is_refused(capsys):
    with pytest.raises(SystemExit):
        kvhit(["diff", "vllm_0_33", "vllm_0_33", "--b-mode", "lookahead"])
    assert "--b-mode needs two different policies" in capsys.readouterr().err


def test_an_unknown_policy_is_refused_with_the_known_ones(capsys):
    with pytest.raises(SystemExit):
        kvhit(["diff", "vllm_0_33", "vllm_0_31"])
    err = capsys.readouterr().err
    assert "unknown policy vllm_0_31" in err and "vllm_0_33_repaired" in err and "reference" in err


def test_a_reported_difference_is_what_both_engines_hit(capsys, tmp_path):
    """The read-side rows ``kvhit diff vllm_0_33 vllm_0_33_repaired`` prints for full16 in drop mode (F2, at
    every DCP size) and chunked64 with lookahead (F1: vLLM 0.33 reads past the hashes), replayed on stock vLLM
    0.33.0 and on vLLM 0.33.0 with docs/upstream's patches: each engine hits what the row says its policy
    does, and raises IndexError where the row says its lookups read past the hashes."""
    from tests.conformance.patched import patch_core
    from tests.conformance.replay_cache import replay_rows

    rows = [r for r in _printed(capsys, "vllm_0_33", "vllm_0_33_repaired", "--layout", "full16", "--mode", "drop")
            + _printed(capsys, "vllm_0_33", "vllm_0_33_repaired", "--layout", "chunked64", "--mode", "lookahead")
            if not r["identical"]]
    # chunked64's write side differs too, at the first repeat: N = 65, L = 2, the hashes cover 48; vLLM's
    # lookup counts the 64 tokens before its bound's chunk as computed (F1, a hit past the hashes), the
    # repaired one is capped at 48 and finds the first request's blocks up to 48
    repeats = [r for r in rows if r["side"] != "read"]
    assert [(r["layout"], r["side"], r["N"], r["hits"]) for r in repeats] == [
        ("chunked64", "first repeat", 65, {"vllm_0_33": 64, "vllm_0_33_repaired": 48})]
    rows = [r for r in rows if r["side"] == "read"]
    assert [r["layout"] for r in rows] == ["full16"] * 4 + ["chunked64"]
    assert rows[-1]["reads_past_hashes"] == ["vllm_0_33"]
    cores = (patch_core(tmp_path / "stock", patches=()), patch_core(tmp_path / "patched"))
    with ThreadPoolExecutor(2) as pool:  # the two engines start up (most of the test's time) side by side
        stock, patched = pool.map(lambda core: replay_rows(core, rows), cores)
    for got, policy in ((stock, "vllm_0_33"), (patched, "vllm_0_33_repaired")):
        assert got == ["IndexError" if policy in r["reads_past_hashes"] else r["hits"][policy] for r in rows], policy


def test_an_undecided_check_is_an_error_not_identical(monkeypatch):
    from kvhit.proofs import diff as diff_module
    from kvhit.proofs import model

    monkeypatch.setattr(model, "PORTFOLIO", ((2, 1, False),))  # one resource unit: no check is decided
    config = domain(["gemma"], ["drop"])[0]
    with pytest.raises(diff_module.Undecided, match="UNKNOWN"):
        diff_module.diff_one(VLLM_0_33, REFERENCE, config)
