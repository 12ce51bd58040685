"""vLLM's Hybrid loop summarised by two passes (:mod:`kvhit.proofs.loop`), against the unrolled loop on
layouts beyond vLLM's simple case where the unrolled check finishes: the summary never proves what the
unrolled check refutes (a real run, replayed by refimpl), it proves the safety claims the unrolled check
proves, with its lemmas it proves the claims about where the loop stops that the unrolled check proves, a
lemma a pass breaks is refuted and not used, and a known-bad variant stays refuted through it."""

from __future__ import annotations

import pytest

from kvhit.proofs.domains import configs
from kvhit.proofs.loop import (KEEPS_VALID, VERIFIED_HOLD, WITHIN_HASHES, LoopNotSummarised,
                               check_every_run, lemma_invariants, proved_lemmas, summarised)
from kvhit.proofs.model import check
from kvhit.proofs.runner import BY_NAME
from kvhit.spec.domain import NO_SPECULATION
from kvhit.spec.policy import ALL_POLICIES
from kvhit.spec.sizes import derive_sizes


def config(layout: str, speculation: str):
    return next(c for c in configs(True) if c.layout.name == layout and c.layout.dcp == 1
                and c.speculation.describe() == speculation and not c.write_side)


def sizes(cfg):
    return derive_sizes(cfg.layout, cfg.speculation)


# Two groups without full attention in front (three unrolled passes) and full attention beside two Mamba
# groups (four), without speculation and with the EAGLE drop.
CONFIGS = (("swa32_mamba64", "none"), ("swa32_mamba64", "drop Lp=1"),
           ("full64_mamba64_mamba128", "none"), ("full64_mamba64_mamba128", "drop Lp=1"))


@pytest.mark.parametrize("layout,speculation", CONFIGS)
def test_the_layouts_run_the_loop_beyond_its_simple_case(layout, speculation):
    sizes = derive_sizes(config(layout, speculation).layout, config(layout, speculation).speculation)
    assert summarised(sizes, ALL_POLICIES["vllm_0_33"]) and not summarised(sizes, ALL_POLICIES["reference"])


# The safety claims, each for one policy per configuration (every combination: 36 checks of each kind,
# measured alike on 2026-12-03: the summary PROVED all 33 the unrolled loop PROVED, and left the 3 it
# REFUTED undecided). Since Candidate C1's repair (reverify_after_shrink) the unrolled loop proves validity
# for vllm_0_33_repaired on swa32_mamba64 in drop mode, and the summary alone cannot: it takes the verified
# set of the last pass as arbitrary, and with sticky verifications that is the state C1 is about. With the
# lemma verified_groups_hold_their_drop it can, for every run.
NEEDS_LEMMAS = {("hit_is_valid_in_every_group", "vllm_0_33_repaired", "swa32_mamba64", "drop Lp=1")}
SAFETY = [(inv, policy, layout, speculation)
          for k, (layout, speculation) in enumerate(CONFIGS)
          for j, inv in enumerate(("hit_is_aligned_and_capped", "hit_is_valid_in_every_group", "hit_loop_terminates"))
          for policy in [("vllm_0_33", "historical", "vllm_0_33_repaired")[(j + k) % 3]]]
SAFETY.append(("hit_is_valid_in_every_group", "vllm_0_33", "swa32_mamba64", "drop Lp=1"))  # refuted


@pytest.mark.parametrize("invariant,policy,layout,speculation", SAFETY)
def test_the_summary_proves_the_safety_claims_the_unrolled_loop_proves(invariant, policy, layout, speculation):
    """Where the unrolled check proves a safety claim the summary proves it (then for every run), but for
    NEEDS_LEMMAS, where the summary proves it with its lemmas (then for every run too); where a real run
    refutes it the summary proves nothing."""
    cfg, rules = config(layout, speculation), ALL_POLICIES[policy]
    unrolled = check(BY_NAME[invariant], rules, cfg)[0]
    summary = check(BY_NAME[invariant], rules, cfg, summary=True)[0]
    verdict, _, cex, _ = check_every_run(BY_NAME[invariant], rules, cfg)
    if (invariant, policy, layout, speculation) in NEEDS_LEMMAS:
        assert VERIFIED_HOLD in proved_lemmas(rules, cfg)[0][sizes(cfg)]
        assert (unrolled, summary, verdict, cex) == ("PROVED", "UNDECIDED", "PROVED", None)
        return
    assert (unrolled, summary) in (("PROVED", "PROVED"), ("REFUTED", "UNDECIDED"))
    assert verdict == unrolled and (cex is None or verdict == "REFUTED")


# Claims about where the loop stops: the summary alone lets the loop stop at any fixed point below its first
# pass, so it cannot decide them; with the lemmas (kvhit.proofs.loop.LEMMAS) it can. Each row with the
# unrolled loop's verdict (measured 2026-12-06; the fourth, historical's, is a real run). The EAGLE loss
# with the repaired policy on full64_mamba64_mamba128 in drop mode, PROVED with the lemmas in 1.0 s, is not
# a row: the unrolled check (eight passes over three groups) did not finish within 10 minutes.
EAGLE_LOSS = "eagle_loses_at_most_one_block_beyond_alignment"
STOPPING = [("hit_is_the_longest_valid", "vllm_0_33", "swa32_mamba64", "none", "PROVED"),
            ("hit_is_the_longest_valid", "historical", "full64_mamba64_mamba128", "none", "PROVED"),
            (EAGLE_LOSS, "vllm_0_33", "swa32_mamba64", "drop Lp=1", "PROVED"),
            (EAGLE_LOSS, "historical", "swa32_mamba64", "drop Lp=1", "REFUTED")]


@pytest.mark.parametrize("invariant,policy,layout,speculation,unrolled", STOPPING)
def test_the_lemmas_let_the_summary_decide_where_the_loop_stops(invariant, policy, layout, speculation,
                                                               unrolled):
    """The summary alone does not prove the claim; with the lemmas proved on the configuration it proves it
    where the unrolled loop does (then for every run; it needs the first two lemmas), and where a real run
    refutes it, it proves nothing and the unrolled check's counterexample stands."""
    cfg, rules = config(layout, speculation), ALL_POLICIES[policy]
    assert check(BY_NAME[invariant], rules, cfg)[0] == unrolled
    assert check(BY_NAME[invariant], rules, cfg, summary=True)[0] == "UNDECIDED"
    lemmas = proved_lemmas(rules, cfg)[0]  # for the configuration's speculation and for none
    assert set(lemmas) == {sizes(cfg), derive_sizes(cfg.layout, NO_SPECULATION)}
    with_lemmas = check(BY_NAME[invariant], rules, cfg, summary=True, loop_lemmas=lemmas)[0]
    assert with_lemmas == ("PROVED" if unrolled == "PROVED" else "UNDECIDED")
    assert unrolled == "REFUTED" or all({WITHIN_HASHES, KEEPS_VALID} <= set(proved)
                                        for proved in lemmas.values())
    verdict, _, cex, _ = check_every_run(BY_NAME[invariant], rules, cfg)
    assert verdict == unrolled and (cex is None or verdict == "REFUTED")


def _lemma(name):
    return next(lemma for lemma in lemma_invariants() if lemma.name == name)


def test_a_policy_that_reads_past_the_hashes_does_not_get_the_within_lemma():
    """peek_past_hashes peeks the EAGLE margin past the request's hashes: the lemma that the passes in
    between read within them is refuted there (a real pass, replayed by refimpl), and so not used."""
    cfg, rules = config("swa32_mamba64", "drop Lp=1"), ALL_POLICIES["peek_past_hashes"]
    assert check(_lemma(WITHIN_HASHES), rules, cfg)[0] == "REFUTED"
    assert WITHIN_HASHES not in proved_lemmas(rules, cfg)[0][sizes(cfg)]


def test_sticky_verifications_refute_the_verified_lemma_and_validity_stays_refuted():
    """Candidate C1 on swa32_mamba64 in drop mode: vLLM 0.33 keeps a group verified across a shrink, so a
    pass can leave a verified group that does not hold at the new candidate (the lemma is refuted, not used),
    and the real run on which the hit is not valid stands; the repair proves the lemma."""
    cfg = config("swa32_mamba64", "drop Lp=1")
    assert check(_lemma(VERIFIED_HOLD), ALL_POLICIES["vllm_0_33"], cfg)[0] == "REFUTED"
    assert check(_lemma(VERIFIED_HOLD), ALL_POLICIES["vllm_0_33_repaired"], cfg)[0] == "PROVED"
    assert VERIFIED_HOLD not in proved_lemmas(ALL_POLICIES["vllm_0_33"], cfg)[0][sizes(cfg)]
    validity = BY_NAME["hit_is_valid_in_every_group"]
    assert check_every_run(validity, ALL_POLICIES["vllm_0_33"], cfg)[0] == "REFUTED"


def test_a_pass_that_skips_a_valid_length_refutes_the_keeps_lemma_and_the_claim_falls_back():
    """F6 on three_kind: vLLM 0.33's full-attention lookup stops below a valid length, so a pass need not
    keep it (the lemma is refuted), the summary may not assume it, and the unrolled check finds the real
    run on which the hit is not the longest valid one."""
    cfg, rules = config("three_kind", "none"), ALL_POLICIES["vllm_0_33"]
    assert check(_lemma(KEEPS_VALID), rules, cfg)[0] == "REFUTED"
    assert KEEPS_VALID not in proved_lemmas(rules, cfg)[0][sizes(cfg)]
    assert check_every_run(BY_NAME["hit_is_the_longest_valid"], rules, cfg)[0] == "REFUTED"


@pytest.mark.parametrize("invariant,bad,layout,speculation", [
    ("hit_is_aligned_and_capped", "no_last_token_cap", "full64_mamba64_mamba128", "none"),
    ("hit_is_valid_in_every_group", "eagle_never_recomputes", "full64_mamba64_mamba128", "drop Lp=1"),
])
def test_a_known_bad_variant_is_refuted_through_the_summary(invariant, bad, layout, speculation):
    """The summary does not prove it (its states include the real run's), and the fallback finds a real
    run that breaks it."""
    cfg, rules = config(layout, speculation), ALL_POLICIES[bad]
    assert check(BY_NAME[invariant], rules, cfg, summary=True)[0] == "UNDECIDED"
    assert check_every_run(BY_NAME[invariant], rules, cfg)[0] == "REFUTED"


def test_a_policy_whose_passes_can_rise_is_not_summarised():
    """peek_without_pop keeps the peeked margin, so a pass can end above its start (hit_loop_terminates
    refutes it): check_every_run must not lean on the summary there, whatever the summary says."""
    cfg, rules = config("swa32_mamba64", "drop Lp=1"), ALL_POLICIES["peek_without_pop"]
    assert check(BY_NAME["hit_loop_terminates"], rules, cfg)[0] == "REFUTED"
    verdict, _, cex, _ = check_every_run(BY_NAME["hit_is_aligned_and_capped"], rules, cfg)
    assert verdict == "REFUTED" or cex == {"loop": "runs within 3 passes"}


def test_a_loop_outside_the_contexts_hit_is_not_summarised():
    """A write-side claim whose spec runs the loop inside a repeat: the summary refuses, not unrolls."""
    cfg = next(c for c in configs(True) if c.write_side and c.layout.name == "swa32_mamba64")
    with pytest.raises(LoopNotSummarised):
        check(BY_NAME["second_repeat_is_stable"], ALL_POLICIES["vllm_0_33"], cfg, summary=True)
