"""pytest plugin for vLLM 0.33.0's own tests run under kvhit: the mode, vLLM's fixtures, every outcome.

``tests/vllm_suite/run.py`` loads it with ``-p vllm_suite_plugin`` (this folder on ``PYTHONPATH``) in a pytest
that runs from ``build/vllm-0.33.0-tests`` without vLLM's root ``tests/conftest.py``. It imports nothing of
kvhit's ``tests`` package: vLLM's tests import their own package of that name (``tests.v1.core.utils``).

* **Mode** (``--kvhit-mode``), set up at session start, before any test is collected, the way ``EngineCore``
  does it: ``vllm.plugins.load_general_plugins()`` runs the ``vllm.general_plugins`` entry points that
  ``VLLM_PLUGINS`` allows, i.e. kvhit's ``register()``, which reads ``KVHIT_MODE``. The runner sets both:

  ========== ================ ================ ==================================================
  mode       ``VLLM_PLUGINS`` ``KVHIT_MODE``   what must hold (checked at session start and end)
  ========== ================ ================ ==================================================
  stock      empty (none)     unset            no ``kvhit`` module imported; no kvhit object in vLLM
  off        ``kvhit``        ``off``          ``register()`` ran; no kvhit object in vLLM
  shadow     ``kvhit``        ``shadow``       kvhit's mode is shadow; exactly its seams are kvhit's
  enforce    ``kvhit``        ``enforce``      kvhit's mode is enforce; exactly its seams are kvhit's
  ========== ================ ================ ==================================================

  "kvhit object in vLLM" is found by scanning every imported ``vllm.*`` module, and the classes it defines,
  for a function or class whose ``__module__`` is kvhit's. A check that fails stops the session
  (``pytest.exit``) so that no outcome is recorded for a mode that was not set up.
* **Fixtures** vLLM's root conftest gives and the selected files use: ``caplog_vllm`` and
  ``temporary_enable_log_propagate`` (copied), and its handling of ``@pytest.mark.optional`` (skipped).
* **Exclusions** (``--kvhit-exclude``, a JSON object ``{file or test id: reason}`` written by the runner from
  ``tests/vllm_suite/selection.py``): a file is not collected; a test id, with or without its
  ``[parameters]``, is deselected. Exact ids only (pytest's ``--deselect`` matches prefixes).
* **Outcomes** (``--kvhit-results``, JSON lines): one ``{"event": "test", "id", "outcome", "message",
  "seconds"}`` per test, outcome one of ``passed failed skipped error xfailed xpassed``, message
  ``FILE:LINE: `` and the exception's message for ``failed`` and ``error`` (the reason for ``skipped``);
  one ``"collect-error"`` per module that failed to import; one ``"excluded"`` per exclusion that kept
  something out; ``"session-start"`` and ``"session-finish"`` with the mode's checks and, in shadow and
  enforce, kvhit's counters (divergences, fallbacks, unmodelled layouts).
"""

from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path

import pytest

MODES = ("stock", "off", "shadow", "enforce")
MESSAGE_CHARS = 2000


def pytest_addoption(parser):
    group = parser.getgroup("kvhit", "kvhit: vLLM's tests under kvhit's plugin")
    group.addoption("--kvhit-mode", choices=MODES, required=True, help="how kvhit is set up")
    group.addoption("--kvhit-results", required=True, help="JSON-lines file of every outcome")
    group.addoption("--kvhit-exclude", help="JSON file {file or test id: reason} not to run")


# --------------------------------------------------------------------------------------------------
# The mode
# --------------------------------------------------------------------------------------------------

def _kvhit_objects_in_vllm() -> list[str]:
    """Every attribute of an imported ``vllm.*`` module, or of a class one defines, that is kvhit's."""
    found = []

    def is_kvhit(value) -> bool:
        return str(getattr(value, "__module__", None) or "").startswith("kvhit")

    for module_name, module in list(sys.modules.items()):
        if module is None or not (module_name == "vllm" or module_name.startswith("vllm.")):
            continue
        for name, value in list(vars(module).items()):
            if is_kvhit(value):
                found.append(f"{module_name}.{name}")
            elif isinstance(value, type) and value.__module__ == module_name:
                found += [f"{module_name}.{value.__qualname__}.{attr}"
                          for attr, member in list(vars(value).items()) if is_kvhit(member)]
    return sorted(found)


def _kvhit_seams() -> list[str]:
    """The attributes kvhit's adapter says it replaces (``v0_33.SEAMS``), named as the scan names them."""
    from kvhit.adapters.vllm import v0_33

    names = []
    for owner, attribute, _, _ in v0_33.SEAMS:
        if isinstance(owner, type):
            names.append(f"{owner.__module__}.{owner.__qualname__}.{attribute}")
        else:
            names.append(f"{owner.__name__}.{attribute}")
    return sorted(names)


def _kvhit_counters() -> dict[str, float]:
    """kvhit's prometheus counters, summed over labels (empty when kvhit is not imported)."""
    if "kvhit.adapters.vllm.engine" not in sys.modules:
        return {}
    import prometheus_client

    totals: dict[str, float] = {}
    for metric in prometheus_client.REGISTRY.collect():
        for sample in metric.samples:
            if sample.name.startswith("kvhit_") and sample.name.endswith("_total"):
                totals[sample.name] = totals.get(sample.name, 0.0) + sample.value
    return totals


def mode_problems(mode: str) -> tuple[dict, list[str]]:
    """The observed set-up of ``mode`` and what in it is wrong (empty when the mode is as it must be)."""
    environment = {"VLLM_PLUGINS": os.environ.get("VLLM_PLUGINS"), "KVHIT_MODE": os.environ.get("KVHIT_MODE")}
    kvhit_modules = sorted(name for name in sys.modules if name == "kvhit" or name.startswith("kvhit."))
    replaced = _kvhit_objects_in_vllm()
    observed = {"environment": environment, "kvhit_modules": len(kvhit_modules), "replaced": replaced}
    problems = []
    wanted_environment = ({"VLLM_PLUGINS": "", "KVHIT_MODE": None} if mode == "stock"
                          else {"VLLM_PLUGINS": "kvhit", "KVHIT_MODE": mode})
    if environment != wanted_environment:
        problems.append(f"environment {environment}, expected {wanted_environment}")
    if mode == "stock":
        if kvhit_modules:
            problems.append(f"kvhit was imported: {', '.join(kvhit_modules)}")
    else:
        if "kvhit.adapters.vllm" not in sys.modules:
            problems.append("vLLM's plugin loading did not load kvhit's entry point")
            return observed, problems
        import kvhit.adapters.vllm as kvhit_vllm

        observed["kvhit_mode"] = kvhit_vllm.current_mode()
        if kvhit_vllm.current_mode() != mode:
            problems.append(f"kvhit's mode is {kvhit_vllm.current_mode()}, expected {mode}")
    wanted_replaced = _kvhit_seams() if mode in ("shadow", "enforce") else []
    if replaced != wanted_replaced:
        problems.append(f"kvhit objects in vLLM: {replaced}, expected {wanted_replaced}")
    return observed, problems


class _Recorder:
    """Collects each test's reports and writes one JSON line per test when its teardown is reported."""

    def __init__(self, path: Path, mode: str) -> None:
        self.mode = mode
        self.file = open(path, "w", encoding="utf-8")
        self.reports: dict[str, list] = {}

    def write(self, record: dict) -> None:
        self.file.write(json.dumps({"mode": self.mode, **record}) + "\n")
        self.file.flush()

    def session(self, event: str) -> list[str]:
        observed, problems = mode_problems(self.mode)
        self.write({"event": event, "vllm": _vllm_version(), "observed": observed, "problems": problems,
                    "counters": _kvhit_counters()})
        return problems

    def add(self, report) -> None:
        self.reports.setdefault(report.nodeid, []).append(report)
        if report.when == "teardown":
            self.write({"event": "test", "id": report.nodeid, **_outcome(self.reports.pop(report.nodeid))})


def _vllm_version() -> str:
    import vllm

    return vllm.__version__


def _message(report) -> str:
    """The exception's message for a failure (pytest's crash line, prefixed with its file:line), the reason
    for a skip."""
    longrepr = report.longrepr
    if longrepr is None:
        return ""
    if isinstance(longrepr, tuple):            # a skip: (file, line, reason)
        return str(longrepr[2])
    crash = getattr(longrepr, "reprcrash", None)
    if crash is None:
        return str(longrepr)[:MESSAGE_CHARS]
    where = f"{Path(os.path.relpath(crash.path)).as_posix()}:{crash.lineno}"
    return f"{where}: {crash.message}"[:MESSAGE_CHARS]


def _outcome(reports: list) -> dict:
    """A test's outcome from its setup, call and teardown reports, as pytest's summary counts it."""
    by_phase = {report.when: report for report in reports}
    seconds = round(sum(report.duration for report in reports), 3)
    setup, call, teardown = by_phase.get("setup"), by_phase.get("call"), by_phase.get("teardown")
    if setup is not None and setup.failed:
        return {"outcome": "error", "message": _message(setup), "seconds": seconds}
    if setup is not None and setup.skipped:
        return {"outcome": "skipped", "message": _message(setup), "seconds": seconds}
    if call is not None and hasattr(call, "wasxfail"):
        return {"outcome": "xfailed" if call.skipped else "xpassed", "message": call.wasxfail,
                "seconds": seconds}
    if call is not None and call.failed:
        return {"outcome": "failed", "message": _message(call), "seconds": seconds}
    if call is not None and call.skipped:
        return {"outcome": "skipped", "message": _message(call), "seconds": seconds}
    if teardown is not None and teardown.failed:
        return {"outcome": "error", "message": _message(teardown), "seconds": seconds}
    return {"outcome": "passed", "message": "", "seconds": seconds}


class _Run:
    """What this pytest process was asked to do: one per process (``pytest_configure`` makes it)."""

    def __init__(self, config) -> None:
        self.recorder = _Recorder(Path(config.getoption("kvhit_results")), config.getoption("kvhit_mode"))
        exclude = config.getoption("kvhit_exclude")
        self.excluded: dict[str, str] = json.loads(Path(exclude).read_text()) if exclude else {}
        self.matched: dict[str, int] = {}
        """Exclusion entry -> how many files or tests it kept out."""

    def exclusion(self, *names: str) -> str | None:
        """The exclusion entry among ``names`` (counted as used), or None."""
        entry = next((name for name in names if name in self.excluded), None)
        if entry is not None:
            self.matched[entry] = self.matched.get(entry, 0) + 1
        return entry


_run: _Run | None = None
"""Set by ``pytest_configure``; ``pytest_runtest_logreport`` is given no ``config`` to find it on."""


def pytest_configure(config):
    global _run
    _run = _Run(config)


def pytest_sessionstart(session):
    """Set the mode up as ``EngineCore`` does, then check it; stop the session if it is not as asked."""
    import vllm.plugins
    import vllm.v1.core.kv_cache_coordinator  # noqa: F401 - the modules the scan must see
    import vllm.v1.core.kv_cache_manager  # noqa: F401
    import vllm.v1.core.sched.scheduler  # noqa: F401
    import vllm.v1.core.single_type_kv_cache_manager  # noqa: F401

    vllm.plugins.load_general_plugins()
    problems = _run.recorder.session("session-start")
    if problems:
        pytest.exit("kvhit mode not set up: " + "; ".join(problems), returncode=3)


def pytest_sessionfinish(session, exitstatus):
    for entry, count in sorted(_run.matched.items()):
        _run.recorder.write({"event": "excluded", "id": entry, "matched": count})
    _run.recorder.session("session-finish")
    _run.recorder.file.close()


# --------------------------------------------------------------------------------------------------
# Exclusions and vLLM's optional marker
# --------------------------------------------------------------------------------------------------

def pytest_ignore_collect(collection_path, config):
    name = Path(os.path.relpath(collection_path, config.rootpath)).as_posix()
    return True if _run.exclusion(name) is not None else None


def pytest_collection_modifyitems(config, items):
    kept, deselected = [], []
    for item in items:
        excluded = _run.exclusion(item.nodeid, item.nodeid.split("[", 1)[0]) is not None
        (deselected if excluded else kept).append(item)
    if deselected:
        config.hook.pytest_deselected(items=deselected)
        items[:] = kept
    skip_optional = pytest.mark.skip(reason="need --optional option to run")   # as vLLM's root conftest
    for item in items:
        if "optional" in item.keywords:
            item.add_marker(skip_optional)


# --------------------------------------------------------------------------------------------------
# Outcomes
# --------------------------------------------------------------------------------------------------

def pytest_runtest_logreport(report):
    _run.recorder.add(report)


def pytest_collectreport(report):
    if report.failed:
        _run.recorder.write({"event": "collect-error", "id": report.nodeid, "outcome": "error",
                             "message": _message(report)})


# --------------------------------------------------------------------------------------------------
# Fixtures of vLLM's root conftest (tests/conftest.py in vLLM 0.33.0), as it defines them
# --------------------------------------------------------------------------------------------------

@pytest.fixture()
def temporary_enable_log_propagate(monkeypatch):
    from vllm.logger import DEFAULT_LOGGING_CONFIG

    # The first LLM init in a process reapplies DEFAULT_LOGGING_CONFIG, which
    # would otherwise turn propagation back off mid-test.
    monkeypatch.setitem(DEFAULT_LOGGING_CONFIG["loggers"]["vllm"], "propagate", True)
    monkeypatch.setattr(logging.getLogger("vllm"), "propagate", True)


@pytest.fixture()
def caplog_vllm(temporary_enable_log_propagate, caplog):
    # caplog depends on logs propagated to the root logger. The vLLM logger
    # inherits this INFO level until runtime initialization configures it.
    with caplog.at_level(logging.INFO):
        yield caplog

