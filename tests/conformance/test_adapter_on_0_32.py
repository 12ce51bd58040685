"""kvhit's adapter for vLLM 0.32.0 (``adapters/vllm/v0_32.py``), on 0.32.0's own classes (``make
conformance-032``, in .venv-vllm032; not collected under 0.33.0).

In process: the seams are 0.32.0's own objects until installed, installing and uninstalling restores every
original, and on the D3 stream (``test_junction_below.py``) enforce keeps the dropping group's state one
block below the junction as the reference does (0.32.0 itself does not). Through vLLM 0.32.0's plugin
loading (``vllm.plugins.load_general_plugins`` with ``VLLM_PLUGINS=kvhit`` and ``KVHIT_MODE``) into a real
``Scheduler`` built from a ``VllmConfig`` (``tests/adapter/scheduler_run.py``, one process per mode, as
``tests/adapter/test_scheduler_plugin.py`` runs it on 0.33.0): off and shadow are stock to the byte,
enforce serves ``kvhit.refimpl``'s ``reference`` hit on the cache its pool held, its first repeat is the
second's and the reference's on the whole prompt, and it never hits less than stock, which serves
``vllm_0_32``'s.
"""

from __future__ import annotations

import json

import pytest

import kvhit.adapters.vllm as kvhit_vllm
import kvhit.refimpl as R
from kvhit.adapters.vllm import engine, v0_32
from tests.adapter import child_runs, scheduler_run

from .test_junction_below import JUNCTION, _model_c_hit, serve_stream
from .vllm_harness import VLLM_VERSION


def test_the_adapter_is_registered_for_vllm_0_32_and_its_seams_are_vllms_until_installed():
    assert VLLM_VERSION == engine.VLLM_VERSION == "0.32.0" and kvhit_vllm.RELEASES["0.32.0"] == "v0_32"
    assert kvhit_vllm.current_mode() == "off"
    assert all(vars(owner)[name] is original for owner, name, original, _ in v0_32.SEAMS)
    assert kvhit_vllm.install("off") is False
    assert all(vars(owner)[name] is original for owner, name, original, _ in v0_32.SEAMS)


@pytest.mark.parametrize("mode", ["shadow", "enforce"])
def test_install_replaces_every_seam_and_uninstall_restores_every_original(mode):
    try:
        assert kvhit_vllm.install(mode) is True and kvhit_vllm.install(mode) is True  # idempotent
        assert all(vars(owner)[name] is replacement for owner, name, _, replacement in v0_32.SEAMS)
    finally:
        kvhit_vllm.uninstall()
    assert kvhit_vllm.current_mode() == "off"
    assert all(vars(owner)[name] is original for owner, name, original, _ in v0_32.SEAMS)


def test_enforce_keeps_the_dropping_groups_state_below_the_junction_that_vllm_0_32_does_not():
    """D3 under enforce: vLLM 0.32.0 keeps a dropping group's state at the junction only, so C hits 0 on
    stock; the reference write side also keeps it one block below (``v0_32.manager_cache_blocks``), and C
    hits what the reference predicts on the cache A and B leave under it (1344). Without that seam enforce
    would be short of its own prediction."""
    _, *stock = serve_stream()
    with kvhit_vllm.enabled("enforce"):
        _, *enforced = serve_stream()
    assert stock == [0, JUNCTION, 0] and stock[2] == _model_c_hit(R.VLLM_0_32, *stock[:2])
    assert enforced[2] == _model_c_hit(R.REFERENCE, *enforced[:2]) == 1344, enforced


# --------------------------------------------------------------------------------------------------
# Through vLLM 0.32.0's plugin loading into a real Scheduler
# --------------------------------------------------------------------------------------------------

# The layouts vLLM 0.32.0's planner makes for scheduler_run's models (D4: it flags the group of the last
# registered layer for MTP, and no group for EAGLE, so the coordinator drops in every group). Every drafter
# drops (D1). scenario -> (layout, speculation, each KV-cache group's (spec class, is_eagle_group)).
_FULL_EAGLE = (R.Layout((R.Group("full", 16),)), R.Speculation("drop", 1), [("FullAttentionSpec", False)])
_SWA_EAGLE = (R.Layout((R.Group("full", 16), R.Group("full", 16), R.Group("swa", 16, window=64))),
              R.Speculation("drop", 1), [("FullAttentionSpec", False)] * 2 + [("SlidingWindowSpec", False)])
_MTP = (R.Layout((R.Group("full", 1600, eagle=True), R.Group("mamba", 1600))), R.Speculation("drop", 2, True),
        [("FullAttentionSpec", True), ("MambaSpec", False)])
_MAMBA = (R.Layout((R.Group("full", 1600),) + (R.Group("mamba", 1600),) * 3), R.Speculation("none"),
          [("FullAttentionSpec", False)] + [("MambaSpec", False)] * 3)
SETUP = {
    "eagle-drop": _FULL_EAGLE, "swa-eagle-drop": _SWA_EAGLE, "mtp2-drop": _MTP,
    "shared-mamba-r0": _MAMBA, "shared-mamba-dense": _MAMBA,
    "shared-swa-eagle-drop-r0": _SWA_EAGLE, "shared-mtp2-drop-r0": _MTP, "shared-mtp2-drop-dense": _MTP,
}
# scenario -> prompt lengths whose first and second repeats are compared with the reference's steady state
REPEATED = {"eagle-drop": 1024, "swa-eagle-drop": 1000, "mtp2-drop": 8000}
RUNS = {"stock": None, "off": "off", "shadow": "shadow", "enforce": "enforce"}  # run -> KVHIT_MODE
# KV connectors (tests/adapter/scheduler_run.py, CONNECTORS) and the sliding-window stream without one
CONNECTOR_RUNS = ("connector-example-eagle-drop", "connector-cpu-swa-sibling", "swa-sibling")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """``{run: (result, kvhit's log lines)}``, each run a process of its own, started together."""
    work = tmp_path_factory.mktemp("scheduler_run_032")
    scheduler_run.write_models(str(work / "models"))
    scenarios = [arg for name in [*SETUP, *CONNECTOR_RUNS] for arg in ("--scenario", name)]
    started = {}
    for run, mode in RUNS.items():
        extra = [] if mode is None else ["--load-plugins"]
        out = work / f"{run}.json"
        started[run] = (out, child_runs.start("tests.adapter.scheduler_run",
                                              [out, work / "models", *extra, *scenarios], child_runs.env(mode)))
    return {run: (result, [line for line in log.splitlines() if "kvhit" in line])
            for run, (result, log) in child_runs.collect(started).items()}


def _served(runs, run, scenario):
    return runs[run][0]["scenarios"][scenario]["served"]


def _hit_on_retained(scenario, served, policy):
    """``refimpl``'s hit under ``policy`` on the cache the run's pool held for the prompt."""
    layout, speculation, _ = SETUP[scenario]
    sizes = R.derive_sizes(layout, speculation)
    cache = [set.intersection(*(set(served["retained"][m]) for m in sg.members)) for sg in sizes.groups]
    return R.hit(layout, speculation, served["prompt_len"], cache, policy)


def test_vllm_0_32s_plugin_loader_installs_kvhit_as_kvhit_mode_says(runs):
    assert not runs["stock"][0]["kvhit_imported"] and not runs["stock"][1]
    assert runs["stock"][0]["modules"] == []
    for mode in ("off", "shadow", "enforce"):  # of kvhit, only the package, the refimpl and the adapter
        assert [m for m in runs[mode][0]["modules"] if m != "kvhit"
                and not m.startswith(("kvhit.refimpl", "kvhit.adapters"))] == [], mode
    assert "kvhit.refimpl.staging" in runs["enforce"][0]["modules"]
    assert runs["off"][0]["kvhit_mode"] == "off" and not runs["off"][1]
    for mode in ("shadow", "enforce"):
        result, lines = runs[mode]
        assert result["kvhit_mode"] == mode
        assert len([line for line in lines if f"mode {mode} on vLLM 0.32.0: replaced" in line]) == 1, lines
        assert result["kvhit_counters"]["kvhit_enforce_fallbacks"] == 0
        # one layout line per distinct layout (SETUP's four and the sliding-window stream's; ExampleConnector's
        # is eagle-drop's); only the one with a connector beside a sliding window is left to vLLM
        assert len([line for line in lines if "is modelled" in line]) == 5, lines
        assert [line for line in lines if "not modelled" in line and "KV connector" in line], lines


@pytest.mark.parametrize("scenario", list(SETUP))
def test_the_planner_and_scheduler_build_the_layout_the_expectations_use(runs, scenario):
    layout, speculation, groups = SETUP[scenario]
    sizes = R.derive_sizes(layout, speculation)
    for run in RUNS:
        result = runs[run][0]["scenarios"][scenario]
        assert [(g["spec"], g["is_eagle_group"]) for g in result["kv_cache_groups"]] == groups, run
        assert [g["block_size"] for g in result["kv_cache_groups"]] == [g.block_size for g in layout.groups]
        sched = result["scheduler"]
        assert (sched["block_size"], sched["hash_block_size"], sched["use_eagle_block_drop"],
                sched["num_hash_lookahead_tokens"], sched["num_prefill_lookahead"],
                sched["multi_module_mtp"]) == (sizes.scheduler_block, sizes.hash_block, speculation.drop, 0,
                                               speculation.prefill_lookahead, speculation.multi_module_mtp), run


@pytest.mark.parametrize("run", ["off", "shadow"])
def test_off_and_shadow_leave_the_scheduler_byte_identical_to_stock(runs, run):
    """Every ``SchedulerOutput`` (tokens, block ids, drafts) and ``EngineCoreOutput`` of every scenario:
    shadow changes no hit, no block and no chunk."""
    stock = json.dumps(runs["stock"][0]["scenarios"], sort_keys=True)
    assert json.dumps(runs[run][0]["scenarios"], sort_keys=True) == stock
    assert json.dumps(runs["enforce"][0]["scenarios"], sort_keys=True) != stock


@pytest.mark.parametrize("scenario", list(SETUP))
def test_enforce_serves_the_reference_hit_and_never_less_than_stock_which_serves_vllm_0_32s(runs, scenario):
    stock, enforce = _served(runs, "stock", scenario), _served(runs, "enforce", scenario)
    for i, (s, e) in enumerate(zip(stock, enforce, strict=True)):
        assert s["num_cached_tokens"] == _hit_on_retained(scenario, s, "vllm_0_32"), (scenario, "stock", i, s)
        assert e["num_cached_tokens"] == _hit_on_retained(scenario, e, "reference"), (scenario, "enforce", i, e)
        assert e["num_cached_tokens"] >= s["num_cached_tokens"], (scenario, i)


@pytest.mark.parametrize("scenario", list(REPEATED))
def test_enforce_first_repeat_is_the_second_and_the_references_on_the_whole_prompt(runs, scenario):
    layout, speculation, _ = SETUP[scenario]
    n = REPEATED[scenario]
    steady = R.hit(layout, speculation, n, [n] * len(R.derive_sizes(layout, speculation).groups), "reference")
    hits = [s["num_cached_tokens"] for s in _served(runs, "enforce", scenario) if s["prompt_len"] == n][1:]
    assert len(hits) == 2 and hits == [steady] * 2, (scenario, hits, steady)


def test_enforce_keeps_the_eagle_block_stock_vllm_0_32_drops(runs):
    """F2 on 0.32.0 through the scheduler (the comparison can fail): one full-attention group of block 16,
    a block-aligned prompt of 1024, EAGLE drop: stock's repeat hits 992, enforce's 1008."""
    assert [s["num_cached_tokens"] for s in _served(runs, "stock", "eagle-drop")] == [0, 992, 992]
    assert [s["num_cached_tokens"] for s in _served(runs, "enforce", "eagle-drop")] == [0, 1008, 1008]


def test_a_checked_kv_connector_on_full_attention_is_enforced_and_one_beside_a_sliding_window_is_not(runs):
    """As on 0.33 (tests/adapter/test_connectors.py): with vLLM's ExampleConnector (its folder empty) enforce
    answers the local lookup (F2: 1008 where stock gets 992); with SimpleCPUOffloadConnector beside a sliding
    window the layout is stock's, including the longer sibling where enforce without a connector gains
    (W2: 1024 where stock gets 1008)."""
    hits = {run: [s["num_cached_tokens"] for s in _served(runs, run, "connector-example-eagle-drop")]
            for run in ("stock", "enforce")}
    assert hits == {"stock": [0, 992, 992], "enforce": [0, 1008, 1008]}, hits
    stock = runs["stock"][0]["scenarios"]["connector-cpu-swa-sibling"]
    assert child_runs.scheduled(runs["enforce"][0], "connector-cpu-swa-sibling") == stock
    siblings = [[s["num_cached_tokens"] for s in _served(runs, run, "swa-sibling")] for run in ("stock", "enforce")]
    assert [hits[1] for hits in siblings] == [1008, 1024], siblings
    assert [s["num_cached_tokens"] for s in stock["served"]] == siblings[0]
