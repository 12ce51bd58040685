"""Scheduler runs in child processes, as the real-Scheduler tests start them: each mode (stock, off, shadow,
enforce) in a fresh process, since vLLM loads kvhit's plugin once per process and stock must never import it.

``env`` is the child's environment, ``start`` starts one (``python -m MODULE ARGS...`` from the checkout),
``collect`` waits for several and loads what each wrote; ``scheduler_modes`` runs scenarios of
``tests/adapter/scheduler_run.py`` in several modes at once.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def env(kvhit_mode: str | None = None, **extra: str) -> dict:
    """This process's environment without kvhit's, vLLM's and Prometheus's settings, with vLLM's plugins
    limited to kvhit's, the CPU target and the hub offline; ``KVHIT_MODE`` when given, and ``extra``."""
    out = {k: v for k, v in os.environ.items() if not k.startswith(("KVHIT_", "VLLM_", "PROMETHEUS_"))}
    out.update(VLLM_PLUGINS="kvhit", VLLM_TARGET_DEVICE="cpu", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    if kvhit_mode is not None:
        out["KVHIT_MODE"] = kvhit_mode
    out.update(extra)
    return out


def start(module: str, args: list, environment: dict) -> subprocess.Popen:
    """``python -m module *args`` in the checkout, its output (stdout and stderr) piped."""
    return subprocess.Popen([sys.executable, "-m", module, *map(str, args)], cwd=ROOT, env=environment,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def collect(started: dict, timeout: int = 900) -> dict:
    """``{name: (what the run wrote to its JSON file, its output)}`` for ``started``, ``{name: (path,
    process)}``; a run that exits non-zero fails the test with the tail of its output."""
    results = {}
    for name, (path, process) in started.items():
        log, _ = process.communicate(timeout=timeout)
        if process.returncode != 0:
            pytest.fail(f"run {name!r} exited {process.returncode}:\n{log[-6000:]}")
        with open(path) as f:
            results[name] = (json.load(f), log)
    return results


def scheduler_modes(work, scenarios, modes) -> dict:
    """``{mode: result}`` of ``tests/adapter/scheduler_run.py``'s ``scenarios`` (names), each mode of ``modes``
    (``"stock"``: kvhit never imported; otherwise kvhit's mode, loaded through vLLM's plugin loader, with a
    status file ``work/status-MODE.json``) in a process of its own, all started together; ``work`` (a
    ``pathlib.Path``) gets the model folders (``work/models``) and the results."""
    from tests.adapter import scheduler_run

    scheduler_run.write_models(str(work / "models"))
    started = {}
    args = [arg for name in scenarios for arg in ("--scenario", name)]
    for mode in modes:
        environment, extra = env(), []
        if mode != "stock":
            environment = env(mode, KVHIT_STATUS_FILE=str(work / f"status-{mode}.json"))
            extra = ["--load-plugins"]
        out = work / f"{mode}.json"
        started[mode] = (out, start("tests.adapter.scheduler_run", [out, work / "models", *extra, *args],
                                    environment))
    return {mode: result for mode, (result, _) in collect(started).items()}


def scheduled(result: dict, scenario: str) -> dict:
    """What ``scenario`` of a :func:`scheduler_modes` result scheduled and served (every ``SchedulerOutput``
    and ``EngineCoreOutput``), without kvhit's status file, which only runs that load kvhit have: the part
    that must be byte-identical to stock where kvhit changes nothing."""
    return {k: v for k, v in result["scenarios"][scenario].items() if k != "kvhit_status"}


def served_hits(result: dict, scenario: str) -> list[int]:
    """Every request's hit (``num_cached_tokens``) in ``scenario`` of a :func:`scheduler_modes` result."""
    return [served["num_cached_tokens"] for served in result["scenarios"][scenario]["served"]]
