"""The counters `kvhit status` reads (vllm:kvhit_*): lookups per mode, and how far the reference hit was
from vLLM 0.33's; in enforce (with KVHIT_COUNT_GAINS), against what stock would have answered on the same
cache."""

from __future__ import annotations

from prometheus_client import REGISTRY

import kvhit.adapters.vllm as kvhit_vllm
from kvhit.adapters.vllm import engine
from tests.adapter.layouts import harness_layout
from tests.conformance.vllm_harness import VllmHarness


def _counts(label: str, mode: str) -> tuple[float, float, float]:
    """(lookups, divergences, divergence tokens) with the reference longer, for one layout and mode."""
    longer = {"layout": label, "mode": mode, "direction": "reference_longer"}
    return tuple(REGISTRY.get_sample_value(name, labels) or 0.0 for name, labels in (
        ("vllm:kvhit_lookups_total", {"layout": label, "mode": mode}),
        ("vllm:kvhit_hit_divergences_total", longer),
        ("vllm:kvhit_hit_divergence_tokens_total", longer)))


def _lookups(mode: str, n: int, repeats: int) -> tuple[list[int], tuple[float, ...]]:
    """full16, drop: serve one ``n``-token prompt on an empty cache, then look it up ``repeats`` times; the
    hits of the lookups and how much each counter of the mode grew over them."""
    assert kvhit_vllm.install(mode)
    harness = VllmHarness(harness_layout("full16"), "drop", max_model_len=2048)
    label = engine._models[harness.manager.coordinator].label
    before = _counts(label, mode)
    tokens = list(range(1, n + 1))
    harness.serve(tokens)
    hits = [harness.probe(tokens)["hit"] for _ in range(repeats)]
    return hits, tuple(b - a for a, b in zip(before, _counts(label, mode)))


def test_enforce_counts_the_tokens_it_gains_over_stock(monkeypatch):
    """full16, drop, N = 1024: stock answers 992 (F2), enforce 1008: 16 tokens gained per repeat (the first
    request, on an empty cache, is a lookup that gains nothing)."""
    monkeypatch.setattr(engine, "COUNT_GAINS", True)
    assert _lookups("enforce", 1024, 3) == ([1008] * 3, (4, 3, 48))


def test_enforce_counts_only_its_lookups_unless_asked_to_count_gains(monkeypatch):
    monkeypatch.setattr(engine, "COUNT_GAINS", False)
    assert _lookups("enforce", 1024, 3) == ([1008] * 3, (4, 0, 0))


def test_shadow_counts_by_mode_what_enforce_would_gain():
    assert _lookups("shadow", 1024, 2) == ([992] * 2, (3, 2, 32))


def test_lookups_where_the_policies_agree_count_no_divergence(monkeypatch):
    """N = 1000: 62 hashes cover 992 tokens, so with the drop unit held past it both policies hit 976."""
    monkeypatch.setattr(engine, "COUNT_GAINS", True)
    assert _lookups("enforce", 1000, 2) == ([976] * 2, (3, 0, 0))
