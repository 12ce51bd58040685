"""Every counterexample `make prove` found is pinned: replayed through the generated refimpl, it still
violates its invariant under its policy, with the same numbers Z3 reported."""

import json
from pathlib import Path

import pytest

from kvhit.proofs.domains import SCENARIOS, configs
from kvhit.proofs.expected import EXPECTED
from kvhit.proofs.model import ReplayContext, cache_from_runs
from kvhit.proofs.runner import BY_NAME, tasks
from kvhit.spec.policy import ALL_POLICIES, KNOWN_BAD

VECTORS = sorted((Path(__file__).resolve().parent.parent / "vectors" / "hit_tokens").glob("*.json"))


def _config(record):
    if "@" in record["invariant_row"]:
        scenario = record["invariant_row"].split("@")[1]
        return next(s.config for s in SCENARIOS if s.name == scenario)
    for config in configs(extended=True):
        retention = config.retention if config.write_side else None
        if (config.layout.name, config.layout.dcp, config.speculation.describe(), config.write_side,
                retention) == (record["layout"], record["dcp"], record["speculation"],
                               "repeat_hits" in record, record.get("retention")):
            return config
    raise LookupError(f"no configuration {record['layout']} dcp{record['dcp']} {record['speculation']}")


def _replay(record, policy):
    runs = {(int(k), item["unit"]): [tuple(span) for span in item["blocks"]]
            for k, items in record["cache"].items() for item in items}
    cache, _ = cache_from_runs(runs)
    values = {"N": record["N"], **record["witnesses"]}
    ctx = ReplayContext(_config(record), ALL_POLICIES[policy], values, cache)
    assumption, claim = BY_NAME[record["invariant"]].claim(ctx)
    return assumption, claim, json.loads(json.dumps(ctx.shown))


def _refuted_rows():
    """The rows of the default `make prove` run expected REFUTED: every entry of ``proofs/expected.py`` and
    every known-bad variant the run checks an invariant against (each must be refuted)."""
    rows = {(inv if scenario is None else f"{inv}@{scenario}", policy) for inv, policy, _, scenario in tasks()}
    expected = {row for row, (verdict, *_) in EXPECTED.items() if verdict == "REFUTED"}
    assert expected <= rows, f"expected.py names rows the run does not check: {sorted(expected - rows)}"
    return expected | {(inv, policy) for inv, policy in rows if policy in KNOWN_BAD}


def test_the_pinned_counterexamples_are_exactly_the_expected_refutations():
    """One vector per REFUTED row (named as `make prove --write-vectors` names it), recording that row."""
    want = _refuted_rows()
    assert {p.stem for p in VECTORS} == {f"{inv.replace('@', '__')}__{policy}" for inv, policy in want}
    recorded = [json.loads(p.read_text()) for p in VECTORS]
    assert sorted((r["invariant_row"], r["policy"]) for r in recorded) == sorted(want)


@pytest.mark.parametrize("path", VECTORS, ids=[p.stem for p in VECTORS])
def test_counterexample_still_refutes_its_invariant(path):
    record = json.loads(path.read_text())
    assumption, claim, shown = _replay(record, record["policy"])
    assert assumption and not claim, f"{path.name} no longer violates {record['invariant']}"
    assert shown == record["replayed"] == record["z3"]
