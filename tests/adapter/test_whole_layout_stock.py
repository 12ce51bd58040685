"""A layout kvhit cannot enforce whole is left wholly to vLLM: read side and write side, in every mode.

Enforce promises that the first repeat of a prompt hits what the second does, and never less than stock; the
reference read side on vLLM's write side promises neither. So where the spec does not model a layout's write
side (a Mamba group read at hash granularity that drops, in EAGLE drop mode with multi-module MTP; EAGLE drop
mode in which only Mamba groups drop; a retention interval its write side rejects), or
the scheduler's config adds what the spec does not model there (auxiliary outputs whose cap binds inside a
block with multi-module MTP in drop mode, where one Mamba tail per request cannot be both where a resend
resumes and where vLLM keeps its checkpoint, or caps at another kind's blocks than full attention's; a KV
connector kvhit has not checked or another one beside a group that is not full attention, in
``tests/adapter/test_connectors.py``), the coordinator is unmodelled: logged once, counted in
``kvhit_unmodelled_layouts_total``, and reported in the status file. Shadow does the same, so that its counters say what enforce does.

Through vLLM's real ``Scheduler`` (``tests/adapter/scheduler_run.py``, one process per mode) for a Nemotron-H
with auxiliary outputs, partial hits and two MTP modules in drop mode; then one test per reason on vLLM's
``KVCacheManager``. (The real
``Scheduler`` builds ``qwen3next_pmu160`` and ``three_kind`` with two MTP modules in drop mode with the MTP
layers in full attention: the Mamba group does not drop, and enforce owns those layouts,
``tests/adapter/test_fine_mamba.py``.)
"""

from __future__ import annotations

import dataclasses
import json
import random
import types

import pytest
from prometheus_client import REGISTRY

import kvhit.adapters.vllm as kvhit_vllm
import kvhit.refimpl as R
from kvhit.adapters.vllm import engine, v0_33
from tests.adapter import child_runs
from tests.adapter.layouts import harness_layout, refimpl_layout, speculation
from tests.conformance.vllm_harness import VllmHarness


HASH_GRANULAR = R.FINE_MAMBA_MTP_DROP
# scenario -> (what the unmodelled reason names, the catalogue layout it is)
SCENARIOS = {
    # Auxiliary outputs cap each lookup at the leading whole blocks of full attention, which a hit inside a
    # block passes (prefix_match_unit 160 on 1600-token blocks); with two MTP modules in drop mode a resend's
    # capped resume point lies inside a Mamba block, and one partial tail per request cannot be both there and
    # where vLLM keeps its checkpoint (refimpl.CAPPED_FINE_MAMBA_MTP_DROP). With one module, or without the
    # auxiliary outputs, the layout is enforced (tests/adapter/test_fine_mamba.py)
    "aux-pmu160-mtp2-drop": (R.CAPPED_FINE_MAMBA_MTP_DROP, "qwen3next_pmu160"),
}
MODES = ("stock", "shadow", "enforce")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """``{mode: result}`` of the scenarios above, each mode in a process of its own, started together."""
    return child_runs.scheduler_modes(tmp_path_factory.mktemp("whole_layout_stock"), SCENARIOS, MODES)


_hits = child_runs.served_hits


@pytest.mark.parametrize("scenario", list(SCENARIOS))
@pytest.mark.parametrize("mode", ["enforce", "shadow"])
def test_a_layout_kvhit_cannot_enforce_whole_is_served_exactly_as_stock(runs, scenario, mode):
    """Every ``SchedulerOutput`` (tokens, chunks, block ids) and ``EngineCoreOutput`` of the stream, so
    every request's hit (a resend, a second resend, a longer sibling, prompts sharing a prefix, the
    prompt again), is stock vLLM's."""
    stock, run = (child_runs.scheduled(runs[name], scenario) for name in ("stock", mode))
    assert _hits(runs[mode], scenario) == _hits(runs["stock"], scenario)
    assert json.dumps(run, sort_keys=True) == json.dumps(stock, sort_keys=True)


@pytest.mark.parametrize("scenario", list(SCENARIOS))
@pytest.mark.parametrize("mode", ["enforce", "shadow"])
def test_the_layout_is_reported_unmodelled_with_the_reason(runs, scenario, mode):
    """The status file says ``modelled: false`` with the reason, the layout is counted once, and kvhit
    computed no lookup (shadow compares none: enforce would change none)."""
    why, _ = SCENARIOS[scenario]
    status = runs[mode]["scenarios"][scenario]["kvhit_status"]
    assert (status["mode"], status["modelled"]) == (mode, False) and why in status["unmodelled"], status
    counters = runs[mode]["kvhit_counters"]
    assert counters == {"kvhit_unmodelled_layouts": len(SCENARIOS), "vllm:kvhit_lookups": 0,
                        "kvhit_enforce_fallbacks": 0}, counters


# --------------------------------------------------------------------------------------------------
# One test per reason, on vLLM's KVCacheManager
# --------------------------------------------------------------------------------------------------

def _unmodelled() -> float:
    return REGISTRY.get_sample_value("kvhit_unmodelled_layouts_total") or 0


def _stream(harness, n):
    """A prompt served, its resend, a longer sibling, a prompt sharing its first half, an eviction and the
    prompt again: every hit, chunk list and the cache left."""
    rng = random.Random(n)
    base = [rng.randrange(1, 50000) for _ in range(n)]
    longer = base + [rng.randrange(1, 50000) for _ in range(n // 10)]
    sibling = base[: n // 2] + [rng.randrange(1, 50000) for _ in range(n - n // 2)]
    out = []
    for tokens in (base, base, longer, sibling, sibling):
        served = harness.serve(tokens)
        out.append((served["hit"], served["chunks"]))
    harness.evict(7)
    out.append(harness.probe(base)["hit"])
    return out, harness.retained(base), harness.retained(sibling)


def _left_stock(monkeypatch, tmp_path, kvhit_log, make_harness, n, why):
    """Under enforce the harness's layout is unmodelled for ``why`` (logged once, counted once, in the
    status file) and serves the stream exactly as stock vLLM does."""
    stock = _stream(make_harness(), n)
    path = tmp_path / "status.json"
    monkeypatch.setenv(engine.STATUS_FILE_ENV, str(path))
    assert kvhit_vllm.install("enforce")
    before = _unmodelled()
    harness = make_harness()
    assert engine._models[harness.manager.coordinator] is None
    assert _unmodelled() == before + 1
    status = json.loads(path.read_text())
    assert status["modelled"] is False and why in status["unmodelled"], status
    lines = [r.getMessage() for r in kvhit_log.records if "not modelled by the spec" in r.getMessage()]
    assert len(lines) == 1 and why in lines[0], lines
    assert _stream(harness, n) == stock


def _catalogue_harness(name, mode, retention=0, n=11910):
    return lambda: VllmHarness(harness_layout(name), mode, retention_interval=retention, max_model_len=n + 4000)


@pytest.mark.parametrize("name", ["qwen3next_pmu160", "three_kind"])
def test_a_mamba_group_read_at_hash_granularity_with_mtp_drop_leaves_the_layout_stock(monkeypatch, tmp_path,
                                                                                     kvhit_log, name):
    """The catalogue's layouts flag no group EAGLE, so vLLM's coordinator flags every one and the Mamba group
    drops too: its caching calls then end ``Lp - 1`` tokens before the chunk, and no partial tail is kept at
    the resend's resume point (``scheduler_and_mask_boundaries_agree`` fails on concrete prompts)."""
    harness = lambda: VllmHarness(harness_layout(name), "drop", num_speculative_tokens=2, multi_module_mtp=True,
                                  retention_interval=0, max_model_len=11910 + 4000)
    _left_stock(monkeypatch, tmp_path, kvhit_log, harness, 11910, HASH_GRANULAR)


def _mtp_in_full_attention(name):
    """The catalogue layout ``name`` with its full-attention group flagged EAGLE, as vLLM's planner builds it
    for a model whose MTP layers are full attention (``tests/adapter/test_fine_mamba.py``)."""
    from dataclasses import replace

    from kvhit.spec.catalogue import CATALOGUE
    from kvhit.spec.domain import Kind

    layout = CATALOGUE[name]
    return replace(layout, groups=tuple(replace(g, eagle=g.kind is Kind.FULL) for g in layout.groups),
                   name=f"{name}_mtp_in_full")


@pytest.mark.parametrize("name, mode, k", [("qwen3next_pmu160", "drop", 1), ("qwen3next_pmu160", "lookahead", 2),
                                           ("three_kind", "drop", 1), ("three_kind", "none", 1),
                                           (_mtp_in_full_attention("qwen3next_pmu160"), "drop", 2),
                                           (_mtp_in_full_attention("three_kind"), "drop", 2)])
def test_a_mamba_group_read_at_hash_granularity_is_otherwise_enforced(name, mode, k):
    """The control: the reason is a Mamba group that drops, with multi-module MTP in drop mode; not the hash
    granularity, nor the MTP modules where only full attention drops."""
    assert kvhit_vllm.install("enforce")
    harness = VllmHarness(harness_layout(name), mode, num_speculative_tokens=k, multi_module_mtp=k > 1,
                          retention_interval=0, max_model_len=11910 + 4000)
    model = engine._models[harness.manager.coordinator]
    assert model is not None and model.write is not None


def _mamba16():
    from kvhit.spec.domain import Group, Kind, Layout

    return Layout((Group(Kind.MAMBA, 16),), name="mamba16")


def test_drop_mode_in_which_only_mamba_groups_drop_leaves_the_layout_stock(monkeypatch, tmp_path, kvhit_log):
    """One Mamba group in drop mode (vLLM flags it the EAGLE group when no group is flagged): the reference's
    Mamba lookups never drop, and ``kvhit prove --extended`` refutes ``reference_never_below_vllm`` there
    (e.g. R = 0, N = 144, a 114-token prefix of it, then a 112-token one: the reference hits 112 then 0,
    vLLM 0 then 96), so enforce leaves it to vLLM."""
    harness = lambda: VllmHarness(harness_layout(_mamba16()), "drop", retention_interval=0, max_model_len=600)
    _left_stock(monkeypatch, tmp_path, kvhit_log, harness, 144, R.ONLY_MAMBA_DROPS)


def test_chunked_local_attention_beside_a_sliding_window_leaves_the_layout_stock(monkeypatch, tmp_path, kvhit_log):
    """The spec models chunked local attention alone (``chunked64``) and beside full attention (``llama4``,
    both enforced); beside a sliding window (no model known to plan one) it is not modelled, read side
    included, so the layout is left to vLLM."""
    layout = {"name": "chunked_beside_swa", "dcp": 1, "prefix_match_unit": None,
              "groups": [{"kind": "swa", "block_size": 16, "dcp_sharded": True, "eagle": False, "window": 32},
                         {"kind": "chunked", "block_size": 16, "dcp_sharded": True, "eagle": False, "chunk": 64}]}
    harness = lambda: VllmHarness(layout, "none", retention_interval=0, max_model_len=3000)
    _left_stock(monkeypatch, tmp_path, kvhit_log, harness, 1000, "chunked local attention beside groups of kind swa")


@pytest.mark.parametrize("mode", ["none", "lookahead"])
def test_the_same_mamba_group_without_the_drop_is_enforced(mode):
    """The control: the reason is the drop, not the layout."""
    assert kvhit_vllm.install("enforce")
    harness = VllmHarness(harness_layout(_mamba16()), mode, retention_interval=0, max_model_len=600)
    model = engine._models[harness.manager.coordinator]
    assert model is not None and model.write is not None


def test_backend_internal_mamba_checkpoints_are_enforced():
    """``MambaSpec.num_prefill_checkpoint_blocks > 0`` (vLLM's ``MambaMixer2`` layers always declare one):
    no longer a reason to leave the layout to vLLM. The write side keeps the backend's checkpoint where it is
    the prompt's resume point and ends a chunk at every other state the reference keeps
    (``engine.backend_checkpoint``; what a request leaves: ``tests/adapter/test_enforce_write_side.py``, the
    ``-checkpoint`` cases)."""
    assert kvhit_vllm.install("enforce")
    harness = VllmHarness(harness_layout("qwen3next", prefill_checkpoint=True), "drop", retention_interval=0,
                          max_model_len=11910 + 4000)
    assert harness.manager.coordinator.single_type_managers[1].has_prefill_checkpoint_blocks
    model = engine._models[harness.manager.coordinator]
    assert model is not None and model.write is not None


def test_a_retention_interval_the_write_side_rejects_has_no_write_model():
    """vLLM 0.33 validates the interval as the spec does (a multiple of the scheduler block, other than 0
    only with a sliding-window or Mamba group), so no layout vLLM builds reaches this reason; an interval the
    spec rejects on a coordinator vLLM did not validate is refused all the same."""
    sizes = R.derive_sizes(refimpl_layout("qwen3next"), speculation("drop"))
    coordinator = types.SimpleNamespace(retention_interval=sizes.scheduler_block + 1,
                                        kv_cache_config=types.SimpleNamespace(kv_cache_groups=[]))
    write, why = engine._write_side(coordinator, sizes, "qwen3next")
    assert write is None and "rejects" in why and "retention interval" in why, why


def test_dense_retention_on_a_layout_without_sliding_window_or_mamba_is_modelled():
    """vLLM accepts ``prefix_cache_retention_interval=None`` on any layout (``KVCacheConfig``'s default) and
    only sliding-window and Mamba groups read it: on full attention alone the write side is the one of
    interval 0, and the layout stays enforced (the F2 block is kept)."""
    assert kvhit_vllm.install("enforce")
    harness = VllmHarness(harness_layout("full16"), "drop", retention_interval=None, max_model_len=4096)
    model = engine._models[harness.manager.coordinator]
    assert model is not None and model.write.retention == 0
    tokens = [random.Random(1).randrange(1, 50000) for _ in range(1024)]
    harness.serve(tokens)
    assert harness.probe(tokens)["hit"] == 1008  # stock vLLM: 992


def test_what_a_schedulers_config_says_leaves_the_layout_to_decide_but_unreadable_configs_and_032s_aux():
    """What ``Scheduler.__init__`` tells the coordinator it builds (the real schedulers are in the tests
    above, tests/adapter/test_connectors.py and tests/adapter/test_scheduler_plugin.py, "aux-*"): on vLLM
    0.33 a KV connector and auxiliary outputs are facts the layout decides on (:func:`engine.connector_reason`,
    :func:`engine.aux_cap_reason`), a connector named with the module it is loaded from when that is not
    vLLM's registry; vLLM 0.32's auxiliary outputs stay a reason (their replayed rows are not modelled), and a
    config that cannot be read is one."""
    from kvhit.adapters.vllm import v0_32

    aux_off, aux_on = (types.SimpleNamespace(enabled=enabled) for enabled in (False, True))
    plain = types.SimpleNamespace(kv_transfer_config=None, aux_output_config=aux_off)
    assert v0_33.scheduler_facts(plain) == engine.SchedulerFacts()
    connector = types.SimpleNamespace(kv_connector="ExampleConnector", kv_connector_module_path=None)
    assert v0_33.scheduler_facts(types.SimpleNamespace(kv_transfer_config=connector, aux_output_config=aux_off)
                                 ) == engine.SchedulerFacts(connector="ExampleConnector")
    elsewhere = types.SimpleNamespace(kv_connector="ExampleConnector", kv_connector_module_path="my.connectors")
    facts = v0_32.scheduler_facts(types.SimpleNamespace(kv_transfer_config=elsewhere, aux_output_config=aux_off))
    assert facts.connector == "ExampleConnector from my.connectors" and facts.stock_reason is None
    with_aux = types.SimpleNamespace(kv_transfer_config=None, aux_output_config=aux_on)
    assert v0_33.scheduler_facts(with_aux) == engine.SchedulerFacts(caps=True)
    assert "auxiliary outputs" in v0_32.scheduler_facts(with_aux).stock_reason

    class Unreadable:
        kv_transfer_config = None

        @property
        def aux_output_config(self):
            raise RuntimeError("no such field")

    assert "could not read" in v0_33.scheduler_facts(Unreadable()).stock_reason  # never less than stock


@pytest.mark.parametrize("name, connector, names", [
    ("llama_eagle", "ExampleConnector", None), ("full16", "SimpleCPUOffloadConnector", None),
    ("llama_eagle", "OffloadingConnector", "has not checked"),
    ("llama_eagle", "ExampleConnector from my.connectors", "has not checked"),
    ("gemma", "ExampleConnector", "a sliding window group"),
    ("qwen3next", "SimpleCPUOffloadConnector", "a Mamba group"),
    ("qwen3next", "DecodeBenchConnector", None), ("three_kind", "DecodeBenchConnector", None),
    ("three_kind", "SimpleCPUOffloadConnector", "Mamba and sliding window groups"),
    ("chunked64", "ExampleConnector", "a chunked local group"), ("qwen3next_pmu160", "ExampleConnector", "Mamba")])
def test_a_connector_leaves_the_layout_to_vllm_unless_checked_and_beside_full_attention_alone(name, connector,
                                                                                               names):
    """:func:`engine.connector_reason` on catalogue layouts: None (enforced) only for a checked connector on
    full attention read at its block, or DecodeBenchConnector (every request starts at ``N - 1``) beside
    anything; else the reason names what it lacks."""
    layout = refimpl_layout(name)
    spec = speculation("drop") if name != "chunked64" else speculation("none")
    model = types.SimpleNamespace(sizes=R.derive_sizes(layout, spec))
    reason = engine.connector_reason(model, connector)
    assert (reason is None) == (names is None), reason
    assert names is None or (names in reason and connector in reason), reason


def test_a_kv_cache_manager_outside_a_scheduler_keeps_its_layout_enforced():
    """Only a scheduler's config can leave a layout stock: vLLM's KVCacheManager built on its own (vLLM's
    unit tests, the conformance harness) knows no connector, and its layout is enforced as modelled; a
    lookup it caps below ``N - 1`` is answered by vLLM's own code for that lookup."""
    assert kvhit_vllm.install("enforce")
    harness = _catalogue_harness("qwen3next", "drop")()
    assert engine._models[harness.manager.coordinator] is not None
    tokens = [random.Random(0).randrange(1, 50000) for _ in range(11910)]
    harness.serve(tokens)
    request = harness._new_request(tokens)
    coordinator = harness.manager.coordinator
    capped = coordinator.find_longest_cache_hit(request.block_hashes, 5000)
    stock = v0_33.ORIGINAL.hybrid_find(coordinator, request.block_hashes, 5000)
    assert capped[1] == stock[1] and capped[2] == stock[2]


@pytest.mark.parametrize("name, mode, k", [("qwen3next", "drop", 2), ("llama_eagle", "drop", 1),
                                           ("gemma", "none", 0), ("full16", "lookahead", 1),
                                           ("qwen3next_pmu160", "drop", 1)])
def test_a_capped_lookup_of_a_capped_layout_is_the_references_maximum_within_the_cap(name, mode, k):
    """On a layout whose scheduler caps lookups (auxiliary outputs: ``CoordinatorModel.capped``), a lookup
    capped at ``M`` below ``N - 1`` answers the longest multiple of ``A`` at most ``min(M, |H| * h)`` that
    every group serves (``refimpl.reference_pass`` with that bound, on the pool the lookup reads), with
    vLLM's blocks for it, wherever that is the uncapped maximum (the same maximum over fewer lengths); where
    the cap binds below it, vLLM's own code answers and the fallback is counted. The two kinds of cap occur
    here: the reference is below every cap from the hit up, and above every cap below it."""
    assert kvhit_vllm.install("enforce")
    n = 11910 if name.startswith("qwen3next") else 1000
    harness = VllmHarness(harness_layout(name), mode, num_speculative_tokens=max(k, 1), multi_module_mtp=k > 1,
                          retention_interval=0, max_model_len=n + 4000)
    coordinator = harness.manager.coordinator
    model = engine._models[coordinator]
    engine._models[coordinator] = dataclasses.replace(model, capped=True)
    tokens = [random.Random(n).randrange(1, 50000) for _ in range(n)]
    harness.serve(tokens)
    harness.evict(3)
    request = harness._new_request(tokens)
    hashes = request.block_hashes
    sizes, covered = model.sizes, len(hashes) * model.sizes.hash_block
    original = (v0_33.ORIGINAL.unitary_find if sizes.unitary else v0_33.ORIGINAL.hybrid_find)
    kinds = set()
    for cap in range(0, n - 1, max(1, sizes.alignment // 3)):
        if R.num_hashes(sizes, cap + 1) == len(hashes):
            continue  # the cap of a shorter prompt with these hashes: N - 1 for it
        cache = engine.pool_cache(coordinator, hashes, model)
        bound = min(cap, covered)
        want = R.reference_pass(cache, sizes, bound, R.group_extents(cache, sizes, covered), covered, R.REFERENCE)
        uncapped = R.hit_tokens(engine.pool_cache(coordinator, hashes, model), sizes, n, R.REFERENCE)
        before = _fallbacks()
        _, hit, _ = coordinator.find_longest_cache_hit(hashes, cap)
        if uncapped[2] <= cap:  # the hit and the shared prefix within the cap
            kinds.add("within")
            assert hit == want == uncapped[0] and _fallbacks() == before, (cap, hit, want, uncapped)
        else:
            kinds.add("binds")
            assert _fallbacks() == before + 1 and hit == original(coordinator, hashes, cap)[1], cap
    assert kinds == {"within", "binds"}, kinds


def _fallbacks() -> float:
    return sum(s.value for m in REGISTRY.collect() if m.name == "kvhit_enforce_fallbacks"
               for s in m.samples if s.name.endswith("_total"))


def test_auxiliary_outputs_leave_the_layout_to_vllm_where_they_cap_at_another_kinds_blocks():
    """:func:`engine.aux_cap_reason`: None (modelled with the cap) where the capped group is full attention,
    read at its block or at hash granularity (where the cap binds inside a block: the write side keeps its
    Mamba tail where vLLM keeps its checkpoint); a reason where the coordinator has no full attention (group 0
    is Mamba)."""
    from kvhit.convert import to_refimpl

    def reason(layout, mode, gid):
        sizes = R.derive_sizes(layout, speculation(mode))
        spec_group_of = [0] * len(layout.groups)
        for k, sg in enumerate(sizes.groups):
            for m in sg.members:
                spec_group_of[m] = k
        model = types.SimpleNamespace(sizes=sizes, spec_group_of=tuple(spec_group_of))
        return engine.aux_cap_reason(types.SimpleNamespace(full_attention_group_id=gid), model)

    assert reason(refimpl_layout("qwen3next"), "drop", 0) is None
    assert reason(refimpl_layout("llama_eagle"), "drop", 0) is None
    assert reason(refimpl_layout("qwen3next_pmu160"), "drop", 0) is None
    mamba = reason(to_refimpl(_mamba16()), "none", None)
    assert mamba is not None and "mamba" in mamba and "KV-cache group 0" in mamba, mamba
