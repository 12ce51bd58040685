"""The default run's stream claims of ``vllm_0_33_repaired`` are composed (``Invariant.by_lemma``): the
reference's verdict on a configuration, where the lemma ``the_policy_serves_and_writes_as_the_reference`` is
PROVED for the policy there. Here the composition is compared with the claim checked whole, where that
finishes in seconds, and shown to decline where the lemma fails."""

import pytest

from kvhit.proofs import runner
from kvhit.proofs.domains import reference_only, write_configs
from kvhit.proofs.model import check, isolated_map
from kvhit.spec.policy import ALL_POLICIES

JUNCTION = "a_shared_prefix_is_kept_at_the_junction"
LEMMA = "the_policy_serves_and_writes_as_the_reference"
CONFIG = "qwen3next none R=0"  # the whole check of the repaired policy: about 20 s, 205 M units
# Every claim the default run composes for vllm_0_33_repaired.
CLAIMS = (JUNCTION, "reference_never_below_vllm", "scheduler_and_mask_boundaries_agree",
          "second_repeat_is_stable")


def _check(task):
    invariant, policy = task
    config = next(c for c in write_configs(extended=False) if c.label == CONFIG)
    verdict, _, cex, _ = check(runner.BY_NAME[invariant], ALL_POLICIES[policy], config)
    return task, (verdict, cex)


def _checks(*tasks):
    """``_check`` of each task, each in a fresh process, two at a time, in the order given."""
    done = dict(isolated_map(_check, list(tasks), 2))
    return [done[t] for t in tasks]


def _results(verdicts):
    """``runner.run``'s result rows for one configuration (index 0 of ``cfgs``)."""
    return [((inv, policy, 0, None), verdict, 0.0, cex, 0) for (inv, policy), (verdict, cex) in verdicts.items()]


def _composed(verdicts, label=CONFIG):
    cfgs = [next(c for c in write_configs(extended=False) if c.label == label)]
    return runner.compose(_results(verdicts), cfgs)


def test_the_default_run_composes_each_claim_with_the_lemma_and_checks_none_of_them_whole():
    composed = [inv.name for inv in runner.INVARIANTS if ("vllm_0_33_repaired", LEMMA) in inv.by_lemma]
    assert sorted(composed) == sorted(CLAIMS)
    assert not [t for t in runner.tasks() if t[0] in CLAIMS and t[1] == "vllm_0_33_repaired" and t[3] is None]
    cfgs = runner._configs()
    lemma_on = {t[2] for t in runner.tasks() if t[0] == LEMMA}
    claim_on = {t[2] for t in runner.tasks() if t[0] in CLAIMS and t[1] == "reference" and t[3] is None}
    # every configuration composed has its lemma checked; on a HEAVY layout the run says nothing of the policy
    only_reference = {i for i in claim_on if reference_only(cfgs[i], extended=False)}
    assert {cfgs[i].layout.name for i in only_reference} == {"dsv4_cuda", "dsv4_report", "three_kind"}
    assert claim_on - only_reference <= lemma_on
    assert not only_reference & lemma_on



@pytest.mark.parametrize("claim", [JUNCTION, "scheduler_and_mask_boundaries_agree", "second_repeat_is_stable"])
def test_the_composed_verdict_is_the_whole_checks_where_that_finishes(claim):
    tasks = ((claim, "vllm_0_33_repaired"), (claim, "reference"), (LEMMA, "vllm_0_33_repaired"))
    whole, reference, lemma = _checks(*tasks)
    assert (whole[0], reference[0], lemma[0]) == ("PROVED", "PROVED", "PROVED")
    composed = _composed({(claim, "reference"): reference, (LEMMA, "vllm_0_33_repaired"): lemma})
    row = composed[(claim, "vllm_0_33_repaired")]
    assert (row.verdict, row.configs, row.composed_from) == ("PROVED", [CONFIG], f"reference + {LEMMA}")


def test_the_lemma_fails_for_a_policy_the_reference_verdict_does_not_speak_for():
    """Non-vacuity: the reference without its junction fails the junction claim checked whole, and the lemma
    fails for it too, so its verdict could never be composed from the reference's."""
    whole, lemma = _checks((JUNCTION, "without_junction"), (LEMMA, "without_junction"))
    assert whole[0] == "REFUTED" and lemma[0] == "REFUTED"
    assert lemma[1]["replayed"]["junctions"][0] != lemma[1]["replayed"]["junctions"][1], lemma[1]


def test_a_failed_lemma_makes_the_composed_verdict_unknown_and_a_refutation_carries_over():
    proved, refuted = ("PROVED", None), ("REFUTED", {"N": 7, "replayed": {"third_hit": 0}})
    row = _composed({(JUNCTION, "reference"): proved, (LEMMA, "vllm_0_33_repaired"): refuted})[
        (JUNCTION, "vllm_0_33_repaired")]
    assert row.verdict == "UNKNOWN" and LEMMA in row.counterexample["error"]
    row = _composed({(JUNCTION, "reference"): refuted, (LEMMA, "vllm_0_33_repaired"): proved})[
        (JUNCTION, "vllm_0_33_repaired")]
    assert (row.verdict, row.counterexample, row.refuted) == ("REFUTED", refuted[1], 1)
    assert runner.compose(_results({(JUNCTION, "reference"): proved}), []) == {}  # no lemma run: nothing


def test_a_lemma_proved_only_within_the_unrolled_loop_does_not_count():
    """A lemma whose PROVED covers vLLM's loop only within its unrolled passes (``kvhit.proofs.loop``) does not
    carry the reference's verdict over: the composition declines, as for :data:`~kvhit.proofs.model.SAME_HIT`."""
    bounded = ("PROVED", {"loop": "runs within 3 passes"})
    row = _composed({(JUNCTION, "reference"): ("PROVED", None), (LEMMA, "vllm_0_33_repaired"): bounded})[
        (JUNCTION, "vllm_0_33_repaired")]
    assert row.verdict == "UNKNOWN"
    assert row.counterexample["error"] == f"{LEMMA} is PROVED within unrolled passes only on {CONFIG}"


def test_the_lemma_sees_a_write_side_that_differs_from_the_references():
    """Part (b) of the lemma can fail on its own: vllm_0_33_repaired with retention 0 read as dense (vLLM's
    sparse retention rule off) serves as the reference does (part (a)) but writes more."""
    from dataclasses import replace

    config = next(c for c in write_configs(extended=False) if c.label == CONFIG)
    rules = replace(ALL_POLICIES["vllm_0_33_repaired"], sparse_zero=False, name="repaired_zero_dense")
    verdict, _, cex, _ = check(runner.BY_NAME[LEMMA], rules, config)
    assert verdict == "REFUTED"
    hits, junctions = cex["replayed"]["hits"], cex["replayed"]["junctions"]
    assert hits[0] == hits[1] and junctions[0] == junctions[1], cex


def test_extended_checks_each_composed_claim_whole(monkeypatch):
    monkeypatch.setattr(runner, "EXTENDED", True)
    monkeypatch.setattr(runner, "_CONFIGS", None)
    whole = {t[0] for t in runner.tasks() if t[1] == "vllm_0_33_repaired" and t[3] is None}
    assert set(CLAIMS) <= whole and LEMMA not in whole
