"""kvhit explain on the written cache: every write-side number recomputed here from the refimpl.

The recomputation does not go through the tool: the first request's cache is ``refimpl.request_writes``,
the repeats are ``refimpl.repeat`` called in a loop, the retained boundaries are every token position a
plain ``written_cache`` holds (not only the grid the tool enumerates), and the resume point is the hit on
``refimpl.dense_groups``.
"""

import json
from pathlib import Path

import jsonschema
import pytest

from kvhit import refimpl
from kvhit.cli import main
from kvhit.explain import explain, speculation
from kvhit.layouts import catalogue

SCHEMA = json.loads((Path(__file__).parents[2] / "docs" / "explain.schema.json").read_text())
POLICIES = ("reference", "vllm_0_33", "historical")
QWEN_MTP = ("qwen3next", "drop", 2, True)
CASES = [  # (layout, mode, k, multi-module MTP, N, retention intervals in scheduler blocks; None = dense)
    (*QWEN_MTP, 11910, (None, 0, 2)), (*QWEN_MTP, 8000, (0, 1)), ("qwen3next", "none", None, False, 8000, (0,)),
    ("gemma", "drop", 1, False, 704, (None, 0, 1)), ("gemma", "lookahead", 2, True, 577, (0,)),
    ("three_kind", "drop", 1, False, 20000, (0, 2)), ("full16", "drop", 1, False, 1024, (0,)),
    ("llama_eagle", "lookahead", 3, True, 777, (0,)), ("dsv4_cuda", "drop", 1, False, 5000, (0,)),
    ("chunked64", "lookahead", 1, False, 300, (0,)),
]
WRITTEN = [(name, mode, k, mtp, n, r) for name, mode, k, mtp, n, rs in CASES for r in rs]


def _interval(sizes, r):
    return None if r is None else r * sizes.scheduler_block


def _held_positions(groups, k, upto):
    cache = refimpl.written_cache(groups)
    return {x for x in range(1, upto + 1) if cache.has(k, x)}


@pytest.mark.parametrize("name, mode, k, mtp, n, r", WRITTEN)
def test_written_cache_report_is_what_refimpl_request_writes_and_repeat_give(name, mode, k, mtp, n, r):
    layout, spec = catalogue()[name], speculation(mode, k, mtp)
    sizes = refimpl.derive_sizes(layout, spec)
    interval = _interval(sizes, r)
    n2 = n + sizes.scheduler_block
    report = explain(layout, spec, n, POLICIES, retention_interval=interval, compare=True)
    assert report["input"]["cache"]["kind"] == "written" and report["input"]["retention_interval"] == interval
    ws = report["write_side"]
    assert ws["sibling_tokens"] == n2
    for t, side in zip(report["policies"], ws["policies"]):
        rules = refimpl.policy_rules(side["policy"])
        first = refimpl.request_writes(sizes, n, interval, rules)
        hits, junctions, groups = [], [], first
        for _ in range(3):
            hit, junction, groups = refimpl.repeat(sizes, n, interval, rules, groups)
            hits.append(hit)
            junctions.append(junction)
        assert t["hit"] == side["first_repeat"]["hit"] == hits[0]
        assert side["first_repeat"]["junction"] == side["second_repeat"]["after_junction"] == junctions[0]
        assert (side["second_repeat"]["hit"], side["second_repeat"]["junction"]) == (hits[1], junctions[1])
        assert side["second_repeat"]["trace"]["hit"] == hits[1]
        assert side["repeat_hits"] == hits
        assert side["sibling"]["hit"] == side["sibling"]["trace"]["hit"] == \
            refimpl.hit_tokens(refimpl.written_cache(first), sizes, n2, rules)[0]
        dense = refimpl.written_cache(refimpl.dense_groups(sizes, n))
        assert side["dense_hit"] == refimpl.hit_tokens(dense, sizes, n, rules)[0]
        assert side["sibling"]["dense_hit"] == refimpl.hit_tokens(
            refimpl.written_cache(refimpl.dense_groups(sizes, n)), sizes, n2, rules)[0]
        assert set(side["replay_boundaries"]) == set(refimpl.replay_boundaries(sizes, n, rules))
        assert side["cacheable_tokens"] == [refimpl.cacheable_tokens(sizes, j, n) for j in range(len(sizes.groups))]
        for j, g in enumerate(side["groups"]):
            held = _held_positions(first, j, n + sizes.scheduler_block)
            shown = set(g["boundaries"])
            if g["all_up_to"] is not None:
                shown |= set(range(g["all_from"] + g["grid"], g["all_up_to"] + 1, g["grid"]))
            assert shown == held, f"{side['policy']} group {j}"
            assert g["retained_states"] == refimpl.retained_states(first[j])
        assert side["retained_states"] == sum(refimpl.retained_states(h) for h in first
                                              if h.kind.value in ("swa", "mamba"))
    for c, side in zip(report["comparison"], ws["policies"]):
        named = {v["invariant"] for v in c["violations"]}
        disagree = side["first_repeat"]["hit"] != side["dense_hit"] or \
            side["sibling"]["hit"] != side["sibling"]["dense_hit"]
        assert ("scheduler_and_mask_boundaries_agree" in named) == disagree
        assert ("second_repeat_is_stable" in named) == (len(set(side["repeat_hits"][1:])) > 1)
    jsonschema.validate(report, SCHEMA)


def _qwen(n, policies=POLICIES):
    return explain(catalogue()["qwen3next"], speculation("drop", 2, True), n, policies, compare=True)


def test_explain_reproduces_the_qwen3_next_report():
    report = _qwen(11910)
    sides = {s["policy"]: s for s in report["write_side"]["policies"]}
    historical = sides["historical"]
    assert [g["boundaries"] for g in historical["groups"] if g["kind"] == "mamba"] == [[11200]]  # the mask keeps
    assert historical["dense_hit"] == 9600  # the resume point
    assert historical["repeat_hits"][:2] == [0, 9600]
    assert (historical["first_repeat"]["junction"], historical["second_repeat"]["hit"]) == (9600, 9600)
    for policy in ("vllm_0_33", "reference"):
        assert sides[policy]["first_repeat"]["hit"] == 9600
        assert [g["boundaries"] for g in sides[policy]["groups"] if g["kind"] == "mamba"] == [[9600]]
    named = {c["policy"]: [v["invariant"] for v in c["violations"]] for c in report["comparison"]}
    assert named == {"reference": [], "vllm_0_33": [], "historical": ["scheduler_and_mask_boundaries_agree"]}


def test_explain_shows_w1_the_vllm_first_repeat_miss_at_8000():
    report = _qwen(8000)
    sides = {s["policy"]: s for s in report["write_side"]["policies"]}
    assert sides["vllm_0_33"]["repeat_hits"][:2] == [0, 4800]
    assert sides["vllm_0_33"]["replay_boundaries"] == [4800, 6400]
    assert sides["reference"]["repeat_hits"][:2] == [4800, 4800]
    named = {c["policy"]: [v["invariant"] for v in c["violations"]] for c in report["comparison"]}
    assert named["vllm_0_33"] == ["scheduler_and_mask_boundaries_agree"] and named["reference"] == []


def test_compare_names_an_unstable_second_repeat():
    """The known-bad ``junction_past_hit`` records its junction one block past the hit: each repeat moves."""
    report = _qwen(11910, ("junction_past_hit",))
    (side,) = report["write_side"]["policies"]
    rules = refimpl.policy_rules("junction_past_hit")
    sizes = refimpl.derive_sizes(catalogue()["qwen3next"], speculation("drop", 2, True))
    assert side["repeat_hits"] == list(refimpl.repeat_hits(sizes, 11910, 0, rules, 3))
    assert side["repeat_hits"][1] != side["repeat_hits"][2]
    assert "second_repeat_is_stable" in [v["invariant"] for v in report["comparison"][0]["violations"]]


def test_dense_option_keeps_the_read_side_alone():
    report = explain(catalogue()["qwen3next"], speculation("drop", 2, True), 11910, POLICIES, cache="dense")
    assert "write_side" not in report and report["input"]["retention_interval"] is None
    assert [t["hit"] for t in report["policies"]] == [9600, 9600, 9600]


def test_sibling_is_taken_from_the_command_line(capsys):
    assert main(["explain", "gemma", "704", "--sibling", "800", "--compare", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    sizes = refimpl.derive_sizes(catalogue()["gemma"], refimpl.NO_SPECULATION)
    for side in report["write_side"]["policies"]:
        rules = refimpl.policy_rules(side["policy"])
        first = refimpl.request_writes(sizes, 704, 0, rules)
        assert side["sibling"]["n_tokens"] == 800
        assert side["sibling"]["hit"] == refimpl.hit_tokens(refimpl.written_cache(first), sizes, 800, rules)[0]
    assert {s["policy"]: s["sibling"]["hit"] for s in report["write_side"]["policies"]} == \
        {"reference": 704, "vllm_0_33": 640, "historical": 640}  # W2


def test_text_report_names_the_write_side(capsys):
    assert main(["explain", "qwen3next", "11910", "--speculative", "drop", "--num-speculative-tokens", "2",
                 "--multi-module-mtp", "--compare"]) == 0
    out = capsys.readouterr().out
    assert "g1 mamba  11200: 1 state" in out and "repeats 1..3          0, 9600, 9600" in out
    assert "historical         0     9600        0  scheduler_and_mask_boundaries_agree" in out
