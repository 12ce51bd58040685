"""KV connectors through vLLM's real ``Scheduler``: enforced where kvhit has checked both the connector and the
layout, left wholly to vLLM elsewhere.

vLLM's scheduler asks the connector how many tokens it loads past the local hit and starts the request at
their sum. kvhit owns the local hit (``engine.connector_reason``): with a connector of
``engine.CHECKED_CONNECTORS`` (the sum never shrinks when the local hit grows) on a layout of full attention
looked up at its block (whose write side caches every block a request has, wherever it started), enforce
answers the lookup with the reference and leaves the rest to vLLM. DecodeBenchConnector, which starts every
request at ``N - 1`` whatever its local hit, is enforced beside any group. A connector kvhit has not checked,
or another one beside a sliding-window, chunked-local or Mamba group, leaves the layout to vLLM, read side
and write side.

The scenarios (``tests/adapter/scheduler_run.py``, ``CONNECTORS``) serve a block-aligned prompt of 1024 tokens
three times on a Llama + EAGLE draft in drop mode (full attention, block 16: F2, where stock vLLM's local hit
is 992 and the reference's 1008), with vLLM's ExampleConnector (an empty folder, and one holding the prompt),
DecodeBenchConnector and SimpleCPUOffloadConnector, and ExampleConnector loaded by module path (a class kvhit
has not checked); and a block-aligned prompt and its longer sibling on full attention + a sliding window
(W2: stock's sibling hits 1008, the reference's 1024) without and with SimpleCPUOffloadConnector or
DecodeBenchConnector, and DecodeBenchConnector beside Mamba (the shared-system-prompt stream at R = 0). No
worker runs: a connector loads what its scheduler side says it holds.
"""

from __future__ import annotations

import json

import pytest

import kvhit.refimpl as R
from kvhit.adapters.vllm import engine
from tests.adapter import child_runs
from tests.adapter.scheduler_run import CONNECTORS

EAGLE_LAYOUT = R.Layout((R.Group("full", 16, eagle=True),))
DROP = R.Speculation("drop", 1)
ENFORCED = ["connector-example-eagle-drop", "connector-example-loads-eagle-drop", "connector-bench-eagle-drop",
            "connector-cpu-eagle-drop"]
# DecodeBenchConnector beside a sliding-window or Mamba group (engine.FILLING_CONNECTORS): enforced, every request
# starting at N - 1. Scenario -> the layout the scheduler resolves, declared here (the status file must agree).
FILLED = {
    "connector-bench-swa-sibling": R.Layout((R.Group("full", 16), R.Group("swa", 16, window=64))),
    "connector-bench-shared-mamba-r0": R.Layout((R.Group("full", 1600),) + (R.Group("mamba", 1600),) * 3),
}
# scenario -> what the unmodelled reason names
STOCK = {"connector-module-eagle-drop": "has not checked", "connector-cpu-swa-sibling": "a sliding window group"}
# (off patches nothing, with a connector or without: tests/adapter/test_scheduler_plugin.py checks it)
MODES = ("stock", "shadow", "enforce")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """``{mode: result}`` of every connector scenario and the sibling stream without one."""
    return child_runs.scheduler_modes(tmp_path_factory.mktemp("connectors"), [*CONNECTORS, "swa-sibling"], MODES)


def _served(runs, mode, scenario):
    return runs[mode]["scenarios"][scenario]["served"]


def test_the_scenarios_are_the_ones_declared_here():
    assert sorted(CONNECTORS) == sorted(ENFORCED + list(FILLED) + list(STOCK))
    assert {CONNECTORS[s][0] for s in ENFORCED} == engine.CHECKED_CONNECTORS
    assert {CONNECTORS[s][0] for s in FILLED} == engine.FILLING_CONNECTORS


@pytest.mark.parametrize("scenario", ENFORCED)
def test_a_checked_connector_on_full_attention_gets_the_reference_local_hit(runs, scenario):
    """Each request's local hit is ``refimpl``'s reference hit on the cache the pool held (stock vLLM's is
    ``vllm_0_33``'s), and the layout is reported modelled."""
    for mode, policy in (("enforce", "reference"), ("stock", "vllm_0_33")):
        for i, served in enumerate(_served(runs, mode, scenario)):
            expected = R.hit(EAGLE_LAYOUT, DROP, served["prompt_len"], [set(served["retained"][0])], policy)
            assert served["num_local_cached_tokens"] == expected, (scenario, mode, i, served)
    status = runs["enforce"]["scenarios"][scenario]["kvhit_status"]
    assert (status["mode"], status["modelled"]) == ("enforce", True), status


@pytest.mark.parametrize("scenario", ENFORCED)
def test_enforce_first_repeat_hits_the_reference_steady_state_locally(runs, scenario):
    n = 1024
    steady = R.hit(EAGLE_LAYOUT, DROP, n, [n], "reference")
    assert steady == 1008
    assert [s["num_local_cached_tokens"] for s in _served(runs, "enforce", scenario)[1:]] == [steady, steady]


@pytest.mark.parametrize("scenario", ENFORCED)
def test_the_connector_adds_what_it_holds_past_the_local_hit_and_enforce_never_starts_below_stock(runs, scenario):
    """vLLM starts each request at the local hit plus what the connector loads past it: the empty folder and
    the CPU pool no worker fills load nothing; the folder holding the prompt loads up to the prefix it holds
    (what the first request, which finds nothing local, loads); DecodeBenchConnector fills all but the last
    token. So the total is never below stock's, and above it where the connector holds less than the
    reference's local hit."""
    stock, enforce = (_served(runs, mode, scenario) for mode in ("stock", "enforce"))
    held = enforce[0]["num_external_cached_tokens"]
    for s, e in zip(stock, enforce):
        assert e["num_cached_tokens"] >= s["num_cached_tokens"], (scenario, s, e)
        for served in (s, e):
            local = served["num_local_cached_tokens"]
            if CONNECTORS[scenario][0] == "DecodeBenchConnector":
                loaded = served["prompt_len"] - 1 - local
            else:
                loaded = max(held - local, 0)
            assert served["num_external_cached_tokens"] == loaded, (scenario, served)
    assert held == {"connector-example-loads-eagle-drop": 1008, "connector-bench-eagle-drop": 1023}.get(scenario, 0)


def test_enforce_changes_the_hit_where_the_connector_holds_nothing(runs):
    """The comparison can fail: F2 on the connector's layout, 1008 where stock vLLM gets 992."""
    hits = {mode: child_runs.served_hits(runs[mode], "connector-example-eagle-drop") for mode in MODES}
    assert hits["stock"] == hits["shadow"] == [0, 992, 992] and hits["enforce"] == [0, 1008, 1008], hits


@pytest.mark.parametrize("scenario", list(STOCK))
@pytest.mark.parametrize("mode", ["enforce", "shadow"])
def test_an_unchecked_connector_or_one_beside_a_sliding_window_leaves_the_layout_to_vllm(runs, scenario, mode):
    """Every ``SchedulerOutput`` and ``EngineCoreOutput`` is stock vLLM's, and the status file says why."""
    stock = child_runs.scheduled(runs["stock"], scenario)
    assert json.dumps(child_runs.scheduled(runs[mode], scenario), sort_keys=True) == json.dumps(stock, sort_keys=True)
    status = runs[mode]["scenarios"][scenario]["kvhit_status"]
    assert status["modelled"] is False and "KV connector" in status["unmodelled"], status
    assert STOCK[scenario] in status["unmodelled"], status
    assert runs[mode]["kvhit_counters"]["kvhit_unmodelled_layouts"] == len(STOCK)


def test_without_the_connector_enforce_changes_the_sliding_window_layouts_hit(runs):
    """The comparison above can fail: without a connector, enforce's sibling hits 1024 where stock's hits
    1008 (W2); with SimpleCPUOffloadConnector beside the sliding window both hit 1008."""
    stock, enforce = (child_runs.served_hits(runs[mode], "swa-sibling") for mode in ("stock", "enforce"))
    assert (stock[1], enforce[1]) == (1008, 1024), (stock, enforce)
    assert child_runs.served_hits(runs["enforce"], "connector-cpu-swa-sibling") == stock


def _local_hit(layout, served, policy):
    """``refimpl``'s hit under ``policy`` on the cache the pool held for the request (per spec group, the
    boundaries every one of its KV-cache groups held)."""
    sizes = R.derive_sizes(layout, R.Speculation("none"))
    cache = [set.intersection(*(set(served["retained"][m]) for m in sg.members)) for sg in sizes.groups]
    return R.hit(layout, R.Speculation("none"), served["prompt_len"], cache, policy)


@pytest.mark.parametrize("scenario", list(FILLED))
def test_decode_bench_beside_a_sliding_window_or_mamba_group_is_enforced_and_starts_every_request_at_n_minus_1(
        runs, scenario):
    """DecodeBenchConnector, the one connector whose worker runs on these machines beside such a group, fills
    all but the last token of every request on its first scheduling: every request starts at ``N - 1`` in
    every mode, whatever the local hit, so no policy decides where a request starts. Enforce owns the layout
    whole: each local hit is the reference's on the cache the pool held (every state it relies on is there),
    stock's is ``vllm_0_33``'s on its own, and the status file reports the declared layout modelled."""
    layout = FILLED[scenario]
    for mode, policy in (("stock", "vllm_0_33"), ("shadow", "vllm_0_33"), ("enforce", "reference")):
        for i, served in enumerate(_served(runs, mode, scenario)):
            assert served["num_cached_tokens"] == served["prompt_len"] - 1, (mode, i, served)
            assert served["num_local_cached_tokens"] == _local_hit(layout, served, policy), (mode, i, served)
    status = runs["enforce"]["scenarios"][scenario]["kvhit_status"]
    assert (status["mode"], status["modelled"]) == ("enforce", True), status
    assert R.Layout(tuple(R.Group(**g) for g in status["layout"]["groups"]), **{
        k: v for k, v in status["layout"].items() if k != "groups"}) == layout, status


def test_enforce_under_decode_bench_keeps_the_window_block_stock_drops(runs):
    """The comparison above can fail: on the sliding-window sibling stream enforce keeps the window's last
    block, which stock vLLM does not cache (W2), so its longer siblings find 1024 tokens locally where
    stock's find none; the connector fills the rest, and both start at ``N - 1``. On the Mamba stream
    enforce keeps the state at the end of the first prompt, which serves no request of the stream."""
    local = {mode: [s["num_local_cached_tokens"] for s in _served(runs, mode, "connector-bench-swa-sibling")]
             for mode in ("stock", "enforce")}
    assert local == {"stock": [0, 0, 0, 0], "enforce": [0, 1024, 0, 1024]}, local
    last = {mode: _served(runs, mode, "connector-bench-shared-mamba-r0")[-1]["retained"]
            for mode in ("stock", "enforce")}
    assert last["stock"][1:] == [[], [], []] and last["enforce"][1:] == [[8000]] * 3, last


@pytest.mark.parametrize("scenario", [*CONNECTORS, "swa-sibling"])
def test_shadow_schedules_exactly_as_stock(runs, scenario):
    stock = child_runs.scheduled(runs["stock"], scenario)
    assert json.dumps(child_runs.scheduled(runs["shadow"], scenario), sort_keys=True) == json.dumps(stock,
                                                                                                  sort_keys=True)


# --------------------------------------------------------------------------------------------------
# The checked connectors' answers, driven directly
# --------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def cpu_offload_starts(tmp_path_factory):
    """``tests/adapter/connector_probe.py``'s result: per seed, the CPU pool's held blocks and the start of a
    request at each local hit."""
    out = tmp_path_factory.mktemp("connector_probe") / "starts.json"
    started = {"probe": (out, child_runs.start("tests.adapter.connector_probe", [out], child_runs.env()))}
    return child_runs.collect(started)["probe"][0]


def test_simple_cpu_offload_never_starts_a_request_earlier_when_the_local_hit_grows(cpu_offload_starts):
    """``CHECKED_CONNECTORS``' claim for SimpleCPUOffloadConnector, on vLLM's own connector: with its CPU pool
    holding a random set of the prompt's blocks (runs and gaps), the local hit plus what the connector loads
    past it never decreases as the local hit grows, block by block from 0 to ``N - 1``; and it loads something
    for some local hit and some gap stops it (the check is not vacuous)."""
    assert len(cpu_offload_starts) >= 8
    for probe in cpu_offload_starts:
        starts, locals_ = probe["starts"], probe["locals"]
        assert all(a <= b for a, b in zip(starts, starts[1:])), probe
        assert any(start > local for start, local in zip(starts, locals_)), probe
        assert not all(probe["held"]), probe


def test_simple_cpu_offload_cannot_run_its_worker_on_these_machines():
    """Why SimpleCPUOffloadConnector beside a sliding-window or Mamba group is not served here
    (docs/adapter.md, "KV connectors"): vLLM 0.33's worker side asks CUDA for stream priorities when it
    registers the KV caches, which the CPU build of torch lacks. (With prefix caching off it builds no
    worker and no lookup happens.) If a vLLM makes it run on the CPU, this fails and the docs must change."""
    import torch
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheTensor
    from vllm.v1.simple_kv_offload.worker import SimpleCPUOffloadWorker

    num_blocks, page = 8, 256
    tensor = KVCacheTensor(size=num_blocks * page, layers=["layer0"], layer_stride=num_blocks * page,
                           block_stride=page)
    config = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[tensor], kv_cache_groups=[])
    worker = SimpleCPUOffloadWorker(None, config, cpu_capacity_bytes=1 << 20)
    with pytest.raises(AttributeError, match="priority_range"):
        worker.register_kv_caches({"layer0": torch.zeros(num_blocks, page, dtype=torch.int8)})
