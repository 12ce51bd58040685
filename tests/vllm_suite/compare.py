"""Compare the outcomes of vLLM's tests across kvhit's modes; every comparison is a named check.

Each mode's pytest writes JSON lines (``vllm_suite_plugin``); :func:`load` reads them into a
:class:`ModeRun`. :func:`compare` then checks, with ``stock`` as the reference:

* ``setup[MODE]``: the mode was set up as asked and still was at the end (the plugin's checks), and the run
  finished (a crashed pytest has no ``session-finish``).
* ``collected[MODE]``: no test module failed to import.
* ``same[MODE] ID`` for ``off`` and ``shadow``, for every test id either run saw: the outcome equals stock's.
* ``enforce ID``: the outcome equals stock's, unless :mod:`.expected` lists the test, in which case it must
  differ, and be the outcome the table gives.
* ``expected-ran ID``: a listed test inside the selection ran in both stock and enforce.
* ``exclusion-used ID``: an exclusion inside the selection kept something out (a stale entry fails).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from . import expected as expected_table
from . import selection as selection_module

OUTCOMES = expected_table.OUTCOMES


@dataclass(frozen=True)
class Outcome:
    outcome: str
    message: str


@dataclass
class ModeRun:
    """One mode's pytest run, as its results file tells it."""

    mode: str
    tests: dict[str, Outcome] = field(default_factory=dict)
    collect_errors: dict[str, str] = field(default_factory=dict)
    start: dict | None = None
    finish: dict | None = None
    excluded: dict[str, int] = field(default_factory=dict)
    """Exclusion entry -> files or tests it kept out."""
    seconds: float | None = None
    """Wall time of the pytest process (set by the runner)."""
    returncode: int | str | None = None
    """pytest's exit code, or why the runner stopped it."""

    def counts(self) -> dict[str, int]:
        counts = {outcome: 0 for outcome in OUTCOMES}
        for result in self.tests.values():
            counts[result.outcome] += 1
        counts["error"] += len(self.collect_errors)
        return counts


def load(mode: str, path: Path) -> ModeRun:
    run = ModeRun(mode)
    if not path.exists():
        return run
    for line in path.read_text(encoding="utf-8").splitlines():
        record = json.loads(line)
        event = record["event"]
        if event == "test":
            run.tests[record["id"]] = Outcome(record["outcome"], record["message"])
        elif event == "collect-error":
            run.collect_errors[record["id"]] = record["message"]
        elif event == "excluded":
            run.excluded[record["id"]] = record["matched"]
        elif event == "session-start":
            run.start = record
        elif event == "session-finish":
            run.finish = record
    return run


@dataclass(frozen=True)
class Check:
    name: str
    held: bool
    detail: str = ""


def _setup_check(run: ModeRun) -> Check:
    if run.start is None:
        return Check(f"setup[{run.mode}]", False, f"no session started (pytest: {run.returncode})")
    problems = run.start["problems"] + (run.finish["problems"] if run.finish else [])
    if run.finish is None:
        problems.append(f"the session did not finish (pytest: {run.returncode})")
    return Check(f"setup[{run.mode}]", not problems, "; ".join(problems))


def _first_line(message: str) -> str:
    return message.strip().splitlines()[0] if message.strip() else ""


def compare(runs: dict[str, ModeRun], paths: tuple[str, ...]) -> list[Check]:
    """Every check for the modes in ``runs`` (``stock`` among them) on the selection ``paths``."""
    stock = runs["stock"]
    checks = []
    for run in runs.values():
        checks.append(_setup_check(run))
        checks.append(Check(f"collected[{run.mode}]", not run.collect_errors,
                            "; ".join(f"{name}: {_first_line(msg)}" for name, msg in run.collect_errors.items())))
    listed = {entry.test_id: entry for entry in expected_table.EXPECTED}
    for mode in ("off", "shadow", "enforce"):
        if mode not in runs:
            continue
        other = runs[mode]
        for test_id in sorted(stock.tests.keys() | other.tests.keys()):
            ours, theirs = stock.tests.get(test_id), other.tests.get(test_id)
            got = "(not run)" if theirs is None else theirs.outcome
            want = "(not run)" if ours is None else ours.outcome
            entry = listed.get(test_id) if mode == "enforce" else None
            if entry is None:
                message = _first_line(theirs.message) if theirs else ""
                detail = "" if got == want else f"stock {want}, {mode} {got}: {message}"
                checks.append(Check(f"same[{mode}] {test_id}", got == want, detail))
            else:
                held = got != want and got == entry.enforce_outcome and want == entry.stock_outcome
                detail = "" if held else (f"listed in expected.py (stock {entry.stock_outcome}, enforce "
                                          f"{entry.enforce_outcome}); got stock {want}, enforce {got}")
                checks.append(Check(f"expected[enforce] {test_id}", held, detail))
    if "enforce" in runs:
        for test_id, entry in listed.items():
            if selection_module.in_selection(test_id, paths):
                ran = test_id in stock.tests and test_id in runs["enforce"].tests
                checks.append(Check(f"expected-ran {test_id}", ran, "" if ran else "not run in stock or enforce"))
    for entry in selection_module.EXCLUDED:
        if selection_module.in_selection(entry, paths):
            used = all(run.excluded.get(entry, 0) > 0 for run in runs.values())
            checks.append(Check(f"exclusion-used {entry}", used, "" if used else "matched nothing: stale entry"))
    return checks


def differences(runs: dict[str, ModeRun]) -> list[tuple[str, dict[str, Outcome | None]]]:
    """Every test whose outcome is not the same in all modes: (id, mode -> outcome or None if not run)."""
    ids = set().union(*(run.tests.keys() for run in runs.values()))
    rows = []
    for test_id in sorted(ids):
        outcomes = {mode: run.tests.get(test_id) for mode, run in runs.items()}
        if len({o.outcome if o else None for o in outcomes.values()}) > 1:
            rows.append((test_id, outcomes))
    return rows
