"""kvhit through vLLM's own plugin loading, into a real ``Scheduler`` built from a ``VllmConfig``.

``tests/adapter/scheduler_run.py`` runs in a fresh process per mode (the plugin patches process-wide state):
it calls ``vllm.plugins.load_general_plugins()`` as ``EngineCore`` does (``stock`` does not, and never imports
kvhit), builds ``ModelConfig`` / ``SpeculativeConfig`` / ``VllmConfig`` from local ``config.json`` files
(a Llama with an EAGLE-1 draft, also with a sliding-window layer, and with one KV head under decode context
parallelism 2, 4 and 8 with the draft's cache sharded or replicated; a Nemotron-H, Mamba-2 + attention, with two
MTP modules, also with one KV head under DCP 2, 4 and 8), lets vLLM's planner group the layers' KV-cache specs,
builds the ``Scheduler`` and feeds it synthetic model outputs. Each prompt is served, then repeated; every
request's ``num_cached_tokens`` is what ``EngineCoreOutput.prefill_stats`` reports (the API's
``cached_tokens``).

The expected values are ``kvhit.refimpl``'s, on the layout declared below (checked against the groups the
planner made) and on the hash boundaries the run's block pool held for the prompt when it was added.
"""

from __future__ import annotations

import dataclasses
import json
import re

import pytest

import kvhit.refimpl as R
from tests.adapter import child_runs, scheduler_run


# The layouts vLLM's planner makes for the scenarios' models. The draft's layers share the target's
# full-attention spec, so they join its group and flag it as the EAGLE group (``is_eagle_group``); with a
# sliding-window layer, or a replicated draft under DCP, the planner makes one group per layer instead.
EAGLE_LAYOUT = R.Layout((R.Group("full", 16, eagle=True),), name="Llama + EAGLE draft, block 16")
MTP_LAYOUT = R.Layout((R.Group("full", 1600, eagle=True), R.Group("mamba", 1600)),
                      name="Nemotron-H + MTP, full 1600 (MTP layers) + Mamba 1600")
SWA_LAYOUT = R.Layout((R.Group("full", 16), R.Group("full", 16, eagle=True), R.Group("swa", 16, window=64)),
                      name="full + sliding window 64 + EAGLE draft, block 16")
# scenario -> (layout, speculation, KV-cache groups as (spec class, block size, dcp_sharded, is_eagle_group,
# layers))
EXPECTED_SETUP = {
    "eagle-drop": (EAGLE_LAYOUT, R.Speculation("drop", 1), [("FullAttentionSpec", 16, True, True, 3)]),
    "eagle-lookahead": (EAGLE_LAYOUT, R.Speculation("lookahead", 1), [("FullAttentionSpec", 16, True, True, 3)]),
    "mtp2-drop": (MTP_LAYOUT, R.Speculation("drop", 2, True),
                  [("FullAttentionSpec", 1600, True, True, 3), ("MambaSpec", 1600, False, False, 3)]),
    "mtp2-lookahead": (MTP_LAYOUT, R.Speculation("lookahead", 2, True),
                       [("FullAttentionSpec", 1600, True, True, 3), ("MambaSpec", 1600, False, False, 3)]),
    "swa-eagle-drop": (SWA_LAYOUT, R.Speculation("drop", 1),
                       [("FullAttentionSpec", 16, True, False, 1), ("FullAttentionSpec", 16, True, True, 1),
                        ("SlidingWindowSpec", 16, True, False, 1)]),
}
# Auxiliary outputs (MoE targets on model runner V2: a Mixtral with the Llama's EAGLE draft, a Nemotron-H with
# an MoE layer): their connector caps each lookup at full attention's leading blocks (the layout's
# aux_cap_group), which never binds below the reference hit where full attention is read at its block, so
# these layouts are enforced (scheduler_run, "aux-*"; at hash granularity, tests/adapter/test_fine_mamba.py).


def _aux(setup):
    layout, spec, groups = setup
    return dataclasses.replace(layout, aux_cap_group=0), spec, groups


EXPECTED_SETUP["aux-eagle-drop"] = _aux(EXPECTED_SETUP["eagle-drop"])
EXPECTED_SETUP["aux-mtp2-drop"] = _aux(EXPECTED_SETUP["mtp2-drop"])
for _dcp in (2, 4, 8):
    for _mode in ("drop", "lookahead"):
        EXPECTED_SETUP[f"mtp2-{_mode}-dcp{_dcp}"] = (
            R.Layout(MTP_LAYOUT.groups, dcp=_dcp), R.Speculation(_mode, 2, True),
            [("FullAttentionSpec", 1600, True, True, 3), ("MambaSpec", 1600, False, False, 3)])
    EXPECTED_SETUP[f"eagle-drop-dcp{_dcp}"] = (
        R.Layout((R.Group("full", 16, eagle=True),), dcp=_dcp), R.Speculation("drop", 1),
        [("FullAttentionSpec", 16, True, True, 3)])
    EXPECTED_SETUP[f"eagle-replicated-drop-dcp{_dcp}"] = (
        R.Layout((R.Group("full", 16), R.Group("full", 16), R.Group("full", 16, dcp_sharded=False, eagle=True)),
                 dcp=_dcp), R.Speculation("drop", 1),
        [("FullAttentionSpec", 16, True, False, 1), ("FullAttentionSpec", 16, True, False, 1),
         ("FullAttentionSpec", 16, False, True, 1)])
# A shared system prompt (scheduler_run._SHARED), at retention 0 and dense. Without MTP layers each of
# Nemotron-H's Mamba layers gets a group of its own.
_SHARED_SETUP = {
    "shared-mamba": (R.Layout((R.Group("full", 1600),) + (R.Group("mamba", 1600),) * 3), R.Speculation("none"),
                     [("FullAttentionSpec", 1600, True, False, 1)] + [("MambaSpec", 1600, False, False, 1)] * 3),
    "shared-mtp2-drop": EXPECTED_SETUP["mtp2-drop"],
    "shared-mtp2-lookahead": EXPECTED_SETUP["mtp2-lookahead"],
    "shared-swa": (R.Layout((R.Group("full", 16), R.Group("swa", 16, window=64))), R.Speculation("none"),
                   [("FullAttentionSpec", 16, True, False, 1), ("SlidingWindowSpec", 16, True, False, 1)]),
    "shared-swa-eagle-drop": EXPECTED_SETUP["swa-eagle-drop"],
}
SHARED_SCENARIOS = [f"{name}-{suffix}" for name in _SHARED_SETUP for suffix in ("r0", "dense")]
for _scenario in SHARED_SCENARIOS:
    EXPECTED_SETUP[_scenario] = _SHARED_SETUP[_scenario.rsplit("-", 1)[0]]
# Streams under DCP 2 where the reference's own junction and resume points alone kept less than stock vLLM
# (scheduler_run._DCP_STREAMS): each with the known-bad variant that loses a hit there.
DCP_STREAMS = {"stream-dcp2-r0": "fine_junction_only", "stream-mtp2-lookahead-dcp2-r0": "without_vllm_checkpoint"}
EXPECTED_SETUP["stream-dcp2-r0"] = (R.Layout(_SHARED_SETUP["shared-mamba"][0].groups, dcp=2),
                                    R.Speculation("none"), _SHARED_SETUP["shared-mamba"][2])
EXPECTED_SETUP["stream-mtp2-lookahead-dcp2-r0"] = EXPECTED_SETUP["mtp2-lookahead-dcp2"]
RUNS = {  # name -> (extra arguments, KVHIT_MODE)
    "stock": ([], None),
    "off": (["--load-plugins"], "off"),
    "enforce": (["--load-plugins"], "enforce"),
    "enforce on vLLM 0.34.0": (["--load-plugins", "--vllm-version", "0.34.0"], "enforce"),
}
_KVHIT_LINE = re.compile(r"\bkvhit( enforce| shadow)?: ")
# Every scenario but the KV-connector ones, which tests/adapter/test_connectors.py serves in every mode
SCENARIOS = [name for name in scheduler_run.SCENARIOS
             if name not in scheduler_run.CONNECTORS and name != "swa-sibling"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Every run of ``RUNS``, started together: ``{name: (result, kvhit's log lines)}``."""
    work = tmp_path_factory.mktemp("scheduler_run")
    scheduler_run.write_models(str(work / "models"))
    scenarios = [arg for name in SCENARIOS for arg in ("--scenario", name)]
    started = {}
    for name, (extra, kvhit_mode) in RUNS.items():
        out = work / f"{name.replace(' ', '_')}.json"
        started[name] = (out, child_runs.start("tests.adapter.scheduler_run",
                                               [out, work / "models", *extra, *scenarios],
                                               child_runs.env(kvhit_mode)))
    return {name: (result, [line for line in log.splitlines() if _KVHIT_LINE.search(line)])
            for name, (result, log) in child_runs.collect(started).items()}


def _requests(result, scenario):
    """``(index, served request, how often its prompt was served before)`` for one scenario."""
    seen: dict[str, int] = {}
    for i, served in enumerate(result["scenarios"][scenario]["served"]):
        prompt = json.dumps(served["prompt"])  # a length, or (length, shared, variant)
        yield i, served, seen.get(prompt, 0)
        seen[prompt] = seen.get(prompt, 0) + 1


def _expected(scenario, served, policy):
    """``refimpl``'s hit under ``policy`` on the cache the run's pool held for the prompt."""
    layout, speculation, _ = EXPECTED_SETUP[scenario]
    sizes = R.derive_sizes(layout, speculation)
    cache = [set.intersection(*(set(served["retained"][m]) for m in sg.members)) for sg in sizes.groups]
    return R.hit(layout, speculation, served["prompt_len"], cache, policy)


def _steady(scenario, n):
    """The reference hit on a cache holding every boundary of the prompt."""
    layout, speculation, _ = EXPECTED_SETUP[scenario]
    return R.hit(layout, speculation, n, [n] * len(R.derive_sizes(layout, speculation).groups), "reference")


def test_vllms_plugin_loader_installs_kvhit_as_kvhit_mode_says(runs):
    stock, off, enforce = (runs[name] for name in ("stock", "off", "enforce"))
    assert not stock[0]["kvhit_imported"] and not stock[1]
    assert off[0]["kvhit_mode"] == "off" and not off[1]
    assert enforce[0]["kvhit_mode"] == "enforce"
    assert len([line for line in enforce[1] if "mode enforce on vLLM 0.33.0: replaced" in line]) == 1


def test_the_serving_process_imports_only_the_refimpl_and_the_adapter_of_kvhit(runs):
    """Every run that loads the plugin, enforce included (the reference hit staged for each layout the
    scheduler built), imports of kvhit only the package, the generated ``kvhit.refimpl`` and the adapter: no
    ``kvhit.spec``, no ``kvhit.proofs``, no z3."""
    assert runs["stock"][0]["modules"] == []
    for name, (result, _) in runs.items():
        if name == "stock":
            continue
        assert "kvhit.adapters.vllm" in result["modules"], name
        if result.get("kvhit_mode") == "enforce":
            assert "kvhit.refimpl.staging" in result["modules"], name
        assert [m for m in result["modules"] if m != "kvhit"
                and not m.startswith(("kvhit.refimpl", "kvhit.adapters"))] == [], name


@pytest.mark.parametrize("scenario", list(EXPECTED_SETUP))
def test_the_scheduler_is_built_with_the_layout_and_speculation_the_expectations_use(runs, scenario):
    """vLLM's planner grouped the layers as declared, and the scheduler resolved the speculative sizes
    ``refimpl`` derives for the declared speculation (the same in every run)."""
    layout, speculation, groups = EXPECTED_SETUP[scenario]
    for name in RUNS:
        run = runs[name][0]["scenarios"][scenario]
        assert [(g["spec"], g["block_size"], g["dcp_sharded"], g["is_eagle_group"], g["num_layers"])
                for g in run["kv_cache_groups"]] == groups, name
        sched = run["scheduler"]
        sizes = R.derive_sizes(layout, speculation)
        assert (sched["block_size"], sched["hash_block_size"]) == (sizes.scheduler_block, sizes.hash_block), name
        assert sched["coordinator"] == ("Unitary" if sizes.unitary else "Hybrid") + "KVCacheCoordinator", name
        assert (sched["use_eagle_block_drop"], sched["num_hash_lookahead_tokens"], sched["num_prefill_lookahead"],
                sched["num_spec_tokens"], sched["multi_module_mtp"]) == (
            speculation.drop, speculation.hash_lookahead, speculation.prefill_lookahead,
            speculation.num_speculative_tokens, speculation.multi_module_mtp), name


@pytest.mark.parametrize("scenario", list(EXPECTED_SETUP))
def test_enforce_reports_the_reference_num_cached_tokens_and_stock_vllm_0_33s(runs, scenario):
    """Every request (first, first repeat, second repeat): ``enforce`` reports the ``reference`` hit on the
    cache its pool held, and stock vLLM the ``vllm_0_33`` hit on its own."""
    for run, policy in (("enforce", "reference"), ("stock", "vllm_0_33")):
        for i, served, before in _requests(runs[run][0], scenario):
            expected = _expected(scenario, served, policy)
            assert served["num_cached_tokens"] == expected, (
                f"{scenario} {run} request {i} (N={served['prompt_len']}, served {before} times before): "
                f"num_cached_tokens {served['num_cached_tokens']}, {policy} {expected}; "
                f"pool held {served['retained']}")


@pytest.mark.parametrize("scenario", ["eagle-drop", "eagle-drop-dcp2", "eagle-drop-dcp4", "eagle-drop-dcp8",
                                      "aux-eagle-drop"])
def test_enforce_keeps_the_eagle_block_stock_vllm_drops(runs, scenario):
    """F2 through the scheduler: EAGLE drop, one full-attention group of block 16 (32, 64, 128 tokens across
    the DCP ranks), a block-aligned prompt. On the same cache the two policies differ, so this case tells
    enforce from stock."""
    (_, stock, _), (_, enforce, _) = (list(_requests(runs[run][0], scenario))[1] for run in ("stock", "enforce"))
    assert stock["prompt_len"] == enforce["prompt_len"] == 1024 and stock["retained"] == enforce["retained"]
    assert _expected(scenario, stock, "vllm_0_33") < _expected(scenario, stock, "reference")
    assert (stock["num_cached_tokens"], enforce["num_cached_tokens"]) == (
        _expected(scenario, stock, "vllm_0_33"), _expected(scenario, enforce, "reference"))


_FIRST_REPEATS = [pytest.param(s, n, id=f"{s}-N{n}") for s, n in (
    ("eagle-drop", 1024), ("eagle-lookahead", 1024), ("mtp2-lookahead", 8000), ("mtp2-lookahead", 11910),
    ("mtp2-drop", 11910),
    # The decode steps cache the full-attention block 6400-8000, so a resend can resume at 6400: the
    # reference keeps that Mamba state too (refimpl.resume_points on the decoded cache). Before it did,
    # enforce got 4800 here where stock vLLM gets 6400.
    ("mtp2-drop", 8000), ("swa-eagle-drop", 1000), ("aux-eagle-drop", 1024), ("aux-mtp2-drop", 8000),
    ("aux-mtp2-drop", 11910)) + tuple(
    (f"{label}-drop-dcp{dcp}", 1024) for label in ("eagle", "eagle-replicated") for dcp in (2, 4, 8)) + tuple(
    # Under DCP the full-attention block (3200 at DCP 2) exceeds the hash unit 1600: the decode step leaves a
    # partial-tail entry at 8000, so a resend resumes at 6400 (stock vLLM too). The reference keeps that Mamba
    # state (refimpl.decoded_tail); before it did, enforce got 4800 at DCP 2.
    (f"mtp2-{mode}-dcp{dcp}", n) for mode in ("drop", "lookahead") for dcp in (2, 4, 8) for n in (8000, 11910))]


@pytest.mark.parametrize("scenario, n", _FIRST_REPEATS)
def test_enforce_first_repeat_hits_the_reference_steady_state(runs, scenario, n):
    """The first repeat of a prompt gets what the reference hits on a cache holding the whole prompt, and
    the second repeat the same."""
    hits = [served["num_cached_tokens"] for _, served, before in _requests(runs["enforce"][0], scenario)
            if served["prompt_len"] == n and before]
    assert hits and hits[0] == _steady(scenario, n), (scenario, n, hits)
    assert all(hit == hits[0] for hit in hits), (scenario, n, hits)


@pytest.mark.parametrize("scenario", SHARED_SCENARIOS)
def test_enforce_never_gives_less_than_stock_to_prompts_sharing_a_system_prompt(runs, scenario):
    """Four prompts share a system prompt of ``P`` tokens and then diverge; then the first is sent again.
    At every request enforce's hit is at least stock vLLM's, and from the third on the prompts hit what the
    reference hits on a cache holding every state of the system prompt (the second records the junction
    that makes it so). With ``L`` lookahead tokens a block's hash covers ``L`` tokens past it, so the
    prompts share the boundaries up to ``P - L``."""
    layout, speculation, _ = EXPECTED_SETUP[scenario]
    stock, enforce = (runs[run][0]["scenarios"][scenario]["served"] for run in ("stock", "enforce"))
    hits = [(s["num_cached_tokens"], e["num_cached_tokens"]) for s, e in zip(stock, enforce)]
    assert all(e >= s for s, e in hits), (scenario, "(stock, enforce) per request", hits)
    n, shared, _ = enforce[2]["prompt"]
    sizes = R.derive_sizes(layout, speculation)
    on_system_prompt = R.hit(layout, speculation, n, [shared - sizes.hash_lookahead] * len(sizes.groups),
                             "reference")
    assert on_system_prompt > 0 and [e for _, e in hits[2:4]] == [on_system_prompt] * 2, (scenario, hits)


def _stream_hits(scenario, policy):
    """refimpl's hits for the scenario's prompts served in order on an empty cache, retention 0, each
    request reading what every earlier one left (its write side under ``policy``) up to the tokens the two
    prompts share (counted on the prompts the run served)."""
    layout, speculation, _ = EXPECTED_SETUP[scenario]
    sizes, rules = R.derive_sizes(layout, speculation), R.ALL_POLICIES[policy]
    prompts = [scheduler_run._prompt(scenario, entry) for entry in scheduler_run.SCENARIOS[scenario][4]]
    left, hits = [], []
    for tokens in prompts:
        layers = []
        for earlier, writes in left:
            shared = next((i for i, (a, b) in enumerate(zip(tokens, earlier)) if a != b),
                          min(len(tokens), len(earlier)))
            layers.append(tuple(R.clip(sizes, g, shared) for g in writes))
        cache = R.written_cache(tuple(tuple(layer[k] for layer in layers) for k in range(len(sizes.groups))))
        hit, _, _, _, writes = R.serve(sizes, len(tokens), 0, rules, cache)
        hits.append(hit)
        left.append((tokens, writes))
    return hits


@pytest.mark.parametrize("scenario", DCP_STREAMS)
def test_enforce_never_gives_less_than_stock_to_diverging_prompts_under_dcp(runs, scenario):
    """Under DCP 2 a Mamba hybrid's prompts that share prefixes and diverge: at every request enforce's hit
    is at least stock vLLM's, and both are refimpl's for the stream (the reference's and vllm_0_33's write
    and read sides); the known-bad variant, without the rule that keeps vLLM's boundary, gets less than stock
    on the last request, so the stream tells the two apart."""
    stock, enforce = ([s["num_cached_tokens"] for s in runs[run][0]["scenarios"][scenario]["served"]]
                      for run in ("stock", "enforce"))
    assert all(e >= s for s, e in zip(stock, enforce)), (scenario, stock, enforce)
    assert (stock, enforce) == (_stream_hits(scenario, "vllm_0_33"), _stream_hits(scenario, "reference"))
    assert _stream_hits(scenario, DCP_STREAMS[scenario])[-1] < stock[-1], (scenario, stock)


def test_auxiliary_outputs_cap_lookups_below_n_minus_1_and_enforce_answers_them(runs):
    """The aux-* scenarios' lookups are capped (``AuxOutputSchedulerConnector.max_cache_hit``, recorded at
    admission) below ``N - 1`` where full attention holds fewer blocks, and enforce answers every lookup
    (none falls back to vLLM's code) with the reference hit (the tests above; on aux-eagle-drop that hit is
    not stock vLLM's, so the layout is enforced, not left to vLLM)."""
    capped = [s for name in ("aux-eagle-drop", "aux-mtp2-drop")
              for s in runs["enforce"][0]["scenarios"][name]["served"] if s["aux_cap"] < s["prompt_len"] - 1]
    assert len(capped) >= 3 and any(s["num_cached_tokens"] > 0 for s in capped), capped
    assert all(s["num_cached_tokens"] <= s["aux_cap"] for s in capped), capped
    counters = runs["enforce"][0]["kvhit_counters"]
    assert counters["kvhit_enforce_fallbacks"] == 0, counters


def test_kvhit_mode_off_leaves_the_scheduler_byte_identical_to_stock(runs):
    """Every ``SchedulerOutput`` (tokens, block ids, drafts) and ``EngineCoreOutput`` of every scenario."""
    stock, off = runs["stock"][0]["scenarios"], runs["off"][0]["scenarios"]
    assert json.dumps(off, sort_keys=True) == json.dumps(stock, sort_keys=True)
    assert json.dumps(runs["enforce"][0]["scenarios"], sort_keys=True) != json.dumps(stock, sort_keys=True)


def test_an_unknown_vllm_version_is_refused_through_the_plugin_loader(runs):
    """With vLLM reporting 0.34.0, KVHIT_MODE=enforce is refused with one line and the scheduler is stock."""
    result, lines = runs["enforce on vLLM 0.34.0"]
    assert result["kvhit_mode"] == "off"
    assert len(lines) == 1 and "0.34.0" in lines[0] and "untouched" in lines[0], lines
    assert json.dumps(result["scenarios"], sort_keys=True) == json.dumps(runs["stock"][0]["scenarios"],
                                                                          sort_keys=True)
