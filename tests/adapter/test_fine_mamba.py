"""Enforce on a Mamba group read at hash granularity, through vLLM 0.33's real ``Scheduler`` (issue 17).

A Mamba group is read at hash granularity when its hits may end inside a block: ``prefix_match_unit`` 160 on
1600-token blocks (the catalogue's ``qwen3next_pmu160``), or a 160-token sliding-window block beside
1600-token Mamba blocks (``three_kind``). A state inside a block is then a partial tail, of which vLLM keeps
one per request (``MambaManager._cache_partial_tail_block``); the reference keeps that bookkeeping, with the
tail at the resend's resume point (``kvhit.spec.retention.mamba_held``, ``resume_tail``), so enforce owns both
sides here (but where the Mamba group itself drops with multi-module MTP in drop mode, which vLLM's planner
does not build for these models: ``tests/adapter/test_whole_layout_stock.py``).

Issue 17's case: ``three_kind`` with the MTP layer in the full-attention group (the EAGLE group), one or two
MTP modules in drop mode, retention 0, a token budget of 8192: a prompt of 11910 tokens, two resends, a longer
sibling, two prompts sharing its first 6000 tokens and the prompt again. Stock vLLM hits 9600 on the first
resend and 11680 on the second (measured here, ``STOCK``); enforce hits the reference's steady hit from the
first resend on.

With auxiliary outputs (routed experts of an MoE Nemotron-H, one MTP module in drop mode) every lookup is
capped at full attention's leading whole blocks, which a hit inside a block passes: the reference keeps the
tail where vLLM keeps its checkpoint unless a resend resumes inside a block (``Rules.checkpoint_tail_when_capped``;
with two MTP modules the layout is left to vLLM, ``tests/adapter/test_whole_layout_stock.py``).

Each mode runs in a process of its own (``tests/adapter/scheduler_run.py``; stock: kvhit never imported).
"""

from __future__ import annotations

import json

import pytest

import kvhit.refimpl as R
from tests.adapter import child_runs
from tests.adapter.layouts import refimpl_layout, speculation

# scenario -> the catalogue layout it is
SCENARIOS = {"pmu160-mtp1-drop": "qwen3next_pmu160", "three-kind-mtp1-drop": "three_kind",
             "pmu160-mtp2-drop": "qwen3next_pmu160", "three-kind-mtp2-drop": "three_kind",
             "aux-pmu160-mtp1-drop": "qwen3next_pmu160"}
# scenario -> MTP modules (drop mode)
MODULES = {"pmu160-mtp1-drop": 1, "three-kind-mtp1-drop": 1, "pmu160-mtp2-drop": 2, "three-kind-mtp2-drop": 2,
           "aux-pmu160-mtp1-drop": 1}
# Scenarios whose scheduler has auxiliary outputs (routed experts of an MoE Nemotron-H), whose connector caps
# every lookup at full attention's leading whole blocks: the layout's aux_cap_group (with two MTP modules the
# layout is left to vLLM: tests/adapter/test_whole_layout_stock.py).
CAPPED = {"aux-pmu160-mtp1-drop"}
MODES = ("stock", "shadow", "enforce")
# What stock vLLM 0.33.0 hits on each scenario's stream (scheduler_run._FINE_MAMBA_STREAM), measured
# 2026-12-03: the reference's claims say nothing of stock, so these pin the runs and show the comparison with
# enforce can fail (three_kind's first resend).
STOCK = {"pmu160-mtp1-drop": [0, 11680, 11680, 11680, 0, 3200, 11680],
         "three-kind-mtp1-drop": [0, 9600, 11680, 11680, 0, 0, 11680],
         # two MTP modules (measured 2026-12-06)
         "pmu160-mtp2-drop": [0, 11680, 11680, 11680, 0, 3200, 11680],
         "three-kind-mtp2-drop": [0, 9600, 11680, 11680, 0, 0, 11680],
         # under the auxiliary outputs' cap (measured 2026-12-08)
         "aux-pmu160-mtp1-drop": [0, 9600, 9600, 9600, 0, 3200, 9600]}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """``{mode: result}`` of the scenarios, each mode in a process of its own, started together."""
    return child_runs.scheduler_modes(tmp_path_factory.mktemp("fine_mamba"), SCENARIOS, MODES)


_hits = child_runs.served_hits


def _sizes(run, scenario):
    """The layout's sizes as the planner built it: the catalogue's groups, the full-attention one flagged
    EAGLE (the planner's groups holding the MTP layer are full attention,
    ``test_the_scheduler_layouts_are_the_catalogues``; beside them a full-attention group of the same block
    that does not drop adds nothing to the hit), so the Mamba group does not drop."""
    assert any(g["is_eagle_group"] for g in run["kv_cache_groups"]), run["kv_cache_groups"]
    layout = refimpl_layout(SCENARIOS[scenario])
    groups = tuple(R.Group(g.kind, g.block_size, window=g.window, eagle=g.kind == R.Kind.FULL)
                   for g in layout.groups)
    k = MODULES[scenario]
    return R.derive_sizes(R.Layout(groups, prefix_match_unit=layout.prefix_match_unit,
                                   aux_cap_group=0 if scenario in CAPPED else None),
                          speculation("drop", k, k > 1))


def test_the_scheduler_layouts_are_the_catalogues(runs):
    """The planner built the catalogue's layouts (its groups merged into spec groups of the same kinds,
    blocks and window), with the hash unit that makes their Mamba groups hash-granular, and the MTP layers in
    a full-attention group."""
    for scenario in SCENARIOS:
        run = runs["stock"]["scenarios"][scenario]
        k = MODULES[scenario]
        want = R.derive_sizes(refimpl_layout(SCENARIOS[scenario]), speculation("drop", k, k > 1))
        assert (run["scheduler"]["block_size"], run["scheduler"]["hash_block_size"]) == (
            want.scheduler_block, want.hash_block), scenario
        kinds = {(g["spec"], g["block_size"]) for g in run["kv_cache_groups"]}
        spec_of = {"full": "FullAttentionSpec", "mamba": "MambaSpec", "swa": "SlidingWindowSpec"}
        assert kinds == {(spec_of[g.kind.value], g.block) for g in want.groups}, scenario
        eagle = {g["spec"] for g in run["kv_cache_groups"] if g["is_eagle_group"]}
        assert eagle == {"FullAttentionSpec"}, (scenario, run["kv_cache_groups"])


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_enforce_first_resend_hits_the_reference_steady_hit(runs, scenario):
    """Both resends hit ``refimpl.repeat_hits(..., REFERENCE)`` on the planner's layout, which are equal;
    every request of the stream gets at least stock's hit; and stock is what was measured."""
    stock, enforce = _hits(runs["stock"], scenario), _hits(runs["enforce"], scenario)
    assert stock == STOCK[scenario]
    want = R.repeat_hits(_sizes(runs["stock"]["scenarios"][scenario], scenario), 11910, 0, R.REFERENCE, 2)
    assert want[0] == want[1] and tuple(enforce[1:3]) == want, (scenario, enforce, want)
    assert all(e >= s for s, e in zip(stock, enforce)), (scenario, stock, enforce)


def test_under_the_auxiliary_outputs_cap_enforce_keeps_the_tail_where_vllm_keeps_its_checkpoint(runs):
    """Auxiliary outputs cap every lookup at full attention's leading whole blocks, so a resend of 11910
    tokens is capped at 11200: stock hits 9600 from the first resend on, enforce 11200, ``refimpl``'s
    reference under the cap; without the cap both hit 11680. The tail rule under the cap
    (``refimpl.resume_tail``) is what a stream needs beyond a resend: ``tail_at_capped_resume`` hits the
    same resends here (and less than vLLM elsewhere: tests/unit/test_aux_write_side.py)."""
    scenario = "aux-pmu160-mtp1-drop"
    sizes = _sizes(runs["stock"]["scenarios"][scenario], scenario)
    assert sizes.cap_group == 0
    assert R.repeat_hits(sizes, 11910, 0, R.REFERENCE, 2) == (11200, 11200)
    assert _hits(runs["enforce"], scenario)[1:3] == [11200, 11200] and _hits(runs["stock"], scenario)[1:3] == [9600] * 2
    assert _hits(runs["enforce"], "pmu160-mtp1-drop")[1:3] == [11680, 11680]
    status = runs["enforce"]["scenarios"][scenario]["kvhit_status"]
    assert status["layout"]["aux_cap_group"] == 0, status


@pytest.mark.parametrize("scenario", ["three-kind-mtp1-drop", "three-kind-mtp2-drop"])
def test_issue_17s_case_gets_11680_from_the_first_resend(runs, scenario):
    """three_kind, one or two MTP modules in drop mode, R = 0, N = 11910, budget 8192: stock 9600 then 11680
    (the report); enforce 11680 from the first resend on, as ``kvhit explain`` predicts for the reference.
    With two modules the layout was left to vLLM until the reference kept a short prompt's tail where a
    decoded resend resumes (``refimpl.resume_tail``)."""
    assert _hits(runs["stock"], scenario)[1:3] == [9600, 11680]
    assert _hits(runs["enforce"], scenario)[1:3] == [11680, 11680]


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_enforce_models_the_layout_and_shadow_is_stock(runs, scenario):
    """Enforce models the layout with the reference write side (status file, no fallback); shadow serves every
    ``SchedulerOutput`` and ``EngineCoreOutput`` exactly as stock."""
    status = runs["enforce"]["scenarios"][scenario]["kvhit_status"]
    assert (status["mode"], status["modelled"]) == ("enforce", True) and status["write_side"] == "reference", status
    assert runs["enforce"]["kvhit_counters"]["kvhit_enforce_fallbacks"] == 0
    assert runs["enforce"]["kvhit_counters"]["kvhit_unmodelled_layouts"] == 0
    shadow = {k: v for k, v in runs["shadow"]["scenarios"][scenario].items() if k != "kvhit_status"}
    assert json.dumps(shadow, sort_keys=True) == json.dumps(runs["stock"]["scenarios"][scenario], sort_keys=True)
