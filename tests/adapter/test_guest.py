"""The adapter is a guest in vLLM: arguments vLLM accepts but kvhit did not expect never make it raise.

vLLM's own tests build a ``KVCacheManager`` with ``num_hash_lookahead_tokens=True`` (vLLM takes it as 1);
numpy integers and flags reach the same constructor from other callers. Each case is first served by stock
vLLM (it must accept it, else it is no case), then in shadow and in enforce: the constructor and every
lookup and write-side seam the serving reaches (``get_kv_cache_coordinator``, ``find_longest_cache_hit``,
``find_longest_cache_hit_per_group``, ``cache_blocks`` with ``replay_boundaries`` and the Mamba checkpoint)
return without raising; shadow leaves every hit as stock's; enforce either models the layout (the value read
as vLLM's arithmetic reads it) or leaves it wholly to vLLM, counted.
"""

from __future__ import annotations

import numpy as np
import pytest
from prometheus_client import REGISTRY

import kvhit.adapters.vllm as kvhit_vllm
from kvhit.adapters.vllm import engine
from tests.adapter.layouts import harness_layout
from tests.conformance import vllm_harness
from tests.conformance.vllm_harness import VllmHarness

# name -> (layout, (use_eagle, num_hash_lookahead_tokens, num_prefill_lookahead) as passed to KVCacheManager,
#          what kvhit should read them as: the speculation's describe())
CASES = {
    "lookahead True, one group": ("full16", (False, True, True), "lookahead Lp=1"),
    "lookahead True, Mamba hybrid": ("qwen3next", (False, True, True), "lookahead Lp=1"),
    "numpy lookahead": ("qwen3next", (False, np.int64(1), np.int64(1)), "lookahead Lp=1"),
    "numpy drop flag and prefill": ("qwen3next", (np.bool_(True), 0, np.int64(2)), "drop Lp=2 mtp2"),
}
PROMPT = list(range(1, 4000))


def _serve(monkeypatch, layout: str, arguments: tuple) -> tuple[VllmHarness, list[int]]:
    """Serve ``PROMPT`` twice through a harness whose manager gets ``arguments``; the per-group lookup too."""
    monkeypatch.setattr(vllm_harness, "resolve_manager_mode", lambda *_: arguments)
    harness = VllmHarness(harness_layout(layout), "lookahead", max_model_len=16384)
    hits = [harness.serve(PROMPT)["hit"], harness.serve(PROMPT)["hit"], harness.probe(PROMPT)["hit"]]
    coordinator = harness.manager.coordinator
    if isinstance(coordinator, engine.HybridKVCacheCoordinator):
        request = harness._new_request(PROMPT)
        hits += list(coordinator.find_longest_cache_hit_per_group(request.block_hashes, len(PROMPT) - 1)[1])
    return harness, hits


@pytest.mark.parametrize("case", list(CASES))
def test_unexpected_argument_types_never_make_the_adapter_raise(monkeypatch, case):
    layout, arguments, read_as = CASES[case]
    kvhit_vllm.uninstall()
    _, stock = _serve(monkeypatch, layout, arguments)

    assert kvhit_vllm.install("shadow")
    harness, shadow = _serve(monkeypatch, layout, arguments)
    assert shadow == stock, case
    model = engine._models[harness.manager.coordinator]
    assert model is not None and model.speculation.describe() == read_as, (case, model)

    assert kvhit_vllm.install("enforce")
    fallbacks = {"layout": model.label}  # the same layout label in both modes
    before = REGISTRY.get_sample_value("kvhit_enforce_fallbacks_total", fallbacks) or 0
    harness, _ = _serve(monkeypatch, layout, arguments)
    model = engine._models[harness.manager.coordinator]
    assert model is not None and model.speculation.describe() == read_as, (case, model)
    assert (REGISTRY.get_sample_value("kvhit_enforce_fallbacks_total", fallbacks) or 0) == before, case


def test_a_layout_kvhit_cannot_read_is_left_to_vllm_and_counted(monkeypatch):
    """A value the spec cannot take (a lookahead that is no integer) makes the coordinator unmodelled: the
    constructor returns, vLLM's lookup answers, one line is logged and the layout is counted."""
    assert kvhit_vllm.install("enforce")
    before = REGISTRY.get_sample_value("kvhit_unmodelled_layouts_total") or 0
    original = engine.model_coordinator

    def odd_pool(coordinator, release):
        coordinator.block_pool.num_hash_lookahead_tokens = 1.0  # no integer: what kvhit cannot read
        try:
            return original(coordinator, release)
        finally:
            coordinator.block_pool.num_hash_lookahead_tokens = 1

    monkeypatch.setattr(engine, "model_coordinator", odd_pool)
    harness = VllmHarness(harness_layout("full16"), "lookahead", max_model_len=4096)
    assert engine._models[harness.manager.coordinator] is None
    assert REGISTRY.get_sample_value("kvhit_unmodelled_layouts_total") == before + 1
    assert harness.serve(PROMPT)["hit"] == 0 and harness.probe(PROMPT)["hit"] == 3984  # vLLM's, L = 1


def test_a_reading_that_fails_unexpectedly_is_reported_as_kvhits_bug(monkeypatch):
    """Not an :class:`Unmodelled` but any exception while reading the layout: still left to vLLM."""
    assert kvhit_vllm.install("enforce")
    before = REGISTRY.get_sample_value("kvhit_unmodelled_layouts_total") or 0

    def broken(coordinator, release):
        raise KeyError("a field kvhit expected")

    monkeypatch.setattr(engine, "model_coordinator", broken)
    harness = VllmHarness(harness_layout("full16"), "drop", max_model_len=4096)
    assert engine._models[harness.manager.coordinator] is None
    assert REGISTRY.get_sample_value("kvhit_unmodelled_layouts_total") == before + 1
    assert harness.serve(PROMPT)["hit"] == 0 and harness.probe(PROMPT)["hit"] == 3968  # vLLM: floor_16(N - 1) - 16
