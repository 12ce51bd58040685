"""kvhit explain: every number in the trace is the refimpl's, recomputed here independently."""

import json
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest

from kvhit import refimpl
from kvhit.cli import main
from kvhit.explain import explain, speculation
from kvhit.layouts import LayoutError, catalogue, load, parse
from kvhit.refimpl import CacheState

SCHEMA = json.loads((Path(__file__).parents[2] / "docs" / "explain.schema.json").read_text())
POLICIES = ("reference", "vllm_0_33", "historical")
CASES = [  # (layout, mode, k, multi-module MTP, N)
    ("dsv4_report", "drop", 1, False, 46240), ("dsv4_report", "lookahead", 1, False, 46240),
    ("dsv4_cuda", "drop", 1, False, 5000), ("qwen3next", "drop", 2, True, 11910),
    ("qwen3next_pmu160", "drop", 1, False, 11910), ("three_kind", "drop", 1, False, 20000),
    ("gemma", "drop", 1, False, 1000), ("gemma", "none", None, False, 1000), ("full16", "drop", 1, False, 1024),
    ("llama_eagle", "lookahead", 3, True, 777), ("chunked64", "none", None, False, 300),
]


def _report(name, mode, k, mtp, n, cached=None):
    """The read side alone: the dense cache these tests recompute with ``CacheState.up_to``."""
    return explain(catalogue()[name], speculation(mode, k, mtp), n, POLICIES, cached=cached, compare=True,
                   cache="dense")


@pytest.mark.parametrize("name, mode, k, mtp, n", CASES)
def test_explained_hit_is_refimpl_hit(name, mode, k, mtp, n):
    layout = catalogue()[name]
    spec = speculation(mode, k, mtp)
    groups = len(refimpl.derive_sizes(layout, spec).groups)
    for t in _report(name, mode, k, mtp, n)["policies"]:
        assert t["hit"] == refimpl.hit(layout, spec, n, [n] * groups, t["policy"])


HYBRID_CASES = [c for c in CASES if len(catalogue()[c[0]].groups) > 1]


@pytest.mark.parametrize("name, mode, k, mtp, n", HYBRID_CASES)
def test_every_pass_and_step_reproduces_from_refimpl_hybrid_pass_and_lookup(name, mode, k, mtp, n):
    layout = catalogue()[name]
    spec = speculation(mode, k, mtp)
    sizes = refimpl.derive_sizes(layout, spec)
    cache = CacheState.up_to([n] * len(sizes.groups))
    hashes = refimpl.num_hashes(sizes, n)
    for t in _report(name, mode, k, mtp, n)["policies"]:
        if t["policy"] == "reference":
            continue
        rules = refimpl.policy_rules(t["policy"])
        hit_length = n - 1
        verified, lengths = (False,) * len(sizes.groups), (0,) * len(sizes.groups)
        for p in t["passes"]:
            assert p["start"] == hit_length
            c, verified, lengths, _, _ = refimpl.hybrid_pass(cache, sizes, hashes, hit_length, verified, lengths,
                                                            p["index"] == 1, rules)
            assert p["end"] == c
            assert p["steps"][-1]["verified_after"] == list(verified)
            before = hit_length
            for s in p["steps"]:
                assert s["candidate_before"] == before
                if s["action"] == "lookup":
                    assert (s["result"], s["reach"]) == refimpl.lookup(cache, sizes, s["group"], hashes, s["bound"],
                                                                       s["drop"], rules)
                    assert s["found"] == refimpl.lookup(cache, sizes, s["group"], hashes, s["bound"], False, rules)[0]
                    assert s["candidate_after"] == s["result"]
                else:
                    assert sizes.groups[s["group"]].kind.value == "full" and p["index"] > 1
                    assert s["candidate_after"] == min(before, lengths[s["group"]])
                before = s["candidate_after"]
            hit_length = min(hit_length, c)
        assert t["hit"] == hit_length


def test_unitary_trace_is_one_refimpl_lookup():
    report = _report("full16", "drop", 1, False, 1024)
    sizes = refimpl.derive_sizes(catalogue()["full16"], speculation("drop", 1))
    cache = CacheState.up_to([1024])
    for t in report["policies"][1:]:
        (step,) = t["passes"][0]["steps"]
        assert (step["bound"], step["drop"]) == (1023, True)
        rules = refimpl.policy_rules(t["policy"])
        assert step["result"] == refimpl.lookup(cache, sizes, 0, refimpl.num_hashes(sizes, 1024), 1023, True,
                                                rules)[0]
        assert step["result"] == t["hit"] == 992


@pytest.mark.parametrize("name, mode, k, mtp, n", CASES)
def test_reference_explanation_checks_the_hit_and_the_next_aligned_length(name, mode, k, mtp, n):
    layout = catalogue()[name]
    sizes = refimpl.derive_sizes(layout, speculation(mode, k, mtp))
    t = _report(name, mode, k, mtp, n)["policies"][0]
    cache = CacheState.up_to([n] * len(sizes.groups))
    reach = refimpl.hash_reach(sizes, n)
    extents = refimpl.group_extents(cache, sizes, reach)
    assert t["extents"] == list(extents) and t["cap"] == min(n - 1, reach)
    rules = refimpl.policy_rules("reference")
    for c in t["checked"]:
        assert c["serves"] == refimpl.serves_all(cache, sizes, c["x"], extents, reach, rules)
    xs = [c["x"] for c in t["checked"]]
    assert (t["hit"] in xs) == (t["hit"] > 0)
    assert all(x in (t["hit"], t["hit"] + sizes.alignment) for x in xs)


def test_explain_reproduces_the_deepseek_v4_report():
    report = _report("dsv4_report", "drop", 1, False, 46240)
    hits = {t["policy"]: t["hit"] for t in report["policies"]}
    assert hits == {"reference": 32768, "vllm_0_33": 32768, "historical": 16384}
    sz = report["sizes"]
    assert (sz["scheduler_block"], sz["hash_block"], sz["alignment"], sz["num_hashes"]) == (16384, 4, 16384, 11560)
    historical = report["policies"][2]
    eagle = [s for s in historical["passes"][0]["steps"] if s["drop"]]
    assert [(s["kind"], s["found"], s["result"]) for s in eagle] == [("swa", 32768, 16384)]
    violated = {c["policy"]: [v["invariant"] for v in c["violations"]] for c in report["comparison"]}
    assert violated == {"reference": [], "vllm_0_33": [],
                        "historical": ["hit_is_the_longest_valid", "eagle_loses_at_most_one_block_beyond_alignment"]}


def test_dense_cache_shows_the_qwen3_next_resume_point():
    report = _report("qwen3next", "drop", 2, True, 11910)
    assert {t["policy"]: t["hit"] for t in report["policies"]} == dict.fromkeys(POLICIES, 9600)
    sz = report["sizes"]
    assert (sz["scheduler_block"], sz["alignment"], sz["num_hashes"], sz["hash_reach"], sz["prefill_lookahead"]) \
        == (1600, 1600, 7, 11200, 2)
    first = report["policies"][1]["passes"][0]["steps"][0]
    assert (first["bound"], first["found"], first["result"]) == (11200, 11200, 9600)


def test_compare_names_the_invariants_of_the_f1_hash_overrun():
    layout, _ = parse({"groups": [{"kind": "swa", "block_size": 16, "window": 64}]})
    report = explain(layout, speculation("lookahead", 2, True), 33, POLICIES, compare=True)
    named = {c["policy"]: {v["invariant"] for v in c["violations"]} for c in report["comparison"]}
    assert named["reference"] == set()
    assert "lookup_stays_within_hashes" in named["vllm_0_33"]


def test_a_shorter_cached_prefix_is_served_as_refimpl_says():
    report = _report("three_kind", "drop", 1, False, 20000, cached=(20000, 12800, 20000))
    layout = catalogue()["three_kind"]
    for t in report["policies"]:
        assert t["hit"] == refimpl.hit(layout, speculation("drop", 1), 20000, [20000, 12800, 20000], t["policy"])
    assert report["policies"][0]["hit"] == 12800


@pytest.mark.parametrize("name, mode, k, mtp, n, cache", [(*c, cache) for c in CASES for cache in ("written", "dense")])
def test_json_output_follows_the_documented_schema(name, mode, k, mtp, n, cache, capsys):
    jsonschema.Draft202012Validator.check_schema(SCHEMA)
    args = ["explain", name, str(n), "--speculative", mode, "--compare", "--json", "--cache", cache]
    args += ["--num-speculative-tokens", str(k)] if k else []
    args += ["--multi-module-mtp"] if mtp else []
    assert main(args) == 0
    report = json.loads(capsys.readouterr().out)
    jsonschema.validate(report, SCHEMA)
    assert report["input"]["cache"]["kind"] == cache and ("write_side" in report) == (cache == "written")


def test_json_schema_rejects_a_report_missing_its_hit():
    report = _report("gemma", "drop", 1, False, 1000)
    del report["policies"][1]["hit"]
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(report, SCHEMA)


@pytest.mark.parametrize("text, message", [
    ('{"groups": [{"kind": "full", "block_size": 16},]}', "not valid JSON: line 1"),
    ('{"groups": [{"kind": "mla", "block_size": 16}]}', "group 0: unknown kind 'mla'"),
    ('{"groups": [{"kind": "full", "block_size": 16}, {"kind": "swa", "block_size": 16}]}',
     "group 1: a sliding-window group needs a window"),
    ('{"prefix_match_unit": 16, "groups": [{"kind": "full", "block_size": 32}, '
     '{"kind": "swa", "block_size": 24, "window": 64}]}', "group 1: effective block 24 is not a multiple of the hash unit 16"),
    ('{"groups": [{"kind": "full", "block_size": 16, "windw": 3}]}', "group 0: unknown field 'windw'"),
    ('{"groups": [{"kind": "full"}]}', "group 0: missing field 'block_size'"),
    ('{"groups": [{"kind": "full", "block_size": "16"}]}', "group 0: block_size must be an integer"),
    ('[]', "a layout file holds a JSON object"),
    ('{"groups": []}', "a layout needs at least one KV-cache group"),
    ('{"aux_cap_group": 1, "groups": [{"kind": "full", "block_size": 16}, {"kind": "mamba", "block_size": 16}]}',
     "aux_cap_group 1: a cap by the leading blocks of a mamba group is not modelled"),
    ('{"aux_cap_group": 2, "groups": [{"kind": "full", "block_size": 16}]}',
     "aux_cap_group 2 is not a KV-cache group of this layout"),
])
def test_malformed_layout_file_is_refused_with_the_problem_named(tmp_path, capsys, text, message):
    path = tmp_path / "bad.json"
    path.write_text(text)
    with pytest.raises(LayoutError, match="bad.json: "):
        load(str(path))
    assert main(["explain", str(path), "100"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvhit explain: error: ") and message in err


def test_layout_file_round_trips_and_explains_like_the_catalogue(tmp_path, capsys):
    from kvhit.layouts import to_json

    path = tmp_path / "dsv4.json"
    path.write_text(json.dumps(to_json(catalogue()["dsv4_report"])))
    assert main(["explain", str(path), "46240", "--speculative", "drop", "--policy", "historical", "--cache", "dense",
                 "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["policies"][0]["hit"] == 16384


def test_a_layout_capped_by_auxiliary_outputs_is_explained_with_its_cap(tmp_path, capsys):
    """``aux_cap_group`` survives the file format and the settings, and the explanation names the cap where it
    binds: full attention 1600 (MTP) + Mamba 1600 at hash unit 160, drop, N = 11910 on what its first request
    left; the reference's scan starts at the cap (the full-attention group's 7 whole blocks) and
    ``vllm_0_33``'s coordinator too, and the hits are refimpl's on that layout."""
    from kvhit.layouts import to_json

    data = {"name": "moe_mtp_aux", "prefix_match_unit": 160, "aux_cap_group": 0,
            "groups": [{"kind": "full", "block_size": 1600, "eagle": True}, {"kind": "mamba", "block_size": 1600}]}
    path = tmp_path / "aux.json"
    path.write_text(json.dumps(data))
    layout, _ = load(str(path))
    assert layout.aux_cap_group == 0 and to_json(layout)["aux_cap_group"] == 0
    args = [str(path), "11910", "--speculative", "drop", "--num-speculative-tokens", "1", "--compare"]
    assert main(["explain", *args, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    jsonschema.validate(report, SCHEMA)
    hits = {t["policy"]: t for t in report["policies"]}
    sizes = refimpl.derive_sizes(layout, speculation("drop", 1, False))
    for policy in ("reference", "vllm_0_33"):
        assert hits[policy]["hit"] == refimpl.repeat_hits(sizes, 11910, 0, refimpl.policy_rules(policy), 1)[0]
    assert hits["reference"]["top_is"] == "the auxiliary outputs' cap" and hits["reference"]["top"] == 11200
    assert hits["vllm_0_33"]["aux_cap"] == 11200
    assert main(["explain", *args]) == 0
    text = capsys.readouterr().out
    assert "every lookup capped at KV-cache group 0's leading whole blocks" in text
    assert "the auxiliary outputs cap it at 11200" in text


@pytest.mark.parametrize("args, message", [
    (["dsv4_report", "46240", "--retention-interval", "100"],
     "retention interval 100 must be None, 0 or a positive multiple of the scheduler block 16384"),
    (["full16", "100", "--retention-interval", "16"], "retention interval 16 needs a sliding-window or Mamba group"),
    (["full16", "100", "--retention-interval", "none"], "retention interval None needs a sliding-window or Mamba"),
    (["qwen3next", "100", "--cache", "dense", "--cached", "1,2,3"], "the layout has 2 spec groups"),
    (["qwen3next", "100", "--cache", "written", "--cached", "50"], "use it with --cache dense"),
    (["qwen3next", "100", "--sibling", "100"], "the sibling must be longer than the prompt (100 tokens)"),
    (["qwen3next", "100", "--cache", "dense", "--sibling", "200"], "--sibling needs the written cache"),
    (["qwen3next", "100", "--cache", "dense", "--retention-interval", "3200"],
     "--retention-interval 3200 needs the written cache"),
    (["qwen3next", "0"], "at least one prompt token"),
    (["qwen3next", "100", "--prefix-match-unit", "300"], "not a multiple of the hash unit 300"),
    (["full16", "100", "--speculative", "none", "--num-speculative-tokens", "2"], "need an EAGLE-family mode"),
])
def test_bad_settings_are_refused_with_the_problem_named(capsys, args, message):
    assert main(["explain", *args]) == 2
    assert message in capsys.readouterr().err


def test_chunked_layout_is_explained_on_the_dense_cache(capsys):
    assert main(["explain", "chunked64", "300", "--cache", "dense"]) == 0
    assert "--cache dense: every state retained" in capsys.readouterr().out


def test_explain_without_compare_imports_neither_z3_nor_the_proofs():
    """Only ``--compare`` evaluates the claims of ``kvhit.proofs``, and it replays them without the solver: both
    run where only the wheel is installed (z3 is the ``prove`` extra)."""
    code = ("import sys; from kvhit.cli import main; main(sys.argv[1:]); "
            "print(sorted(m for m in sys.modules if m == 'z3' or m.startswith('kvhit.proofs')), file=sys.stderr)")
    args = ["explain", "qwen3next", "2000", "--speculative", "drop"]
    plain = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=120)
    assert plain.returncode == 0 and plain.stderr.strip() == "[]", plain.stderr
    compared = subprocess.run([sys.executable, "-c", code, *args, "--compare"], capture_output=True, text=True,
                              timeout=120)
    assert compared.returncode == 0 and "'kvhit.proofs.concrete'" in compared.stderr, compared.stderr
    assert "'z3'" not in compared.stderr, compared.stderr
