"""Installing kvhit into vLLM: opt-in, idempotent, reversible, version-guarded, reachable through vLLM's
own plugin loading; with KVHIT_MODE=off vLLM is exactly stock."""

from __future__ import annotations

import logging
import random

import pytest
import vllm
import vllm.plugins

import kvhit.adapters.vllm as kvhit_vllm
from kvhit.adapters.vllm import v0_33
from tests.adapter.layouts import harness_layout
from tests.conformance.vllm_harness import VllmHarness


def _seams_are_vllms():
    return all(vars(owner)[name] is original for owner, name, original, _ in v0_33.SEAMS)


def _seams_are_kvhits():
    return all(vars(owner)[name] is replacement for owner, name, _, replacement in v0_33.SEAMS)


def test_seams_are_the_narrow_lookup_points_of_vllm_0_33():
    import vllm.v1.core.kv_cache_coordinator as coordinator
    import vllm.v1.core.kv_cache_manager as manager

    import vllm.v1.core.sched.scheduler as scheduler
    import vllm.v1.core.single_type_kv_cache_manager as single_type

    assert {(getattr(owner, "__name__"), name) for owner, name, _, _ in v0_33.SEAMS} == {
        (manager.__name__, "get_kv_cache_coordinator"),
        ("Scheduler", "__init__"),  # whether the scheduler's config leaves its layout stock
        ("UnitaryKVCacheCoordinator", "find_longest_cache_hit"),
        ("HybridKVCacheCoordinator", "find_longest_cache_hit"),
        ("HybridKVCacheCoordinator", "find_longest_cache_hit_per_group"),
        # the write side
        ("KVCacheCoordinator", "cache_blocks"),
        (coordinator.__name__, "replay_boundaries"),
        (single_type.__name__, "get_mamba_prefill_checkpoint_position"),
        ("Scheduler", "_mamba_block_aligned_split"),
        # the eviction order
        ("BlockPool", "get_new_blocks"),
        ("BlockPool", "touch"),
        ("KVCacheCoordinator", "allocate_new_computed_blocks"),
    }
    # vLLM calls these module functions by the names patched here
    assert coordinator.KVCacheCoordinator.cache_blocks.__globals__ is vars(coordinator)
    assert single_type.MambaManager._cache_partial_tail_block.__globals__ is vars(single_type)
    assert scheduler.Scheduler._mamba_block_aligned_split.__globals__ is vars(scheduler)
    assert manager.get_kv_cache_coordinator is coordinator.get_kv_cache_coordinator


def test_uninstall_restores_every_original_object():
    assert _seams_are_vllms()
    for mode in ("enforce", "shadow"):
        assert kvhit_vllm.install(mode)
        assert _seams_are_kvhits() and kvhit_vllm.current_mode() == mode
        kvhit_vllm.uninstall()
        assert _seams_are_vllms() and kvhit_vllm.current_mode() == "off"


def test_install_is_idempotent_and_logs_what_it_replaced_once(kvhit_log):
    for _ in range(3):
        assert kvhit_vllm.install("enforce")
    lines = [r.getMessage() for r in kvhit_log.records if "replaced" in r.getMessage()]
    assert len(lines) == 1
    for owner, name, _, _ in v0_33.SEAMS:
        assert name in lines[0]
    assert "mode enforce on vLLM 0.33.0" in lines[0]
    assert kvhit_vllm.install("shadow") and kvhit_vllm.current_mode() == "shadow" and _seams_are_kvhits()


def test_context_manager_restores_the_previous_mode():
    with kvhit_vllm.enabled("enforce") as active:
        assert active and kvhit_vllm.current_mode() == "enforce"
    assert kvhit_vllm.current_mode() == "off" and _seams_are_vllms()
    kvhit_vllm.install("shadow")
    with kvhit_vllm.enabled("enforce"):
        assert kvhit_vllm.current_mode() == "enforce"
    assert kvhit_vllm.current_mode() == "shadow"


def test_another_vllm_version_is_refused_with_one_log_line_and_left_untouched(monkeypatch, kvhit_log):
    monkeypatch.setattr(vllm, "__version__", "0.34.0")
    assert not kvhit_vllm.install("enforce")
    assert not kvhit_vllm.install("enforce")
    assert _seams_are_vllms() and kvhit_vllm.current_mode() == "off"
    lines = [r for r in kvhit_log.records if "0.34.0" in r.getMessage()]
    assert len(lines) == 1 and lines[0].levelno == logging.ERROR
    assert "0.33.0" in lines[0].getMessage() and "untouched" in lines[0].getMessage()


def test_install_refuses_an_unknown_mode_from_python():
    with pytest.raises(ValueError, match="off, shadow, enforce"):
        kvhit_vllm.install("on")


@pytest.mark.parametrize("value, mode", [(None, "off"), ("", "off"), ("off", "off"), (" Enforce ", "enforce"),
                                         ("shadow", "shadow")])
def test_register_installs_the_mode_kvhit_mode_names(monkeypatch, value, mode):
    if value is None:
        monkeypatch.delenv("KVHIT_MODE", raising=False)
    else:
        monkeypatch.setenv("KVHIT_MODE", value)
    kvhit_vllm.register()
    kvhit_vllm.register()
    assert kvhit_vllm.current_mode() == mode
    assert _seams_are_vllms() if mode == "off" else _seams_are_kvhits()


def test_invalid_kvhit_mode_logs_one_error_and_stays_off(monkeypatch, kvhit_log):
    monkeypatch.setenv("KVHIT_MODE", "enforced")
    kvhit_vllm.register()
    kvhit_vllm.register()
    assert kvhit_vllm.current_mode() == "off" and _seams_are_vllms()
    errors = [r for r in kvhit_log.records if r.levelno == logging.ERROR]
    assert len(errors) == 1 and "'enforced'" in errors[0].getMessage()


def test_vllms_plugin_loader_installs_kvhit(monkeypatch):
    """``vllm.plugins.load_general_plugins()`` (what EngineCore and every worker call first) finds kvhit's
    entry point and installs the mode KVHIT_MODE asks for."""
    monkeypatch.setenv("KVHIT_MODE", "enforce")
    monkeypatch.setenv("VLLM_PLUGINS", "kvhit")
    monkeypatch.setattr(vllm.plugins, "plugins_loaded", False)
    vllm.plugins.load_general_plugins()
    assert kvhit_vllm.current_mode() == "enforce" and _seams_are_kvhits()


def _stream(layout, mode, retention=0):
    """Hits, shared-prefix boundaries and block ids of a request stream with eviction."""
    harness = VllmHarness(layout, mode, retention_interval=retention, max_model_len=16384)
    rng = random.Random(f"{layout['name']}/{mode}")
    base = [rng.randrange(1, 50000) for _ in range(4000)]
    prompts = [base, base[:2500] + [rng.randrange(1, 50000) for _ in range(1700)], base + [7] * 3300]
    seen = []
    for step in range(6):
        harness.serve(prompts[step % 3])
        if step == 3:
            harness.evict(5)
        for tokens in prompts:
            blocks, hit, spb = harness.manager.get_computed_blocks(harness._new_request(tokens))
            seen.append((hit, spb, [[b.block_id for b in group] for group in blocks.blocks]))
    return seen


@pytest.mark.parametrize("name, mode", [("full16", "drop"), ("qwen3next", "drop"), ("gemma", "lookahead")])
def test_kvhit_mode_off_is_exactly_stock(monkeypatch, name, mode):
    """The same stream gives the same hits, boundaries and blocks with kvhit never installed, with
    KVHIT_MODE=off through vLLM's plugin loader, and after enforce was installed and uninstalled. The
    layouts are ones where enforce answers differently (full16 drop) or identically."""
    layout = harness_layout(name)
    stock = _stream(layout, mode)
    monkeypatch.setenv("KVHIT_MODE", "off")
    monkeypatch.setenv("VLLM_PLUGINS", "kvhit")
    monkeypatch.setattr(vllm.plugins, "plugins_loaded", False)
    vllm.plugins.load_general_plugins()
    assert _seams_are_vllms()
    assert _stream(layout, mode) == stock
    kvhit_vllm.install("enforce")
    enforced = _stream(layout, mode)
    kvhit_vllm.uninstall()
    assert _stream(layout, mode) == stock
    if name == "full16":
        assert enforced != stock  # the stream can tell enforce from stock
