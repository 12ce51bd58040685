"""vLLM 0.33.0 with the read-side repairs of ``docs/upstream/`` applied, run in a subprocess.

:func:`patch_core` copies the installed ``vllm/v1/core`` into a directory and applies every patch of
``docs/upstream/series`` with ``patch -p1 -F0`` (no fuzz: a patch whose context has moved fails).
:func:`run_patched` starts ``python -m tests.conformance.patched CORE COMMAND ...``: the child makes
``vllm.v1.core`` the patched copy (:func:`use_core`, before any of its submodules is imported) and runs

* ``differential COUNT``: the read-side differential of :mod:`.differential` against a policy (default
  ``vllm_0_33_repaired``) over the catalogue cases of :mod:`.test_hit_tokens_matches_vllm` and random layouts,
  COUNT scenarios in all; every mismatch is collected, not only the first, and a JSON summary is printed;
* ``repro SCRIPT``: a ``docs/repro`` script, as ``python docs/repro/SCRIPT`` would run it.

The test process itself never imports the patched modules: its vLLM stays the installed one.
The write-side repair (``replay_at_resume``) has no patch yet, so the patched engine keeps vLLM's write side
(docs/upstream/README.md).
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
UPSTREAM = ROOT / "docs" / "upstream"
REPRO = ROOT / "docs" / "repro"
READ_SIDE_PATCHES = tuple(line.strip() for line in (UPSTREAM / "series").read_text().splitlines()
                          if line.strip() and not line.startswith("#"))


class PatchFailed(RuntimeError):
    """A patch of the series does not apply cleanly to the installed vLLM files."""


def installed_core() -> Path:
    """The installed ``vllm/v1/core`` directory (found without importing it)."""
    spec = importlib.util.find_spec("vllm")
    return Path(spec.origin).parent / "v1" / "core"


def patch_core(dest: Path, patches=READ_SIDE_PATCHES) -> Path:
    """Copy the installed ``vllm/v1/core`` to ``dest/vllm/v1/core`` and apply ``patches`` in order.

    Raises:
        PatchFailed: a patch does not apply exactly (``patch`` fails, needs fuzz, or finds it applied).
    """
    core = dest / "vllm" / "v1" / "core"
    shutil.copytree(installed_core(), core, ignore=shutil.ignore_patterns("__pycache__"))
    for name in patches:
        out = subprocess.run(["patch", "-p1", "-F0", "-N", "--no-backup-if-mismatch", "-i", str(UPSTREAM / name)],
                             cwd=dest, capture_output=True, text=True)
        text = out.stdout + out.stderr
        if out.returncode != 0 or "fuzz" in text or "FAILED" in text or "offset" in text:
            raise PatchFailed(f"{name} does not apply cleanly to vLLM's installed files:\n{text}")
    return core


def use_core(core_dir: Path) -> None:
    """Make ``vllm.v1.core`` (and so every submodule, ``sched`` included) load from ``core_dir``.

    Must run before anything imports a ``vllm.v1.core`` submodule (``vllm.v1.request`` does).
    """
    import vllm.v1

    loaded = sorted(m for m in sys.modules if m == "vllm.v1.core" or m.startswith("vllm.v1.core."))
    if loaded:
        raise RuntimeError(f"vllm.v1.core is already imported ({loaded}); cannot switch to {core_dir}")
    spec = importlib.util.spec_from_file_location("vllm.v1.core", core_dir / "__init__.py",
                                                  submodule_search_locations=[str(core_dir)])
    module = importlib.util.module_from_spec(spec)
    sys.modules["vllm.v1.core"] = module
    spec.loader.exec_module(module)
    vllm.v1.core = module


def check_loaded_from(core_dir: Path) -> int:
    """Every loaded ``vllm.v1.core`` module comes from ``core_dir``; returns how many are loaded."""
    modules = {m: sys.modules[m] for m in list(sys.modules) if m == "vllm.v1.core" or m.startswith("vllm.v1.core.")}
    outside = {m: getattr(mod, "__file__", None) for m, mod in modules.items()
               if not str(getattr(mod, "__file__", "")).startswith(str(core_dir))}
    if outside:
        raise RuntimeError(f"modules loaded from outside {core_dir}: {outside}")
    return len(modules)


def run_patched(core_dir: Path, *args: str, timeout: int = 900) -> subprocess.CompletedProcess:
    """Run this module's :func:`main` in a subprocess on ``core_dir``."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    return subprocess.run([sys.executable, "-m", "tests.conformance.patched", str(core_dir), *args], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=timeout)


# ----------------------------------------------------------------------------------------------------
# In the subprocess
# ----------------------------------------------------------------------------------------------------


def differential(count: int, policy: str) -> dict:
    """Run ``count`` read-side scenarios against ``policy``; collect every mismatch."""
    from dataclasses import replace

    from hypothesis import HealthCheck, given, settings

    from kvhit.refimpl import policy_rules
    from kvhit.spec.catalogue import CATALOGUE

    from .differential import Mismatch, Stats, run_scenario, to_refimpl
    from .strategies import SPECULATIONS, random_layouts, scenarios
    from .test_hit_tokens_matches_vllm import CASES, HEAVY, RANDOM_SHARE

    rules = policy_rules(policy)
    stats = Stats()
    mismatches: list[str] = []
    quiet = dict(deadline=None, database=None, derandomize=True,
                 suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

    def one(scenario):
        start = time.perf_counter()
        try:
            run_scenario(scenario, stats, rules=rules)
        except Mismatch as e:
            mismatches.append(str(e))
        finally:
            stats.seconds += time.perf_counter() - start

    weights = [HEAVY.get(name, 1.0) for name, _, _ in CASES]
    for (name, dcp, mode), w in zip(CASES, weights):
        layout = to_refimpl(replace(CATALOGUE[name], dcp=dcp))
        specs = [s for s in SPECULATIONS if s.mode.value == mode]
        examples = max(1, round(count * (1 - RANDOM_SHARE) * w / sum(weights)))
        settings(max_examples=examples, **quiet)(given(scenario=scenarios(layout, specs))(one))()
    examples = max(1, count - round(count * (1 - RANDOM_SHARE)))
    settings(max_examples=examples, **quiet)(given(scenario=random_layouts().flatmap(scenarios))(one))()
    return {"policy": policy, "scenarios": stats.scenarios, "rejected_by_both": stats.rejected_by_both,
            "lookups": stats.lookups, "positive_hits": stats.positive_hits,
            "crashes_predicted": stats.crashes_predicted, "stalls": stats.stalls,
            "below_reference": stats.below_reference, "seconds": round(stats.seconds, 1),
            "by_layout": dict(stats.by_layout), "by_mode": dict(stats.by_mode),
            "mismatches": len(mismatches), "first_mismatches": mismatches[:5]}


def main(argv) -> None:
    core_dir, command, *rest = argv
    core_dir = Path(core_dir).resolve()
    use_core(core_dir)
    if command == "differential":
        count = int(rest[0])
        policy = rest[1] if len(rest) > 1 else "vllm_0_33_repaired"
        summary = differential(count, policy)
        summary["patched_modules"] = check_loaded_from(core_dir)
        print("summary=" + json.dumps(summary))
    elif command == "repro":
        import runpy

        script = REPRO / rest[0]
        sys.path.insert(0, str(REPRO))
        sys.argv = [str(script)]
        runpy.run_path(str(script), run_name="__main__")
        print(f"patched_modules={check_loaded_from(core_dir)}")
    else:
        raise SystemExit(f"unknown command {command!r}")


if __name__ == "__main__":
    main(sys.argv[1:])
