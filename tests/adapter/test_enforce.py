"""KVHIT_MODE=enforce on vLLM 0.33.0's real KV cache manager: the hit is the reference policy's.

Each expected hit is ``kvhit.refimpl``'s reference policy on the catalogue layout and on the cache as the
conformance harness reads it out of vLLM's block pool (``tests/adapter/layouts.py``); the adapter's own
layout mapping and cache oracle play no part in it.
"""

from __future__ import annotations

import random

import pytest

import kvhit.adapters.vllm as kvhit_vllm
import kvhit.refimpl as R
from kvhit.adapters.vllm import engine, v0_33
from tests.adapter.layouts import (
    expected_reference_lookup,
    harness_layout,
    refimpl_layout,
    speculation,
    unsound_blocks,
)
from tests.conformance.vllm_harness import VllmHarness

# (catalogue layout, DCP sizes, prompt length)
LAYOUTS = [
    ("full16", (1, 2, 4, 8), 1000),
    ("llama_eagle", (1, 2, 4, 8), 1000),
    ("gemma", (1,), 1024),
    ("qwen3next", (1, 2, 4, 8), 11910),
    ("dsv4_cuda", (1,), 3000),
    ("dsv4_report", (1,), 46240),
    ("chunked64", (1,), 1000),  # no drop mode: vLLM asserts it away in chunked local attention
    ("llama4", (1,), 1000),  # no EAGLE-family mode: vLLM builds full attention only then
]
# Mamba read at hash granularity is enforced too, through the real scheduler (tests/adapter/test_fine_mamba.py).
MODES = ("none", "lookahead", "drop")


def _cases():
    for name, dcps, n in LAYOUTS:
        for dcp in dcps:
            for mode in MODES:
                try:
                    R.derive_sizes(refimpl_layout(name, dcp), speculation(mode))
                except ValueError:
                    continue  # a setting the spec refuses on this layout, as vLLM does
                for retention in (0, None):
                    yield pytest.param(name, dcp, n, mode, 1, retention,
                                       id=f"{name}-dcp{dcp}-{mode}-ri{retention}")
    for mode in ("lookahead", "drop"):  # Qwen3-Next-like with multi-module MTP, 2 speculative tokens
        for retention in (0, None):
            yield pytest.param("qwen3next", 1, 11910, mode, 2, retention,
                               id=f"qwen3next-dcp1-{mode}-mtp2-ri{retention}")


def _harness(name, dcp, n, mode, k=1, retention=0):
    """A harness whose model length fits the stream's longest prompt, ``n + 1.5 S`` plus decode steps."""
    S = R.derive_sizes(refimpl_layout(name, dcp), speculation("none")).scheduler_block
    return VllmHarness(harness_layout(name, dcp), mode, num_speculative_tokens=k, multi_module_mtp=k > 1,
                       retention_interval=retention, max_model_len=n + 2 * S + 64)


def _stock(coordinator, block_hashes, max_length):
    """vLLM's own answer on the same coordinator and pool."""
    if isinstance(coordinator, engine.HybridKVCacheCoordinator):
        return v0_33.ORIGINAL.hybrid_find(coordinator, block_hashes, max_length)
    return v0_33.ORIGINAL.unitary_find(coordinator, block_hashes, max_length)


def _ids(blocks):
    return [[b.block_id for b in group] for group in blocks]


def _check_probe(harness, layout, spec, tokens, what):
    """Look ``tokens`` up through ``KVCacheManager.get_computed_blocks`` and check it against the
    reference, and each group's blocks but full attention's against vLLM's own finder at the hit; returns
    ``(hit, spb)``."""
    request = harness._new_request(tokens)
    blocks, hit, spb = harness.manager.get_computed_blocks(request)
    expected, junction = expected_reference_lookup(harness, layout, spec, tokens)
    stock = _stock(harness.manager.coordinator, request.block_hashes, len(tokens) - 1)
    context = (f"{layout.name} dcp{layout.dcp} {spec.describe()} {what}: N={len(tokens)} enforce={hit} "
               f"reference={expected} vLLM={stock[1]}; cache={harness.retained(tokens)}")
    assert hit == expected, context
    assert not unsound_blocks(harness, tokens, blocks.blocks, hit), context
    if stock[1] == hit:
        # Same hit: exactly vLLM's blocks.
        assert _ids(blocks.blocks) == _ids(stock[0]), context
    for plan in engine._models[harness.manager.coordinator].plans:
        if not plan.full:  # also a Mamba group's blocks built from the reference's question (_mamba_blocks)
            found_blocks, found = plan.find(request.block_hashes, hit, plan.unit)
            assert found == hit, context
            assert _ids(blocks.blocks[gid] for gid in plan.group_ids) == _ids(found_blocks), context
    assert spb == junction, context  # the reference's shared prefix past the hit, for either write side
    return hit, spb


def _fallbacks(layout_label):
    return engine.ENFORCE_FALLBACKS.labels(layout_label)._value.get()


@pytest.mark.parametrize("name, dcp, n, mode, k, retention", list(_cases()))
def test_enforce_hit_is_the_reference_hit_on_request_streams(name, dcp, n, mode, k, retention):
    """Serve, probe, evict and serve again: every lookup gives the reference hit on the pool's cache,
    with blocks that carry the request's hashes (vLLM's own blocks whenever the hits agree)."""
    assert kvhit_vllm.install("enforce")
    harness = _harness(name, dcp, n, mode, k, retention)
    model = engine._models[harness.manager.coordinator]
    assert model is not None, "catalogue layouts are modelled"
    fallbacks = _fallbacks(model.label)  # the counter is the process's: other tests may have counted before
    layout, spec = refimpl_layout(name, dcp), speculation(mode, k, k > 1)
    rng = random.Random(f"{name}/{dcp}/{mode}/{k}/{retention}")
    S = harness.sizes["S"]

    def fresh(m):
        return [rng.randrange(1, 50000) for _ in range(m)]

    base = fresh(n)
    sibling = base[: 2 * n // 3] + fresh(n - 2 * n // 3)
    extension = base + fresh(S + S // 2)
    prefix = base[: n // 2 + 7]

    harness.serve(base)
    for what, tokens in (("repeat", base), ("prefix", prefix), ("extension", extension)):
        _check_probe(harness, layout, spec, tokens, what)
    harness.serve(sibling)
    for what, tokens in (("repeat", base), ("sibling", sibling)):
        _check_probe(harness, layout, spec, tokens, what)
    harness.evict(rng.randrange(1, 40))
    for what, tokens in (("after eviction", base), ("sibling after eviction", sibling),
                         ("extension after eviction", extension)):
        _check_probe(harness, layout, spec, tokens, what)
    harness.serve(base)
    harness.serve(extension)
    for what, tokens in (("second repeat", base), ("extension repeat", extension)):
        _check_probe(harness, layout, spec, tokens, what)
    assert _fallbacks(model.label) == fallbacks


def test_enforce_keeps_the_eagle_block_the_unitary_coordinator_drops():
    """F2: full attention, block 16, drop mode, N = 1024: vLLM 0.33 returns 992 where 1008 is safe."""
    assert kvhit_vllm.install("enforce")
    harness = _harness("full16", 1, 1024, "drop")
    tokens = list(range(1, 1025))
    harness.serve(tokens)
    request = harness._new_request(tokens)
    assert _stock(harness.manager.coordinator, request.block_hashes, 1023)[1] == 992
    hit, _ = _check_probe(harness, refimpl_layout("full16"), speculation("drop"), tokens, "repeat")
    assert hit == 1008


@pytest.mark.parametrize("dcp", [1, 4])
def test_enforce_asks_the_pool_about_the_mamba_state_at_the_hit_once(dcp):
    """Qwen3-Next-like, drop: the reference asks the pool whether the Mamba state at the hit is cached, and
    the Mamba group's blocks are built from that answer (``engine._mamba_blocks``): a lookup asks the pool
    about the Mamba group once, as stock vLLM's does, and the blocks are vLLM's finder's (``_check_probe``)."""
    assert kvhit_vllm.install("enforce")
    n = 11910
    harness = _harness("qwen3next", dcp, n, "drop")
    tokens = [random.Random(n).randrange(1, 50000) for _ in range(n)]
    harness.serve(tokens)
    model = engine._models[harness.manager.coordinator]
    mamba = next(plan for plan in model.plans if not plan.full)
    assert mamba.asked_as is not None
    pool = harness.manager.coordinator.block_pool
    original = pool.get_cached_block

    def mamba_questions(mode):
        asked = []

        def get_cached_block(block_hash, group_ids):
            asked.append(list(group_ids))
            return original(block_hash, group_ids)

        kvhit_vllm.install(mode)
        pool.get_cached_block = model.cache.get_cached_block = get_cached_block
        try:
            hit = harness.manager.get_computed_blocks(harness._new_request(tokens))[1]
        finally:
            del pool.get_cached_block
            model.cache.get_cached_block = original
        return hit, asked.count(mamba.group_ids)

    assert mamba_questions("off") == (9600, 1)
    assert mamba_questions("enforce") == (9600, 1)
    _check_probe(harness, refimpl_layout("qwen3next", dcp), speculation("drop"), tokens, "repeat")


def _dsv4_report_tokens():
    return [random.Random(46240).randrange(1, 50000) for _ in range(46240)]


@pytest.mark.parametrize("mode", ["drop", "lookahead"])
def test_deepseek_v4_report_first_repeat_hits_32768_with_dense_retention(mode):
    """The report's layout (alignment 16384), N = 46240: the first repeat gets 32768 (historical: 16384)
    when the sliding-window groups retain every aligned boundary."""
    assert kvhit_vllm.install("enforce")
    harness = _harness("dsv4_report", 1, 46240, mode, retention=None)
    tokens = _dsv4_report_tokens()
    harness.serve(tokens)
    hit, _ = _check_probe(harness, refimpl_layout("dsv4_report"), speculation(mode), tokens, "repeat")
    assert hit == 32768


def test_stock_deepseek_v4_report_first_repeat_is_16384_at_default_retention():
    """The baseline of the report on vLLM 0.33.0 itself: with the default retention (0) the sliding-window
    groups keep their state only at the drop-mode replay boundary 16384, so the first repeat gets 16384."""
    harness = _harness("dsv4_report", 1, 46240, "drop", retention=0)
    tokens = _dsv4_report_tokens()
    harness.serve(tokens)
    assert harness.probe(tokens) == {"hit": 16384, "spb": 32768}


@pytest.mark.parametrize("mode", ["drop", "lookahead"])
def test_deepseek_v4_report_first_repeat_hits_32768_at_default_retention(mode):
    assert kvhit_vllm.install("enforce")
    harness = _harness("dsv4_report", 1, 46240, mode, retention=0)
    tokens = _dsv4_report_tokens()
    harness.serve(tokens)
    hit, _ = _check_probe(harness, refimpl_layout("dsv4_report"), speculation(mode), tokens, "repeat")
    assert hit == 32768


def test_enforce_first_repeat_hits_the_steady_state_without_a_junction():
    """DeepSeek-V4 (CUDA layout), drop mode, retention 0: vLLM's replay boundaries leave the sliding-window
    groups short of the steady state on the first repeat (it then needs the junction to recover); with the
    reference write side the first repeat already gets the steady-state hit (the reference on a cache
    holding the whole prompt) and records no junction."""
    layout, spec, n = refimpl_layout("dsv4_cuda"), speculation("drop"), 3000
    tokens = [random.Random(3000).randrange(1, 50000) for _ in range(n)]
    steady = R.hit(layout, spec, n, [n] * len(R.derive_sizes(layout, spec).groups), "reference")
    stock = _harness("dsv4_cuda", 1, n, "drop", retention=0)
    stock.serve(tokens)
    assert stock.probe(tokens)["hit"] < steady
    assert kvhit_vllm.install("enforce")
    harness = _harness("dsv4_cuda", 1, n, "drop", retention=0)
    harness.serve(tokens)
    first, spb = _check_probe(harness, layout, spec, tokens, "first repeat")
    assert first == steady and spb == 0
    harness.serve(tokens)
    second, _ = _check_probe(harness, layout, spec, tokens, "second repeat")
    assert second == steady


@pytest.mark.parametrize("mode, retention", [("drop", 0), ("drop", None), ("lookahead", 0), ("none", 0)])
def test_enforce_per_group_lookup_gives_each_groups_own_reference_hit(mode, retention):
    """``find_longest_cache_hit_per_group`` (KV connectors' lookup): each spec group's hit is the longest
    multiple of A, at most min(N - 1, |H| h), that the group serves on its own."""
    assert kvhit_vllm.install("enforce")
    n = 11910
    harness = _harness("qwen3next", 1, n, mode, retention=retention)
    layout, spec = refimpl_layout("qwen3next"), speculation(mode)
    rng = random.Random(11910)
    tokens = [rng.randrange(1, 50000) for _ in range(n)]
    harness.serve(tokens[:8000] + [rng.randrange(1, 50000) for _ in range(n - 8000)])
    harness.serve(tokens)
    harness.evict(3)
    request = harness._new_request(tokens)
    blocks, hits = harness.manager.coordinator.find_longest_cache_hit_per_group(request.block_hashes, n - 1)

    sizes = R.derive_sizes(layout, spec)
    retained = harness.retained(tokens)
    cache = R.as_cache([set.intersection(*(set(retained[m]) for m in sg.members)) for sg in sizes.groups])
    reach = len(request.block_hashes) * sizes.hash_block
    bound, extents = min(n - 1, reach), R.group_extents(cache, sizes, reach)
    for k, sg in enumerate(sizes.groups):
        expected = max((x for x in range(0, bound + 1, sizes.alignment)
                        if x == 0 or R.group_serves(cache, sizes, k, x, extents[k], reach, R.REFERENCE)))
        for gid in sg.members:
            assert hits[gid] == expected, (mode, retention, k, hits, retained)
    for gid, hit in enumerate(hits):
        group_only = [list(blocks[g]) if g == gid else [] for g in range(len(blocks))]
        problems = [p for p in unsound_blocks(harness, tokens, tuple(group_only), hit)
                    if p.startswith(f"group {gid}:")]
        assert not problems, problems


def test_coordinator_built_outside_kv_cache_manager_stays_stock(kvhit_log):
    """A KV connector's own coordinator (e.g. SimpleCPUOffload's CPU coordinator, built by calling
    ``get_kv_cache_coordinator`` directly) keeps vLLM's policy, and that is reported once."""
    from vllm.v1.core.kv_cache_coordinator import get_kv_cache_coordinator

    assert kvhit_vllm.install("enforce")
    harness = _harness("full16", 1, 1024, "drop")
    tokens = list(range(1, 1025))
    harness.serve(tokens)
    manager = harness.manager
    copy = get_kv_cache_coordinator(
        kv_cache_config=harness.kv_cache_config, max_model_len=manager.max_model_len,
        max_in_flight_tokens=8192, use_eagle=True, enable_caching=True, enable_kv_cache_events=False,
        dcp_world_size=1, pcp_world_size=1, scheduler_block_size=16, hash_block_size=16,
        num_prefill_lookahead=1)
    copy.block_pool = manager.block_pool  # the connector looks up the same cached blocks
    for m in copy.single_type_managers:
        m.block_pool = manager.block_pool
    request = harness._new_request(tokens)
    assert copy.find_longest_cache_hit(request.block_hashes, 1023)[1] == 992
    assert manager.coordinator.find_longest_cache_hit(request.block_hashes, 1023)[1] == 1008
    copy.find_longest_cache_hit(request.block_hashes, 1023)
    notes = [r.getMessage() for r in kvhit_log.records if "not built by KVCacheManager" in r.getMessage()]
    assert len(notes) == 1


def test_layout_outside_the_spec_is_left_stock_and_reported_once(kvhit_log):
    """A hidden-state cache group (``HiddenStateCacheSpec``, looked up like full attention) is not a kind
    the spec models: vLLM keeps its lookup (992 in drop mode, where the reference would say 1008)."""
    import torch
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.kv_cache_interface import HiddenStateCacheSpec, KVCacheConfig, KVCacheGroupSpec

    assert kvhit_vllm.install("enforce")
    init_none_hash(sha256)
    spec = HiddenStateCacheSpec(block_size=16, num_kv_heads=1, head_size=8, dtype=torch.float16)
    config = KVCacheConfig(num_blocks=300, kv_cache_tensors=[],
                           kv_cache_groups=[KVCacheGroupSpec(["l0"], spec)],
                           prefix_cache_retention_interval=0)
    manager = KVCacheManager(kv_cache_config=config, max_model_len=2048, scheduler_block_size=16,
                             hash_block_size=16, enable_caching=True, use_eagle=True,
                             num_prefill_lookahead=1)
    assert engine._models[manager.coordinator] is None
    warnings = [r.getMessage() for r in kvhit_log.records if "not modelled" in r.getMessage()]
    assert len(warnings) == 1 and "HiddenStateCacheSpec" in warnings[0]

    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    tokens = list(range(1, 1025))
    hasher = get_request_block_hasher(16, sha256, 0)
    request = Request("r0", tokens, SamplingParams(max_tokens=1), None, block_hasher=hasher)
    manager.allocate_slots(request, 1024)
    manager.free(request)
    again = Request("r1", tokens, SamplingParams(max_tokens=1), None, block_hasher=hasher)
    assert manager.get_computed_blocks(again)[1] == 992
