"""The reference's write side under decode context parallelism: never below vLLM's on Qwen3-Next's layout at
DCP 2, where a full-attention block (3200 across the ranks) is coarser than the hash unit and the alignment
(1600). Two rules make it so (``spec.policy.Rules.coarse_junction`` and ``vllm_checkpoint``); without either
the reference lost a hit that vLLM's own write side keeps (the two known-bad variants below, and
``tests/adapter/test_scheduler_plugin.py``, which serves the same streams through vLLM's real Scheduler).

The default ``make prove`` checks the write side at DCP 1 only (README, "Not proved"); this file checks
``reference_never_below_vllm`` whole on the two configurations where the variants fail it, for every stream,
and evaluates it on the witness streams through refimpl."""

import pytest

import kvhit.refimpl as R
from kvhit.proofs import domains, runner
from kvhit.proofs.loop import check_every_run
from kvhit.proofs.model import ReplayContext

CLAIM = runner.BY_NAME["reference_never_below_vllm"]
NONE_R0 = "qwen3next dcp2 none R=0"
MTP2_R0 = "qwen3next dcp2 lookahead Lp=2 mtp2 R=0"
# configuration -> (the known-bad variant that fails the claim there, a stream where it does, as the claim's
# symbols: proofs.retention._Stream)
WITNESSES = {
    # a prompt, its first 6400 tokens, then a prompt sharing 3200: vLLM's junction lands on 3200
    NONE_R0: ("fine_junction_only",
              {"N": 16002, "N2": 6400, "P2": 6400, "N3": 9599, "P3": 3200, "follows_second": False}),
    # 6401 tokens, a longer prompt sharing them, then one following that one: vLLM's checkpoint is 4800
    MTP2_R0: ("without_vllm_checkpoint",
              {"N": 6401, "N2": 11201, "P2": 6401, "N3": 9601, "P3": 9601, "follows_second": True}),
}


def _config(label):
    (config,) = [c for c in domains.write_configs(True) if c.label == label]
    return config


def _claim_on(config, policy, stream):
    """The claim evaluated on one concrete stream through refimpl: ``(assumption, holds, shown)``."""
    ctx = ReplayContext(config, R.ALL_POLICIES[policy], dict(stream), None)
    assumption, holds = CLAIM.claim(ctx)
    return assumption, holds, ctx.shown


@pytest.mark.parametrize("label", WITNESSES)
def test_the_streams_where_a_variant_loses_a_hit_replay_through_refimpl(label):
    """On each witness stream the known-bad variant's third request hits less than vLLM's, and the
    reference's hits are at least vLLM's."""
    config, (bad, stream) = _config(label), WITNESSES[label]
    assumption, holds, shown = _claim_on(config, bad, stream)
    assert assumption and not holds and shown["hits"][1] < shown["vllm_0_33_hits"][1], shown
    assumption, holds, shown = _claim_on(config, "reference", stream)
    assert assumption and holds, shown


@pytest.mark.parametrize("label", WITNESSES)
def test_the_reference_is_never_below_vllm_at_dcp2_and_each_rule_is_needed(label):
    """``reference_never_below_vllm`` checked whole: PROVED for the reference, REFUTED for the variant
    without the rule (non-vacuity), with a counterexample whose replayed hits show the variant below."""
    config, (bad, _) = _config(label), WITNESSES[label]
    verdict, _, _, _ = check_every_run(CLAIM, R.ALL_POLICIES["reference"], config)
    assert verdict == "PROVED"
    verdict, _, cex, _ = check_every_run(CLAIM, R.ALL_POLICIES[bad], config)
    assert verdict == "REFUTED"
    ours, theirs = cex["replayed"]["hits"], cex["replayed"]["vllm_0_33_hits"]
    assert ours[0] < theirs[0] or ours[1] < theirs[1], cex
