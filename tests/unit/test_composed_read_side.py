"""The default run composes ``eagle_loses_at_most_one_block_beyond_alignment`` for ``vllm_0_33_repaired``
(``Invariant.by_lemma`` with the derived lemma ``SAME_HIT``; README, "Read-side claims of vllm_0_33_repaired,
composed"): the reference's verdict, where both policies' hits are shown to be the one largest served
aligned length within the cap, on the configuration and on its twin without speculation. Compared here with
the claim checked whole, shown to decline for a policy whose hit is another, and its bookkeeping."""

from dataclasses import replace

import pytest

from kvhit.proofs import runner
from kvhit.proofs.domains import reference_only
from kvhit.proofs.model import SAME_HIT, SAME_HIT_PREMISES

from .default_checks import CFGS, checks as _checks, index as _index

CLAIM = "eagle_loses_at_most_one_block_beyond_alignment"


def _premises(index, policy):
    twin = runner.speculation_twin(CFGS[index], CFGS)
    return [(premise, who, j) for j in (index, twin) for premise in SAME_HIT_PREMISES
            for who in ("reference", policy)]


def _compose(done, policy="vllm_0_33_repaired"):
    """The composed row of ``CLAIM`` for ``policy`` from the checks ``done`` (its own whole check left out)."""
    results = [(task + (None,), verdict, 0.0, cex, 0) for task, (verdict, cex) in done.items()
               if task[1] != policy or task[0] != CLAIM]
    return runner.compose(results, CFGS).get((CLAIM, policy))


def test_the_default_run_composes_the_claim_and_checks_its_premises_whole():
    tasks = runner.tasks()
    assert not [t for t in tasks if t[0] == CLAIM and t[1] == "vllm_0_33_repaired" and t[3] is None]
    for premise in SAME_HIT_PREMISES:
        for policy in ("reference", "vllm_0_33_repaired"):
            on = {t[2] for t in tasks if t[0] == premise and t[1] == policy}
            judged = {i for i, c in enumerate(CFGS) if not c.write_side
                      and (policy == "reference" or not reference_only(c, extended=False))}
            assert judged <= on, (premise, policy)
    # where the run checks only the reference (a HEAVY layout), nothing is composed for the policy
    heavy = {i for i, c in enumerate(CFGS) if reference_only(c, extended=False)}
    assert heavy and not {t[2] for t in tasks if t[1] == "vllm_0_33_repaired"} & heavy
    twin = CFGS[runner.speculation_twin(CFGS[_index("qwen3next dcp2 drop Lp=1")], CFGS)]
    assert twin.label == "qwen3next dcp2 none" and not twin.write_side


@pytest.mark.parametrize("label", ["qwen3next drop Lp=1", "gemma drop Lp=1", "full16 lookahead Lp=2 mtp2"])
def test_the_composed_verdict_is_the_whole_checks_where_that_finishes(label):
    index = _index(label)
    tasks = [(CLAIM, "vllm_0_33_repaired", index), (CLAIM, "reference", index)] + _premises(
        index, "vllm_0_33_repaired")
    done = _checks(tasks)
    assert {verdict for verdict, _ in done.values()} == {"PROVED"}
    row = _compose(done)
    assert (row.verdict, row.configs, row.composed_from) == ("PROVED", [label], f"reference + {SAME_HIT}")


def test_a_policy_whose_hit_is_another_fails_a_premise_where_it_fails_the_claim(monkeypatch):
    """Non-vacuity: vllm_0_33 loses a second block in drop mode on one full-attention group (F2), so the claim
    checked whole is REFUTED for it where the reference's is PROVED; its hit is not the longest served one
    there, so the composition declines (UNKNOWN) rather than hand it the reference's PROVED."""
    index = _index("full16 drop Lp=1")
    tasks = [(CLAIM, "vllm_0_33", index), (CLAIM, "reference", index)] + _premises(index, "vllm_0_33")
    done = _checks(tasks)
    assert (done[tasks[0]][0], done[tasks[1]][0]) == ("REFUTED", "PROVED")
    assert done[("hit_is_the_longest_valid", "vllm_0_33", index)][0] == "REFUTED"
    # the same composition, asked of vllm_0_33
    claim = replace(runner.BY_NAME[CLAIM], by_lemma=(("vllm_0_33", SAME_HIT),))
    monkeypatch.setattr(runner, "INVARIANTS", (claim,))
    row = _compose(done, policy="vllm_0_33")
    assert row.verdict == "UNKNOWN"
    assert "hit_is_the_longest_valid / vllm_0_33, which is REFUTED on full16 drop Lp=1" in row.counterexample["error"]


def test_a_premise_proved_only_within_the_unrolled_loop_or_missing_on_the_twin_does_not_count():
    index = _index("qwen3next drop Lp=1")
    tasks = _premises(index, "vllm_0_33_repaired") + [(CLAIM, "reference", index)]
    proved = {t: ("PROVED", None) for t in tasks}
    assert _compose(proved).verdict == "PROVED"
    twin = runner.speculation_twin(CFGS[index], CFGS)
    bounded = {**proved, ("hit_is_the_longest_valid", "vllm_0_33_repaired", twin):
               ("PROVED", {"loop": "runs within 3 passes"})}
    row = _compose(bounded)
    assert row.verdict == "UNKNOWN" and "within unrolled passes only on qwen3next none" in row.counterexample["error"]
    missing = {t: v for t, v in proved.items() if not (t[0] == "hit_loop_terminates" and t[2] == twin
                                                       and t[1] == "vllm_0_33_repaired")}
    row = _compose(missing)
    assert row.verdict == "UNKNOWN" and "hit_loop_terminates / vllm_0_33_repaired, which is not checked" in \
        row.counterexample["error"]
    refuted = {**proved, (CLAIM, "reference", index): ("REFUTED", {"N": 9})}
    row = _compose(refuted)
    assert (row.verdict, row.counterexample) == ("REFUTED", {"N": 9})


def test_nothing_is_composed_for_the_policy_where_only_the_reference_is_checked():
    """A HEAVY layout's read side is checked for the reference only: the composition gives the repaired policy
    no verdict there (its premises are not checked), rather than an UNKNOWN that fails the run or a PROVED
    it has not earned."""
    index = _index("dsv4_cuda drop Lp=1")
    done = {(CLAIM, "reference", index): ("PROVED", None)}
    for premise, who, j in _premises(index, "vllm_0_33_repaired"):
        if who == "reference":
            done[(premise, who, j)] = ("PROVED", None)
    assert _compose(done) is None or "dsv4_cuda drop Lp=1" not in _compose(done).configs
