"""Run vLLM 0.33.0's own tests once per kvhit mode and compare the outcomes (``make vllm-tests``).

Usage::

    python -m tests.vllm_suite.run [--modes stock,off,shadow,enforce] [--selection default|long] [--jobs 2]
                                   [--timeout 1200]

Each mode is a fresh pytest process (kvhit patches process-wide state), run from ``build/vllm-0.33.0-tests``
(where ``tests`` is vLLM's test package) with ``VLLM_TARGET_DEVICE=cpu``, the hub offline and pointed at the
``config.json`` files of :mod:`.hub`, no auto-loaded pytest plugins, no vLLM root conftest
(``--confcutdir=tests/v1``; it is not even unpacked) and our ``vllm_suite_plugin``. ``--jobs`` modes run
at once (2 on a 2-core machine); a mode still running after ``--timeout`` seconds is killed (and fails).
Logs and results go to ``out/vllm-tests/SELECTION/MODE.{log,jsonl}``.

Prints each mode's counts and wall time, the tests whose outcome differs between modes, every failed
check, and a closing line ``vllm-tests: N passed, M failed`` (N and M count checks, :mod:`.compare`).
Exits 1 if any check failed.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from . import compare, expected, fetch, hub, selection

MODES = ("stock", "off", "shadow", "enforce")
REPO = fetch.REPO
PLUGIN_DIR = Path(__file__).resolve().parent / "plugin"
HF_HOME = REPO / "build" / "vllm-suite-hf"
VLLM_CACHE = REPO / "build" / "vllm-suite-cache"
OUT = REPO / "out" / "vllm-tests"

# Variables a caller's environment might set that would change what a mode means.
_CLEARED = ("KVHIT_MODE", "KVHIT_STATUS_FILE", "VLLM_PLUGINS", "PYTEST_ADDOPTS", "PYTEST_PLUGINS", "PYTHONPATH",
            "VLLM_USE_V2_MODEL_RUNNER")


def mode_environment(mode: str) -> dict[str, str]:
    """The environment of ``mode``'s pytest: stock allows no vLLM plugin; the others allow kvhit in that mode."""
    env = {name: value for name, value in os.environ.items() if name not in _CLEARED}
    env.update({
        "VLLM_TARGET_DEVICE": "cpu",
        "VLLM_CACHE_ROOT": str(VLLM_CACHE),
        "HF_HOME": str(HF_HOME),
        "HF_HUB_CACHE": str(HF_HOME / "hub"),
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1",
        "PYTHONPATH": str(PLUGIN_DIR),
        "VLLM_PLUGINS": "" if mode == "stock" else "kvhit",
    })
    if mode != "stock":
        env["KVHIT_MODE"] = mode
    return env


def pytest_command(mode: str, paths: tuple[str, ...], results: Path, exclude: Path) -> list[str]:
    return [sys.executable, "-m", "pytest", "-p", "vllm_suite_plugin", "-p", "no:cacheprovider",
            "-c", "pytest.ini", "--rootdir", ".", "--confcutdir", "tests/v1", "-q", "-rfE",
            f"--kvhit-mode={mode}", f"--kvhit-results={results}", f"--kvhit-exclude={exclude}", *paths]


def run_mode(mode: str, paths: tuple[str, ...], out: Path, exclude: Path, timeout: float) -> compare.ModeRun:
    """Run ``mode``'s pytest to completion, or kill its process group after ``timeout`` seconds (the run then
    has no ``session-finish`` and fails ``setup[MODE]``); its log is ``out/MODE.log``."""
    results, log = out / f"{mode}.jsonl", out / f"{mode}.log"
    results.unlink(missing_ok=True)
    start = time.monotonic()
    with open(log, "w", encoding="utf-8") as log_file:
        process = subprocess.Popen(pytest_command(mode, paths, results, exclude), cwd=fetch.UNPACKED,
                                   env=mode_environment(mode), stdout=log_file, stderr=subprocess.STDOUT,
                                   stdin=subprocess.DEVNULL, start_new_session=True)
        try:
            returncode = process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
            returncode = f"killed after {timeout:.0f} s"
    run = compare.load(mode, results)
    run.seconds = time.monotonic() - start
    run.returncode = returncode
    print(f"[vllm-tests] {mode}: {_counts_text(run)} in {run.seconds:.0f} s (log {os.path.relpath(log, REPO)})",
          flush=True)
    return run


def _counts_text(run: compare.ModeRun) -> str:
    return ", ".join(f"{count} {outcome}" for outcome, count in run.counts().items() if count or outcome in
                     ("passed", "failed", "skipped", "error"))


def _short(message: str, width: int = 110) -> str:
    line = message.strip().splitlines()[0] if message.strip() else ""
    return line if len(line) <= width else line[:width - 3] + "..."


def print_report(runs: dict[str, compare.ModeRun], checks: list[compare.Check], selection_name: str) -> None:
    print(f"\nvLLM {fetch.VLLM_VERSION}'s tests ({selection_name} selection), per mode:")
    print(f"  {'mode':<8} {'passed':>7} {'failed':>7} {'skipped':>8} {'error':>6} {'seconds':>8}  kvhit counters")
    for run in runs.values():
        counts = run.counts()
        counters = (run.finish or {}).get("counters") or {}
        counter_text = ", ".join(f"{name.removeprefix('kvhit_')} {value:g}"
                                 for name, value in sorted(counters.items())) or "-"
        print(f"  {run.mode:<8} {counts['passed']:>7} {counts['failed']:>7} {counts['skipped']:>8} "
              f"{counts['error']:>6} {run.seconds or 0:>8.0f}  {counter_text}")
    listed = {entry.test_id: entry for entry in expected.EXPECTED}
    rows = compare.differences(runs)
    print(f"\nTests whose outcome differs between modes ({len(rows)}):")
    for test_id, outcomes in rows:
        cells = "  ".join(f"{mode} {o.outcome if o else '(not run)'}" for mode, o in outcomes.items())
        entry = listed.get(test_id)
        finding = entry.finding.name if entry and entry.finding else "-"
        note = (f"expected: {finding}, {entry.kind.value}; stock {entry.stock}, enforce {entry.enforce}"
                if entry else "NOT EXPECTED")
        print(f"  {test_id}\n      {cells}\n      {note}")
        for mode, o in outcomes.items():
            if o is not None and o.outcome in ("failed", "error") and mode != "stock":
                print(f"      {mode}: {_short(o.message)}")
    failed = [check for check in checks if not check.held]
    if failed:
        print(f"\nFailed checks ({len(failed)}):")
        for check in failed:
            print(f"  {check.name}: {check.detail}")
    print(f"\nvllm-tests: {len(checks) - len(failed)} passed, {len(failed)} failed")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.vllm_suite.run", description=__doc__.split("\n")[0])
    parser.add_argument("--modes", default=",".join(MODES), help="comma-separated, stock among them")
    parser.add_argument("--selection", choices=sorted(selection.SELECTIONS), default="default")
    parser.add_argument("--jobs", type=int, default=2, help="modes run at once")
    parser.add_argument("--timeout", type=float, default=1200, help="seconds one mode may take")
    args = parser.parse_args(argv)
    modes = tuple(mode.strip() for mode in args.modes.split(",") if mode.strip())
    unknown = [mode for mode in modes if mode not in MODES]
    if unknown or "stock" not in modes:
        parser.error(f"--modes must name stock and only {', '.join(MODES)}; got {args.modes!r}")
    paths = selection.SELECTIONS[args.selection]

    fetch.unpack()
    hub.write_hub(HF_HOME / "hub")
    out = OUT / args.selection
    out.mkdir(parents=True, exist_ok=True)
    exclude = out / "excluded.json"
    exclude.write_text(json.dumps(selection.excluded_reasons(), indent=1) + "\n")

    started = time.monotonic()
    with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        futures = {mode: pool.submit(run_mode, mode, paths, out, exclude, args.timeout) for mode in modes}
        runs = {mode: futures[mode].result() for mode in modes}
    print(f"[vllm-tests] {len(modes)} modes in {time.monotonic() - started:.0f} s ({args.jobs} at a time)")
    checks = compare.compare(runs, paths)
    print_report(runs, checks, args.selection)
    return 0 if all(check.held for check in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
