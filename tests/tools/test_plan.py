"""kvhit plan: the ranking is what the refimpl gives when each setting is evaluated directly."""

import concurrent.futures
import json

import pytest

from kvhit import plan, refimpl
from kvhit.cli import main
from kvhit.explain import speculation
from kvhit.layouts import catalogue, configure
from kvhit.refimpl import CacheState, Speculation

POLICIES = ("reference", "vllm_0_33", "historical")


def _direct_mean(layout, spec, workload, policy):
    """Expected cached tokens per request through refimpl's public ``hit`` with a plain up_to cache."""
    groups = len(refimpl.derive_sizes(layout, spec).groups)
    return sum(refimpl.hit(layout, spec, n, CacheState.up_to([p] * groups), policy) for n, p in workload) / len(workload)


def _direct_written(layout, spec, workload, policy, interval):
    """Expected cached tokens and retained states per request, each request reading what its shared prefix
    left as a prompt of its own: refimpl.request_writes, written_cache and the public ``hit``."""
    rules = refimpl.policy_rules(policy)
    sizes = refimpl.derive_sizes(layout, spec)
    hits = states = 0
    for n, p in workload:
        left = refimpl.request_writes(sizes, p, interval, rules)
        hits += refimpl.hit(layout, spec, n, refimpl.written_cache(left), policy)
        states += sum(refimpl.retained_states(g) for g in left if g.kind.value in ("swa", "mamba"))
    return hits / len(workload), states / len(workload)


@pytest.mark.parametrize("name, spec, workload_args", [
    ("qwen3next", speculation("drop", 2, True), ("uniform:2000:30000", "uniform:0:3000", 60, 1)),
    ("gemma", speculation("drop", 1), ("uniform:100:5000", "fixed:0", 100, 2)),
    ("three_kind", speculation("lookahead", 1), ("normal:12000:4000", "choice:0,500", 40, 3)),
])
def test_top_setting_really_gives_the_most_cached_tokens(name, spec, workload_args):
    workload = plan.synthetic_workload(*workload_args)
    cands = plan.evaluate(plan.candidates(catalogue()[name], spec), workload)
    for policy in POLICIES:
        ranked, _ = plan.rank(cands, policy)
        direct = {s.label: _direct_written(s.layout, s.speculation, workload, policy, 0) for s in ranked}
        assert direct[ranked[0].label][0] == max(d[0] for d in direct.values())
        for s in ranked:
            assert (s.mean[policy], s.states[policy]) == pytest.approx(direct[s.label])
        assert [direct[s.label][0] for s in ranked] == sorted((d[0] for d in direct.values()), reverse=True)


@pytest.mark.parametrize("name, spec, prefix", [
    ("qwen3next", speculation("drop", 2, True), "uniform:2000:30000"),  # 18 settings: a task per pair
    ("dsv4_report", speculation("drop", 1), "uniform:8000:70000"),  # 2 settings: ranges of P split them
])
def test_worker_processes_give_the_numbers_of_one_process(monkeypatch, name, spec, prefix):
    """``evaluate`` with two forked workers (the size threshold lowered so this small workload uses them)
    fills in the same means, retained states, past-hash counts and replay boundaries as in one process,
    for the first stage and for the retention stage that reuses the replay boundaries, whether each
    (setting, policy) is one task or is split into ranges of ``P``."""
    workload = plan.synthetic_workload(prefix, "choice:0,0,700,2000", 40, 5)  # repeated P, N: counts
    workload += workload[:7] + [(n + 1, p) for n, p in workload[:5]]  # one P, several N
    pools = []

    class Pool(concurrent.futures.ProcessPoolExecutor):
        def __init__(self, workers, **kwargs):
            pools.append(workers)
            super().__init__(workers, **kwargs)

    monkeypatch.setattr(concurrent.futures, "ProcessPoolExecutor", Pool)
    monkeypatch.setattr(plan.evaluation, "PARALLEL_MIN_WORK", 0)  # the module evaluate reads it from
    results = []
    for jobs in (1, 2):
        cands = plan.evaluate(plan.candidates(catalogue()[name], spec), workload, jobs=jobs)
        added = plan.with_retention(cands, plan.rank(cands, "reference")[0], 2)
        plan.evaluate(cands, workload, added, jobs=jobs)
        results.append(([(s.label, s.mean, s.states, s.past_hashes) for s in cands.settings],
                        {k: dict(v) for k, v in cands.replay.items()}))
    assert pools == [2, 2]  # jobs=1 made no pool, jobs=2 one per stage
    assert results[0] == results[1]
    distinct = len({p for _, p in workload})
    assert len(results[0][0]) > 5 and all(len(v) == distinct for v in results[0][1].values())


def test_the_table_shows_what_evaluating_every_policy_for_every_setting_shows(capsys):
    """``kvhit plan`` evaluates the policies it does not rank by only for the rows it prints: its table is
    the one a full evaluation (every setting, retention interval and policy) renders, and --json, which
    lists every setting, has every policy's numbers."""
    args = ["qwen3next", "--speculative", "drop", "--num-speculative-tokens", "2", "--multi-module-mtp",
            "--shared-prefix", "uniform:2000:30000", "--suffix", "choice:0,900", "--requests", "60"]
    workload = plan.synthetic_workload("uniform:2000:30000", "choice:0,900", 60, 0)
    for by in ("reference", "historical"):
        cands = plan.evaluate(plan.candidates(catalogue()["qwen3next"], speculation("drop", 2, True)), workload)
        plan.evaluate(cands, workload, plan.with_retention(cands, plan.rank(cands, by)[0], 3))
        full = plan.rank(cands, by)
        assert main(["plan", *args, "--top", "4", "--rank-by", by]) == 0
        shown = capsys.readouterr()
        assert shown.out.rstrip("\n") == plan.render(full, workload, by, 4)
        assert f"under {by}, and the other two policies for the 4 shown" in shown.err
        assert main(["plan", *args, "--json", "--rank-by", by]) == 0
        assert json.loads(capsys.readouterr().out) == json.loads(json.dumps(plan.to_json(full, workload, by)))
    for flag, value, message in [("--top", "0", "--top must be positive, got 0"),
                                 ("--retention-top", "-1", "--retention-top must be 0 or more, got -1")]:
        assert main(["plan", *args, flag, value]) == 2
        assert message in capsys.readouterr().err


def test_jobs_must_be_positive():
    with pytest.raises(ValueError, match="jobs must be at least 1, got 0"):
        plan.evaluate(plan.candidates(catalogue()["full16"], speculation("none")), [(100, 100)], jobs=0)


def test_retention_intervals_are_tried_on_the_best_settings_and_ranked_with_their_cost():
    workload = [(n, n) for n in range(1000, 30000, 997)] + [(n + 1700, n) for n in range(2000, 20000, 1511)]
    layout, spec = catalogue()["three_kind"], speculation("drop", 1)
    cands = plan.evaluate(plan.candidates(layout, spec, retention_intervals=[None, 0, 2]), workload)
    first, _ = plan.rank(cands, "vllm_0_33")
    added = plan.with_retention(cands, first, 2, explicit=True)
    assert [s.label for s in added] == [first[0].label.replace("R 0", "R none"),
                                         first[0].label.replace("R 0", "R 3200"),
                                         first[1].label.replace("R 0", "R none"),
                                         first[1].label.replace("R 0", "R 3200")]
    plan.evaluate(cands, workload, added)
    ranked, _ = plan.rank(cands, "vllm_0_33")
    for s in added:
        for policy in POLICIES:
            assert (s.mean[policy], s.states[policy]) == pytest.approx(
                _direct_written(s.layout, s.speculation, workload, policy, s.retention))
    means = [s.mean["vllm_0_33"] for s in ranked]
    assert means == sorted(means, reverse=True)
    dense = [s for s in added if s.retention is None][0]
    sparse = [s for s in added if s.retention == 0 or s.retention == 3200]
    assert all(dense.states["vllm_0_33"] > s.states["vllm_0_33"] for s in sparse[:1])


def test_a_retention_interval_the_spec_refuses_is_listed_when_asked_for_and_skipped_by_default():
    workload = [(1000, 1000)]
    cands = plan.evaluate(plan.candidates(catalogue()["full16"], speculation("drop", 1)), workload)
    assert plan.with_retention(cands, cands.settings, 1) == [] and cands.rejected == []
    cands = plan.evaluate(plan.candidates(catalogue()["full16"], speculation("drop", 1),
                                          retention_intervals=[None, 2]), workload)
    plan.with_retention(cands, cands.settings, 1, explicit=True)
    assert cands.settings[0].label == "pmu none, lookahead, R 0"
    assert ("pmu none, lookahead, R none", "retention interval None needs a sliding-window or Mamba group; this layout "
            "has none, so use 0 (vLLM raises the same)") in cands.rejected
    assert any(label == "pmu none, lookahead, R 32" and "needs a sliding-window or Mamba group" in why
               for label, why in cands.rejected)


@pytest.mark.parametrize("policy", POLICIES)
def test_dense_cache_ranks_as_before(policy):
    workload = plan.synthetic_workload("uniform:2000:30000", "uniform:0:3000", 200, 1)
    cands = plan.evaluate(plan.candidates(catalogue()["qwen3next"], speculation("drop", 2, True), cache="dense"),
                          workload)
    assert cands.intervals == [] and all(s.retention == "dense" for s in cands.settings)
    ranked, _ = plan.rank(cands, policy)
    direct = {s.label: _direct_mean(s.layout, s.speculation, workload, policy) for s in ranked}
    for s in ranked:
        assert s.mean[policy] == pytest.approx(direct[s.label])
    assert [direct[s.label] for s in ranked] == sorted(direct.values(), reverse=True)


def test_block_size_candidates_follow_the_operator_groups():
    workload = [(n, n) for n in range(100, 3000, 37)]
    layout = catalogue()["llama_eagle"]
    cands = plan.evaluate(plan.candidates(layout, speculation("drop", 1), block_sizes=[16, 32, 64],
                                          operator_groups=(0, 1), cache="dense"), workload)
    blocks = {s.block_size: s.sizes.effective_blocks for s in cands.settings}
    assert blocks[32] == (32, 32) and blocks[64] == (64, 64)
    for s in cands.settings:
        direct_layout = configure(layout, block_size=s.block_size, operator_groups=(0, 1))
        assert s.mean["vllm_0_33"] == pytest.approx(
            _direct_mean(direct_layout, Speculation(s.mode, 1), workload, "vllm_0_33"))


def test_block_sizes_without_operator_groups_is_refused(capsys):
    assert main(["plan", "qwen3next", "--shared-prefix", "fixed:100", "--block-sizes", "16,32"]) == 2
    assert "no group of this layout follows --block-size" in capsys.readouterr().err


def test_impossible_settings_are_listed_as_rejected_with_the_domain_reason():
    cands = plan.candidates(catalogue()["dsv4_report"], speculation("drop", 1), prefix_match_units=["none", 8])
    assert [s.label for s in cands.settings] == ["pmu none, lookahead, R 0", "pmu none, drop, R 0"]
    assert ("pmu 8, drop, R 0", "group 5: effective block 4 is not a multiple of the hash unit 8") in cands.rejected


def test_settings_with_identical_sizes_are_evaluated_once():
    cands = plan.candidates(catalogue()["qwen3next"], speculation("none"), prefix_match_units=["none", 1600, 160])
    assert [s.label for s in cands.settings] == ["pmu none, none, R 0", "pmu 160, none, R 0"]
    assert cands.settings[0].same_as == ["pmu 1600, none, R 0"]


def test_plan_writes_the_png_and_prints_the_table(tmp_path, capsys):
    png = tmp_path / "plan.png"
    assert main(["plan", "dsv4_report", "--speculative", "drop", "--shared-prefix", "uniform:8000:70000",
                 "--requests", "100", "--plot", str(png)]) == 0
    out = capsys.readouterr().out
    assert "pmu none, lookahead, R 0" in out and "pmu none, drop, R 16384" in out and "states" in out
    assert "not evaluated" not in out
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    import matplotlib.image

    height, width = matplotlib.image.imread(str(png)).shape[:2]
    assert width > 500 and height > 500


def test_workload_file_is_read_and_bad_lines_are_named(tmp_path):
    good = tmp_path / "w.txt"
    good.write_text("# prompts\n1000\n2000 1500  # shares 1500\n\n")
    assert plan.read_workload(str(good)) == [(1000, 1000), (2000, 1500)]
    for text, message in [("12 x\n", "w.txt:1: expected integers"), ("100 200\n", "between 0 and the prompt"),
                          ("0\n", "at least one token"), ("# nothing\n", "no requests"), ("1 2 3\n", "'N' or 'N P'")]:
        good.write_text(text)
        with pytest.raises(ValueError, match=message):
            plan.read_workload(str(good))


def test_synthetic_workload_is_seeded_and_checks_its_distribution():
    assert plan.synthetic_workload("uniform:10:20", "fixed:5", 50, 7) == plan.synthetic_workload(
        "uniform:10:20", "fixed:5", 50, 7)
    assert all(n == p + 5 and 10 <= p <= 20 for n, p in plan.synthetic_workload("uniform:10:20", "fixed:5", 50, 7))
    with pytest.raises(ValueError, match="cannot read distribution 'gauss:1'"):
        plan.synthetic_workload("gauss:1", "fixed:0", 5, 0)
