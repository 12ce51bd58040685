"""The reference's dominance claim, composed where it is not checked whole (``Invariant.lemmas``,
``runner.compose_by_lemmas``; README, "Dominance, composed"): PROVED on a configuration when vllm_0_33's
cache serves nothing the reference's does not there, vllm_0_33's hit is valid and capped and the reference's
is the longest valid on the configuration's read-side twin. Compared here with the claim checked whole where
that finishes in seconds, shown to decline for the known-bad variant, and its bookkeeping."""

from kvhit.proofs import runner
from kvhit.proofs.domains import STREAM_CLAIMS_EXTENDED

from .default_checks import CFGS, checks, index as _index

CLAIM = "reference_never_below_vllm"
SERVES = "vllm_0_33_cache_serves_nothing_the_policy_cache_does_not"
WRITE = "qwen3next none R=0"  # whole: a few seconds
MTP2 = "qwen3next drop Lp=2 mtp2 R=0"  # the Qwen3-Next report's setting


def _checks(*tasks):
    """The checks of ``tasks``, in the order given."""
    done = checks(tasks)
    return [done[t] for t in tasks]


def _lemma_tasks(write, policy="reference"):
    twin = runner.read_twin(CFGS[write], CFGS)
    return [(SERVES, policy, write)] + [(inv, pol, twin) for inv, pol in runner.BY_NAME[CLAIM].lemmas[1:]]


def _compose(tasks_and_verdicts):
    verdicts = {}
    results = [(task + (None,), verdict, 0.0, cex, 0) for task, (verdict, cex) in tasks_and_verdicts]
    runner.compose_by_lemmas(verdicts, results, CFGS)
    return verdicts.get((CLAIM, "reference"))


def test_the_lemmas_are_the_claims_rows_and_the_twin_is_the_read_side():
    assert runner.BY_NAME[CLAIM].lemmas[0] == (SERVES, "reference")
    twin = CFGS[runner.read_twin(CFGS[_index(MTP2)], CFGS)]
    assert twin.label == "qwen3next drop Lp=1" and not twin.write_side


def test_the_composed_verdict_is_the_whole_checks_where_that_finishes():
    write = _index(WRITE)
    tasks = [(CLAIM, "reference", write)] + _lemma_tasks(write)
    done = _checks(*tasks)
    assert [v for v, _ in done] == ["PROVED"] * len(tasks)
    row = _compose(list(zip(tasks[1:], done[1:])))
    assert (row.verdict, row.configs) == ("PROVED", [f"{WRITE} (composed)"])
    # With the whole verdict beside it, nothing is composed and nothing is contradicted.
    row = _compose(list(zip(tasks, done)))
    assert (row.verdict, row.configs) == ("PROVED", [])


def test_the_known_bad_variant_fails_the_lemma_where_it_fails_the_claim():
    """Non-vacuity through the composition: the reference without its junction loses a shared system prompt
    (the claim checked whole is REFUTED), and the cache lemma is REFUTED for it too: vllm_0_33 keeps state at
    the junction, which it does not."""
    write = _index(WRITE)
    whole, lemma = _checks((CLAIM, "without_junction", write), (SERVES, "without_junction", write))
    assert (whole[0], lemma[0]) == ("REFUTED", "REFUTED")


def test_a_lemma_not_proved_makes_the_composed_verdict_unknown():
    tasks = _lemma_tasks(_index(WRITE))
    proved = [(t, ("PROVED", None)) for t in tasks]
    row = _compose([(tasks[0], ("REFUTED", {"N": 5}))] + proved[1:])
    assert row.verdict == "UNKNOWN" and SERVES in row.counterexample["error"]
    row = _compose(proved[:-1] + [(tasks[-1], ("REFUTED", {"N": 5}))])
    assert row.verdict == "UNKNOWN" and "hit_is_the_longest_valid" in row.counterexample["error"]
    assert _compose(proved[:-1]) is None  # a lemma's row not run (`--invariant`): nothing is composed
    assert _compose(proved[1:]) is None
    # a lemma PROVED only for the runs of vLLM's loop within its unrolled passes (kvhit.proofs.loop) does not count
    row = _compose(proved[:1] + [(tasks[1], ("PROVED", {"loop": "runs within 3 passes"}))] + proved[2:])
    assert row.verdict == "UNKNOWN"
    assert f"{tasks[1][0]} / {tasks[1][1]} (PROVED within unrolled passes only)" in row.counterexample["error"]
    assert _compose(proved).verdict == "PROVED"


def test_a_composed_proof_beside_a_whole_refutation_is_an_error():
    write = _index(WRITE)
    tasks = _lemma_tasks(write)
    row = _compose([((CLAIM, "reference", write), ("REFUTED", {"N": 5}))] + [(t, ("PROVED", None)) for t in tasks])
    assert row.verdict == "ERROR" and "checked whole REFUTED" in row.counterexample["error"]


def test_the_default_run_composes_the_claim_but_where_f1_breaks_it_and_checks_the_known_bad_variant_whole():
    """Whole for the known-bad variant (non-vacuity: one refutation, on the report's layout in drop mode with
    one MTP module, ``runner._write_witness``), and for the reference only where vllm_0_33's hit past the
    hashes (F1) can fail the composition's lemmas: chunked local attention, and the layouts without full
    attention under lookahead hashes. The lemma runs on every write-side configuration but the layouts whose
    three-request claims are --extended's."""
    whole = [t for t in runner.tasks() if t[0] == CLAIM and t[3] is None]
    bad = [t for t in whole if t[1] == "without_junction"]
    assert [CFGS[t[2]].label for t in bad] == ["qwen3next drop Lp=1 R=0"]
    reference = [t for t in whole if t[1] == "reference"]
    lookahead = [f"{layout} lookahead {s} R={r}" for layout, every in (("swa16w64", 32), ("mamba16", 32))
                 for s in ("Lp=1", "Lp=2 mtp2") for r in (None, 0, every)]
    assert sorted(CFGS[t[2]].label for t in reference) == sorted([
        "chunked64 lookahead Lp=1 R=0", "chunked64 lookahead Lp=2 mtp2 R=0", "chunked64 none R=0",
        "llama4 none R=0"] + lookahead)
    assert {t[1] for t in whole} == {"without_junction", "reference"}
    lemma_on = {t[2] for t in runner.tasks() if t[:2] == (SERVES, "reference")}
    assert lemma_on == {i for i, c in enumerate(CFGS) if c.write_side
                        and c.layout.name not in STREAM_CLAIMS_EXTENDED}
    assert {c.layout.name for c in CFGS if c.write_side} & set(STREAM_CLAIMS_EXTENDED)


def test_a_composed_verdict_of_the_reference_carries_over_to_the_repaired_policy():
    """vllm_0_33_repaired's verdict is composed from the reference's (``Invariant.by_lemma``), which is itself
    composed here: the policy's lemma makes the reference's composed verdict its own, as a checked one."""
    write = _index(WRITE)
    same = ("the_policy_serves_and_writes_as_the_reference", "vllm_0_33_repaired", write)
    for lemma_verdict in ("PROVED", "REFUTED"):
        done = [(t, (lemma_verdict if t[0] == SERVES else "PROVED", None)) for t in _lemma_tasks(write)]
        done.append((same, ("PROVED", None)))
        results = [(task + (None,), verdict, 0.0, cex, 0) for task, (verdict, cex) in done]
        composed = runner.compose_by_lemmas({}, results, CFGS)
        assert [(r[0], r[1]) for r in composed] == [((CLAIM, "reference", write, None),
                                                     "PROVED" if lemma_verdict == "PROVED" else "UNKNOWN")]
        row = runner.compose(results + composed, CFGS)[(CLAIM, "vllm_0_33_repaired")]
        assert (row.verdict, row.configs) == (composed[0][1], [WRITE])
