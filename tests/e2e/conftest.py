"""End-to-end fixtures: tiny models built once, one server run per (speculative mode, KVHIT_MODE) for the
EAGLE Llama (`serve`) and, on vLLM 0.32.0, per (Granite setting, KVHIT_MODE) for the hybrid (`serve_granite`,
granite.py).
The EAGLE shadow and enforce servers run with PROMETHEUS_MULTIPROC_DIR so that /metrics shows kvhit's counters,
enforce with KVHIT_COUNT_GAINS=1; `kvhit status` reads each server before it stops.

Runs only in the end-to-end venv (`make e2e`, which passes --confcutdir so the parent conftest, and its
hypothesis import, are not loaded). Server logs and kvhit's status files go to KVHIT_E2E_OUT (default
out/e2e/ in the repository); they are removed when every test passed and kept otherwise. OUT/results.json
keeps what every server reported (cached_tokens, generated text, kvhit's status).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import make_models  # noqa: E402
import server  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
OUT = os.environ.get("KVHIT_E2E_OUT", os.path.join(ROOT, "out", "e2e"))
HEALTH_TIMEOUT_S = float(os.environ.get("KVHIT_E2E_HEALTH_TIMEOUT", "600"))

_runs: dict[tuple[str, str], server.Run] = {}

# The Granite hybrid serves on vLLM 0.32.0's CPU build only (issue 19; test_granite_serve.py says why).
collect_ignore = [] if server.VLLM_VERSION == "0.32.0" else ["test_granite_serve.py"]


@pytest.fixture(scope="session")
def models() -> str:
    path = os.path.join(OUT, "models")
    make_models.make_target(os.path.join(path, "target"))
    make_models.make_draft(os.path.join(path, "draft"))
    return path


@pytest.fixture(scope="session")
def serve(models):
    """``serve(spec_mode, kvhit_mode)``: the (cached) run of one server."""

    def start(spec_mode: str, kvhit_mode: str) -> server.Run:
        extra_env = {}
        if kvhit_mode == "enforce":
            extra_env["KVHIT_COUNT_GAINS"] = "1"   # enforce counts what it gains only when asked
        if kvhit_mode != "off":
            # kvhit's counters live in the engine-core process; vLLM's /metrics serves them only in
            # prometheus_client's multiprocess mode, with a fresh directory.
            extra_env["PROMETHEUS_MULTIPROC_DIR"] = tempfile.mkdtemp(prefix="prometheus-", dir=OUT)
        return server.serve_and_query(models, spec_mode, kvhit_mode, server.LENGTHS, OUT, HEALTH_TIMEOUT_S,
                                      extra_env)

    return lambda spec_mode, kvhit_mode: _cached("vllm serve", spec_mode, kvhit_mode, start)


@pytest.fixture(scope="session")
def serve_granite():
    """``serve_granite(setting, kvhit_mode)``: the (cached) run of one Granite server
    (``granite.SETTINGS``)."""
    import granite

    path = os.path.join(OUT, "models", "granite")
    if not os.path.exists(os.path.join(path, "config.json")):
        make_models.make_granite(path)

    def start(setting: str, kvhit_mode: str) -> server.Run:
        return granite.serve(path, setting, kvhit_mode, OUT, HEALTH_TIMEOUT_S)

    return lambda setting, kvhit_mode: _cached("granite server", setting, kvhit_mode, start)


def _cached(what: str, setting: str, kvhit_mode: str, start) -> server.Run:
    """The run of one server, started once per session by ``start(setting, kvhit_mode)``; a test that needs a
    server which failed fails with its error and log."""
    key = (setting, kvhit_mode)
    if key not in _runs:
        print(f"\n[e2e] {what}: {setting}, KVHIT_MODE={kvhit_mode}", flush=True)
        _runs[key] = start(setting, kvhit_mode)
        print(f"[e2e] healthy after {_runs[key].start_s:.1f} s; error: {_runs[key].error}", flush=True)
    result = _runs[key]
    if result.error is not None:
        pytest.fail(f"{what} ({setting}, KVHIT_MODE={kvhit_mode}) failed: {result.error}; "
                    f"server log: {result.log_path}")
    return result


def pytest_configure(config):
    os.makedirs(OUT, exist_ok=True)


def pytest_sessionfinish(session, exitstatus):
    """Print and save (OUT/results.json) what every server reported; drop logs if every test passed."""
    results = []
    for (spec_mode, kvhit_mode), run in sorted(_runs.items()):
        cached = {n: (run.first[n].cached_tokens, run.repeat[n].cached_tokens) for n in run.repeat}
        print(f"\n[e2e] {spec_mode:<9} KVHIT_MODE={kvhit_mode:<7} healthy after {run.start_s:5.1f} s; "
              f"cached_tokens (first, repeat) per prompt length: {cached}")
        if run.stream:
            print(f"[e2e] cached_tokens of the stream: {[(name, r.cached_tokens) for name, r in run.stream]}")
        if "text" in run.kvhit_status and kvhit_mode != "off":
            print(f"[e2e] kvhit status of that server:\n{run.kvhit_status['text'].stdout}", end="")
        results.append({"spec_mode": spec_mode, "kvhit_mode": kvhit_mode, "start_s": round(run.start_s, 1),
                        "error": run.error, "status": run.status(),
                        "kvhit_status": {form: vars(p) for form, p in run.kvhit_status.items()},
                        "replies": {n: {"first": vars(run.first[n]), "repeat": vars(run.repeat[n])}
                                    for n in run.repeat},
                        "stream": [{"request": name, **vars(r)} for name, r in run.stream]})
    with open(os.path.join(OUT, "results.json"), "w") as f:
        json.dump(results, f, indent=1)
    shutil.rmtree(os.path.join(OUT, "models"), ignore_errors=True)
    if exitstatus == 0:
        for run in _runs.values():
            for path in (run.log_path, run.status_path):
                if os.path.exists(path):
                    os.remove(path)
        for name in os.listdir(OUT):
            if name.startswith("prometheus-"):
                shutil.rmtree(os.path.join(OUT, name), ignore_errors=True)
    else:
        print(f"\n[e2e] server logs and kvhit status files kept in {OUT}")
