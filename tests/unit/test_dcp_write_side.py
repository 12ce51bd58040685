"""The reference's write side under decode context parallelism: never below vLLM's on Qwen3-Next's layout at
DCP 2, where a full-attention block (3200 across the ranks) is coarser than the hash unit and the alignment
(1600). Two rules make it so (``spec.policy.Rules.coarse_junction`` and ``vllm_checkpoint``); without either
the reference lost a hit that vLLM's own write side keeps (the two known-bad variants below, and
``tests/adapter/test_scheduler_plugin.py``, which serves the same streams through vLLM's real Scheduler).

The default ``make prove`` checks the write side at DCP 1 only (README, "Not proved"); this file checks
``reference_never_below_vllm`` whole on the two configurations where the variants fail it, for every stream,
and replays their counterexamples through refimpl."""

import pytest

import kvhit.refimpl as R
from kvhit.proofs import domains, runner
from kvhit.proofs.loop import check_every_run
from kvhit.proofs.model import ReplayContext

CLAIM = runner.BY_NAME["reference_never_below_vllm"]
NONE_R0 = "qwen3next dcp2 none R=0"
MTP2_R0 = "qwen3next dcp2 lookahead Lp=2 mtp2 R=0"
# configuration -> (the known-bad variant that fails the claim there, a stream where it does:
# (N, N2, P2, N3, P3, the third follows the second))
WITNESSES = {
    # a prompt, its first 6400 tokens, then a prompt sharing 3200: vLLM's junction lands on 3200
    NONE_R0: ("fine_junction_only", (16002, 6400, 6400, 9599, 3200, False)),
    # 6401 tokens, a longer prompt sharing them, then one following that one: vLLM's checkpoint is 4800
    MTP2_R0: ("without_vllm_checkpoint", (6401, 11201, 6401, 9601, 9601, True)),
}


def _config(label):
    (config,) = [c for c in domains.write_configs(True) if c.label == label]
    return config


def _stream_hits(config, policy, stream):
    """``(hit2, hit3)`` of a stream of three requests (``proofs.retention._Stream``'s, concrete), each
    request's write side under ``policy``."""
    n, n2, p2, n3, p3, follows = stream
    rules = R.ALL_POLICIES[policy]
    sizes = ReplayContext(config, rules, {"N": n}, None).sizes()
    c1, c2 = (min(p3, p2), p3) if follows else (p3, min(p3, p2))
    first = R.request_writes(sizes, n, config.retention, rules)
    hit2, _, _, _, second = R.serve(sizes, n2, config.retention, rules,
                                    R.written_cache(tuple(R.clip(sizes, g, p2) for g in first)))
    third = R.written_cache(tuple((R.clip(sizes, a, c1), R.clip(sizes, b, c2)) for a, b in zip(first, second)))
    return hit2, R.hit_tokens(third, sizes, n3, rules)[0]


@pytest.mark.parametrize("label", WITNESSES)
def test_the_streams_where_a_variant_loses_a_hit_replay_through_refimpl(label):
    """On each witness stream vLLM's third request hits more than the known-bad variant's, and the
    reference's at least as much as vLLM's."""
    config, (bad, stream) = _config(label), WITNESSES[label]
    vllm = _stream_hits(config, "vllm_0_33", stream)
    assert _stream_hits(config, bad, stream)[1] < vllm[1]
    ours = _stream_hits(config, "reference", stream)
    assert ours[0] >= vllm[0] and ours[1] >= vllm[1], (ours, vllm)


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
