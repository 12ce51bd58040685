"""vLLM 0.33.0 with the repairs of ``docs/upstream/`` applied, run in a subprocess.

:func:`patch_core` copies the installed ``vllm/v1/core`` into a directory and applies the patches of
``docs/upstream/series`` (default: all of them, the four read-side repairs and ``replay_at_resume``, the
write side) with ``patch -p1 -F0`` (no fuzz: a patch whose context has moved fails). :func:`run_patched`
starts ``python -m tests.conformance.patched CORE COMMAND ...``: the child makes ``vllm.v1.core`` the patched
copy (:func:`use_core`, before any of its submodules is imported) and runs

* ``differential COUNT``: the read-side differential of :mod:`.differential` against a policy (default
  ``vllm_0_33_repaired``) over the catalogue cases of :mod:`.test_hit_tokens_matches_vllm` and random layouts,
  COUNT scenarios in all; every mismatch is collected, not only the first, and a JSON summary is printed;
* ``write-differential COUNT``: the write-side differential of :mod:`.write_side` (what the first request
  leaves, the resends' and siblings' hits) against a policy (default ``vllm_0_33_repaired``) over the cases
  of :mod:`.test_write_side_matches_vllm`, COUNT scenarios and its pinned ones, and the counterexamples of
  the divergences once found and since removed (:data:`FORMER_DIVERGENCES`); every mismatch is collected and
  a JSON summary printed; ``KVHIT_MISMATCH_LOG`` names a file for the full text of every mismatch;
* ``seeded LABEL N CACHE``: the hit vLLM's classes give a prompt of N tokens on the configuration LABEL (of
  the extended domain) holding CACHE (a counterexample's ``"cache"``, JSON), as
  :func:`.differential.seeded_harness` seeds it;
* ``repro SCRIPT ...``: ``docs/repro`` scripts, one after another, each as ``python docs/repro/SCRIPT`` would
  run it (after a line ``script=SCRIPT``).

The test process itself never imports the patched modules: its vLLM stays the installed one.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

from kvhit.refimpl import Group, Layout, Speculation

ROOT = Path(__file__).resolve().parents[2]
UPSTREAM = ROOT / "docs" / "upstream"
REPRO = ROOT / "docs" / "repro"
SERIES = tuple(line.strip() for line in (UPSTREAM / "series").read_text().splitlines()
               if line.strip() and not line.startswith("#"))
WRITE_SIDE_PATCH = "replay_at_resume.patch"
READ_SIDE_PATCHES = tuple(name for name in SERIES if name != WRITE_SIDE_PATCH)


class PatchFailed(RuntimeError):
    """A patch of the series does not apply cleanly to the installed vLLM files."""


def installed_core() -> Path:
    """The installed ``vllm/v1/core`` directory (found without importing it)."""
    spec = importlib.util.find_spec("vllm")
    return Path(spec.origin).parent / "v1" / "core"


def patch_core(dest: Path, patches=SERIES) -> Path:
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


def _draw(count: int, cases, random_share: float, strategy, quiet: dict, one) -> None:
    """Run ``one`` on about ``count`` derandomized scenarios of ``strategy(layout, speculations)``: the
    catalogue ``cases`` (each weighted as the conformance suite weighs it, ``HEAVY``) and a ``random_share``
    of random layouts; the read and the write differential draw alike."""
    from dataclasses import replace

    from hypothesis import given, settings

    from kvhit.spec.catalogue import CATALOGUE

    from .differential import to_refimpl
    from .strategies import SPECULATIONS, random_layouts
    from .test_hit_tokens_matches_vllm import HEAVY

    weights = [HEAVY.get(name, 1.0) for name, _, _ in cases]
    for (name, dcp, mode), w in zip(cases, weights):
        layout = to_refimpl(replace(CATALOGUE[name], dcp=dcp))
        specs = [s for s in SPECULATIONS if s.mode.value == mode]
        examples = max(1, round(count * (1 - random_share) * w / sum(weights)))
        settings(max_examples=examples, **quiet)(given(scenario=strategy(layout, specs))(one))()
    examples = max(1, count - round(count * (1 - random_share)))
    settings(max_examples=examples, **quiet)(given(scenario=random_layouts().flatmap(strategy))(one))()


def differential(count: int, policy: str) -> dict:
    """Run ``count`` read-side scenarios against ``policy``; collect every mismatch."""
    from hypothesis import HealthCheck

    from kvhit.refimpl import policy_rules

    from .differential import Mismatch, Stats, run_scenario
    from .strategies import scenarios
    from .test_hit_tokens_matches_vllm import CASES, RANDOM_SHARE

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

    _draw(count, CASES, RANDOM_SHARE, scenarios, quiet, one)
    return {"policy": policy, "scenarios": stats.scenarios, "rejected_by_both": stats.rejected_by_both,
            "lookups": stats.lookups, "positive_hits": stats.positive_hits,
            "crashes_predicted": stats.crashes_predicted, "stalls": stats.stalls,
            "below_reference": stats.below_reference, "seconds": round(stats.seconds, 1),
            "by_layout": dict(stats.by_layout), "by_mode": dict(stats.by_mode),
            "mismatches": len(mismatches), "first_mismatches": mismatches[:5]}


QWEN3NEXT = Layout((Group("full", 1600), Group("mamba", 1600)), name="qwen3next")


def _scenario(layout, speculation, retention, n):
    """A first request, then a resend (:class:`.write_side.WriteScenario`); ``layout`` a catalogue name or a
    refimpl ``Layout``."""
    from kvhit.spec.catalogue import CATALOGUE

    from .differential import to_refimpl
    from .write_side import WriteScenario

    if isinstance(layout, str):
        layout = to_refimpl(CATALOGUE[layout])
    return WriteScenario(layout, speculation, retention, n, (("resend",),), seed=n)


# The counterexamples of the divergences between the patched engine and the model once found here and since
# removed, compared on every write-differential run. Four were the model's: mamba_dense_below_alignment (dense
# retention stops every max(A, b) tokens, mamba_held), mamba_state_within_prefill_lookahead (no Mamba state
# within Lp of the prompt end, group_extent), decoded_tail_past_the_token_limit (partial_tail_boundary's token
# limit, decoded_tail) and mamba_state_inside_a_block (a Mamba group read at hash granularity: vllm_0_33_repaired
# keeps vLLM's one partial tail per request, spec.retention.mamba_held). One was the patch's:
# mamba_partial_tail_within_prefill_lookahead (MambaManager.cache_blocks keys no prompt checkpoint within the
# prefill lookahead of the prompt end, where no chunk ends and the running state is the whole prompt's). And one
# the model and the patch changed together (2026-12-06): short_prompt_tail_where_a_decoded_resend_resumes (with
# the EAGLE drop and multi-module MTP a short prompt's resend resumes nowhere right after its prefill; its one
# partial tail goes where it resumes after decoding, spec.retention.resume_tail; the patch before kept none).
FORMER_DIVERGENCES = {
    "mamba_dense_below_alignment": lambda: _scenario(Layout((Group("full", 64), Group("mamba", 16))),
                                                     Speculation("drop", 1), None, 241),
    "mamba_state_within_prefill_lookahead": lambda: _scenario(QWEN3NEXT, Speculation("drop", 3, True), 1600, 3202),
    "decoded_tail_past_the_token_limit": lambda: _scenario(
        Layout((Group("mamba", 32), Group("full", 32)), dcp=2, prefix_match_unit=32), Speculation("drop", 2, True),
        128, 127),
    "mamba_state_inside_a_block": lambda: _scenario("qwen3next_pmu160", Speculation("none"), 0, 4800),
    "mamba_partial_tail_within_prefill_lookahead": lambda: _scenario(
        Layout((Group("mamba", 32), Group("mamba", 128)), dcp=2), Speculation("drop", 2, True), 384, 193),
    "short_prompt_tail_where_a_decoded_resend_resumes": lambda: _scenario(
        Layout((Group("full", 1600, eagle=True), Group("mamba", 1600)), prefix_match_unit=160),
        Speculation("drop", 2, True), None, 320),
}


def write_differential(count: int, policy: str) -> dict:
    """Run ``count`` write-side scenarios (those of :mod:`.test_write_side_matches_vllm`: its catalogue cases
    and random layouts in its proportions, then its pinned scenarios and :data:`FORMER_DIVERGENCES`) against
    ``policy``; collect every mismatch."""
    from hypothesis import HealthCheck

    from kvhit.refimpl import policy_rules

    from .differential import Mismatch
    from .strategies import write_scenarios
    from .test_write_side_matches_vllm import CASES, PINNED, RANDOM_SHARE
    from .write_side import WriteStats, run_write_scenario

    rules = policy_rules(policy)
    stats = WriteStats()
    mismatches: list[str] = []
    quiet = dict(deadline=None, database=None, derandomize=True,
                 suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                        HealthCheck.filter_too_much])

    def one(scenario):
        start = time.perf_counter()
        try:
            run_write_scenario(scenario, stats, rules=rules)
        except Mismatch as e:
            mismatches.append(str(e))
        finally:
            stats.seconds += time.perf_counter() - start

    _draw(count, CASES, RANDOM_SHARE, write_scenarios, quiet, one)
    for scenario in PINNED:
        one(scenario)
    # Each former divergence must be compared, not passed by: its resend looked up and checked against the
    # model (no mismatch, no stall, no predicted IndexError cutting the stream short).
    former = {}
    for name, make in FORMER_DIVERGENCES.items():
        before = (len(mismatches), stats.resends, stats.stalls, stats.crashes_predicted)
        one(make())
        after = (len(mismatches), stats.resends, stats.stalls, stats.crashes_predicted)
        former[name] = "compared" if after == (before[0], before[1] + 1, before[2], before[3]) else "not compared"
    if os.environ.get("KVHIT_MISMATCH_LOG"):
        Path(os.environ["KVHIT_MISMATCH_LOG"]).write_text("\n\n".join(mismatches))
    return {"policy": policy, "scenarios": stats.scenarios, "retained_groups": stats.retained_groups,
            "resends": stats.resends, "siblings": stats.siblings, "positive": stats.positive,
            "crashes_predicted": stats.crashes_predicted, "stalls": stats.stalls,
            "below_dense": stats.below_dense, "seconds": round(stats.seconds, 1),
            "by_layout": dict(stats.by_layout), "by_mode": dict(stats.by_mode),
            "mismatches": len(mismatches), "former_divergences": former,
            "first_mismatches": mismatches[:5], "mismatch_kinds": dict(Counter(" / ".join(m.splitlines()[:2]).split("[")[0] + " " + m.splitlines()[0]
                                           for m in mismatches))}


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
    elif command == "write-differential":
        count = int(rest[0])
        policy = rest[1] if len(rest) > 1 else "vllm_0_33_repaired"
        summary = write_differential(count, policy)
        summary["patched_modules"] = check_loaded_from(core_dir)
        print("summary=" + json.dumps(summary))
    elif command == "seeded":
        # the hit of vLLM's classes for a configuration (extended domain, by label) holding a
        # counterexample's cache (JSON: per spec group, runs of cached blocks per unit), prompt of N tokens
        from kvhit.proofs.domains import configs

        label, n, record_cache = rest[0], int(rest[1]), json.loads(rest[2])
        config = next(c for c in configs(True) if c.label == label)
        from .differential import seeded_harness

        seeded = seeded_harness(config, n, record_cache)
        print(f"hit={seeded.harness.probe(seeded.tokens)['hit']} patched_modules={check_loaded_from(core_dir)}")
    elif command == "repro":
        import runpy

        sys.path.insert(0, str(REPRO))
        for name in rest:  # several scripts share one start-up of vLLM
            script = REPRO / name
            print(f"script={name}", flush=True)
            sys.argv = [str(script)]
            runpy.run_path(str(script), run_name="__main__")
        print(f"patched_modules={check_loaded_from(core_dir)}")
    else:
        raise SystemExit(f"unknown command {command!r}")


if __name__ == "__main__":
    main(sys.argv[1:])
