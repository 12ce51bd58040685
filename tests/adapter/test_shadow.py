"""KVHIT_MODE=shadow: vLLM's hits are unchanged, and every divergence from the reference is counted (a
prometheus_client counter) and logged at a bounded rate."""

from __future__ import annotations

import logging

from prometheus_client import REGISTRY

import kvhit.adapters.vllm as kvhit_vllm
from kvhit.adapters.vllm import engine, v0_33
from tests.adapter.layouts import harness_layout
from tests.conformance.vllm_harness import VllmHarness


def _sample(name, labels):
    return REGISTRY.get_sample_value(name, labels) or 0.0


def test_shadow_keeps_vllms_hit_and_counts_the_divergence(kvhit_log):
    """full16, drop, N = 1024: vLLM answers 992, the reference 1008 (F2); shadow returns vLLM's 992 and
    its blocks, counts one divergence of 16 tokens per lookup, and logs the first one."""
    assert kvhit_vllm.install("shadow")
    harness = VllmHarness(harness_layout("full16"), "drop", max_model_len=2048)
    tokens = list(range(1, 1025))
    harness.serve(tokens)
    label = engine._models[harness.manager.coordinator].label
    labels = {"layout": label, "direction": "reference_longer"}
    before = _sample("kvhit_hit_divergences_total", labels)
    before_tokens = _sample("kvhit_hit_divergence_tokens_total", labels)

    request = harness._new_request(tokens)
    blocks, hit, spb = harness.manager.get_computed_blocks(request)
    stock = v0_33.ORIGINAL.unitary_find(harness.manager.coordinator, request.block_hashes, 1023)
    assert (hit, spb) == (992, 0)
    assert [[b.block_id for b in g] for g in blocks.blocks] == [[b.block_id for b in g] for g in stock[0]]
    assert _sample("kvhit_hit_divergences_total", labels) == before + 1
    assert _sample("kvhit_hit_divergence_tokens_total", labels) == before_tokens + 16

    for _ in range(3):  # within the log interval: counted, not logged
        assert harness.probe(tokens)["hit"] == 992
    assert _sample("kvhit_hit_divergences_total", labels) == before + 4
    lines = [r.getMessage() for r in kvhit_log.records if "hit differs" in r.getMessage()]
    assert lines == [f"kvhit shadow: hit differs on layout {label}: N=1024 vLLM=992 reference=1008"]
    assert all(r.levelno == logging.WARNING for r in kvhit_log.records if "hit differs" in r.getMessage())


def test_shadow_counts_nothing_when_vllm_already_gives_the_reference_hit():
    assert kvhit_vllm.install("shadow")
    harness = VllmHarness(harness_layout("qwen3next"), "lookahead", max_model_len=16384)
    tokens = list(range(1, 11911))
    harness.serve(tokens)
    label = engine._models[harness.manager.coordinator].label
    counted = [_sample("kvhit_hit_divergences_total", {"layout": label, "direction": d})
               for d in ("reference_longer", "reference_shorter")]
    assert harness.probe(tokens)["hit"] == 11200
    assert [_sample("kvhit_hit_divergences_total", {"layout": label, "direction": d})
            for d in ("reference_longer", "reference_shorter")] == counted
