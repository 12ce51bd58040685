"""The reference's write side under auxiliary outputs' cap at hash granularity (``full1600e_mamba1600_pmu160_aux``:
full attention holding the MTP layer, read at 160-token hash units, caps every lookup at its leading whole
1600-token blocks; ``refimpl.resume_tail``).

A request keeps one partial Mamba tail. Where a resend's capped resume point is a block end or 0, the reference
keeps it where vLLM keeps its prompt checkpoint (``Rules.checkpoint_tail_when_capped``); at the capped resume
point instead (``tail_at_capped_resume``, the reference before the rule), a prompt that later shares more of the
prompt, its cap raised by another request's blocks, finds vLLM's tail where the reference kept none.

``reference_never_below_vllm`` is composed here (README, "Dominance, composed"): its whole check on this
configuration is PROVED too, but costs 2.9 G units (417 s on 2 busy cores, 2026-12-08), against 1.6 G for the
lemma. With two MTP modules in drop mode neither place for the one tail keeps both claims, and the layout is
left to vLLM (``refimpl.CAPPED_FINE_MAMBA_MTP_DROP``).
"""

import kvhit.refimpl as R
from kvhit.proofs import runner
from kvhit.proofs.domains import configs
from kvhit.proofs.model import ReplayContext, check, isolated_map

CFGS = configs(extended=True)
CLAIM = "reference_never_below_vllm"
SERVES = "vllm_0_33_cache_serves_nothing_the_policy_cache_does_not"
BAD = "tail_at_capped_resume"
LAYOUT = "full1600e_mamba1600_pmu160_aux"
L1_R0 = f"{LAYOUT} lookahead Lp=1 R=0"
# A prompt of 3040 tokens, a longer one sharing 2881 of it, then one sharing 3682 with the second (found by Z3
# for the variant on L1_R0): vLLM keeps the second's tail at its checkpoint (2880); the variant keeps it at the
# second's capped resume point (1600, a block end, held anyway) and none at 2880.
WITNESS = {"N": 3040, "N2": 5280, "P2": 2881, "N3": 4802, "P3": 3682, "follows_second": True}
# With two MTP modules in drop mode: 11200 tokens, a prompt of 1920 sharing 1761 of it, then one sharing 4799
# with the first. The second's capped resume point (1440) lies inside a block; vLLM's tail is at 1760.
MTP2_DROP_R0 = f"{LAYOUT} drop Lp=2 mtp2 R=0"
CONFLICT = {"N": 11200, "N2": 1920, "P2": 1761, "N3": 6399, "P3": 4799, "follows_second": False}


def _index(label):
    return next(i for i, c in enumerate(CFGS) if c.label == label)


def _check(task):
    invariant, policy, i = task
    verdict, _, cex, _ = check(runner.BY_NAME[invariant], R.ALL_POLICIES[policy], CFGS[i])
    return task, (verdict, cex)


def _checks(*tasks):
    """Each check in a fresh process, two at a time, in the order given."""
    done = dict(isolated_map(_check, list(tasks), 2))
    return [done[t] for t in tasks]


def _claim_on(label, policy, stream):
    """The claim evaluated on one concrete stream through refimpl: ``(assumption, holds, shown)``."""
    ctx = ReplayContext(CFGS[_index(label)], R.ALL_POLICIES[policy], dict(stream), None)
    assumption, holds = runner.BY_NAME[CLAIM].claim(ctx)
    return assumption, holds, ctx.shown


def test_the_reference_is_never_below_vllm_under_the_cap_and_the_variant_is_refuted():
    """On ``L1_R0``: the dominance lemma and the read-side lemmas on the read twin are PROVED for the reference,
    so the composed claim is; the variant fails the claim checked whole (with a counterexample whose replayed
    third hit is below vLLM's) and the lemma (non-vacuity through the composition)."""
    write = _index(L1_R0)
    twin = runner.read_twin(CFGS[write], CFGS)
    assert twin is not None and not CFGS[twin].write_side
    lemmas = [(SERVES, "reference", write)] + [(inv, pol, twin) for inv, pol in runner.BY_NAME[CLAIM].lemmas[1:]]
    bad = [(CLAIM, BAD, write), (SERVES, BAD, write)]
    done = _checks(*lemmas, *bad)
    assert [v for v, _ in done[:len(lemmas)]] == ["PROVED"] * len(lemmas), done
    verdicts = {}
    runner.compose_by_lemmas(verdicts, [(t + (None,), v, 0.0, cex, 0) for t, (v, cex) in zip(lemmas, done)], CFGS)
    row = verdicts[(CLAIM, "reference")]
    assert (row.verdict, row.configs) == ("PROVED", [f"{L1_R0} (composed)"])
    (whole, cex), (lemma, _) = done[len(lemmas):]
    assert (whole, lemma) == ("REFUTED", "REFUTED")
    ours, theirs = cex["replayed"]["hits"], cex["replayed"]["vllm_0_33_hits"]
    assert ours[0] < theirs[0] or ours[1] < theirs[1], cex


def test_the_witness_replays_through_refimpl():
    """The variant's third request hits 1600 where vLLM's hits 2880; the reference's hits 2880."""
    assumption, holds, shown = _claim_on(L1_R0, BAD, WITNESS)
    assert assumption and not holds and shown["hits"] == (1600, 1600) and shown["vllm_0_33_hits"] == (1600, 2880)
    assumption, holds, shown = _claim_on(L1_R0, "reference", WITNESS)
    assert assumption and holds and shown["hits"] == (1600, 2880), shown


def test_with_two_mtp_modules_in_drop_mode_one_tail_cannot_serve_both_and_the_layout_is_left_to_vllm():
    """The second prompt's resend resumes at 1440 (capped at 1600, less the reprefillable tail), inside a
    block; vLLM keeps its tail at 1760. The reference keeps the resend's, so the third request hits 1600 where
    vLLM's hits 1760; the variant too. The spec names the setting unmodelled, which leaves it to vLLM."""
    config = CFGS[_index(MTP2_DROP_R0)]
    sizes = ReplayContext(config, R.REFERENCE, {"N": 1}, None).sizes()
    resend = R.hit_tokens(R.written_cache(R.dense_groups(sizes, 1920)), sizes, 1920, R.REFERENCE)[0]
    assert (resend, R.checkpoint_position(1920, sizes.hash_block, True, sizes.hash_lookahead)) == (1440, 1760)
    for policy in ("reference", BAD):
        assumption, holds, shown = _claim_on(MTP2_DROP_R0, policy, CONFLICT)
        assert assumption and not holds and shown["hits"] == (0, 1600) and shown["vllm_0_33_hits"] == (0, 1760)
    assert R.write_side_unmodelled(sizes).startswith(R.CAPPED_FINE_MAMBA_MTP_DROP)
    one = ReplayContext(CFGS[_index(f"{LAYOUT} drop Lp=1 R=0")], R.REFERENCE, {"N": 1}, None).sizes()
    assert R.write_side_unmodelled(one) == ""


def test_on_every_setting_the_adapter_enforces_the_tail_is_where_vllm_keeps_its_checkpoint():
    """Without speculation, with lookahead (one or two MTP modules) and in drop mode with one, the reference's
    tail under the cap is vLLM's prompt checkpoint for every prompt of 1 to 8000 tokens (the capped resume
    point is a block end or lies there); with two MTP modules in drop mode it is not for 40 of them."""
    for setting, differ in (("none", 0), ("lookahead Lp=1", 0), ("lookahead Lp=2 mtp2", 0), ("drop Lp=1", 0),
                            ("drop Lp=2 mtp2", 40)):
        sizes = ReplayContext(CFGS[_index(f"{LAYOUT} {setting} R=0")], R.REFERENCE, {"N": 1}, None).sizes()
        tails = [(n, R.resume_tail(sizes, n, R.replay_boundaries(sizes, n, R.REFERENCE), R.REFERENCE))
                 for n in range(1, 8001)]
        vllm = [R.checkpoint_position(n, sizes.hash_block, sizes.drop, sizes.hash_lookahead) for n, _ in tails]
        assert sum(t != v for (_, t), v in zip(tails, vllm)) == differ, setting
