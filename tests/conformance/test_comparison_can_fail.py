"""The differential comparison is not vacuous: run with a policy other than ``vllm_0_33`` on the same
scenarios, it reports mismatches, with the layout, stream, cache state and both outputs in the message."""

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvhit.refimpl import Layout, Speculation, policy_rules
from kvhit.spec.catalogue import CATALOGUE

from .differential import Mismatch, Op, Scenario, Stats, run_scenario, to_refimpl
from .strategies import scenarios
from .write_side import WriteScenario, WriteStats, run_write_scenario

FULL16 = to_refimpl(CATALOGUE["full16"])
SWA16 = Layout(({"kind": "swa", "block_size": 16, "window": 64},), name="swa16w64")


def _repeat(layout, speculation, n):
    return Scenario(layout, speculation, 0, False, (Op("serve", "new", n=n), Op("probe", "repeat", 0)))


def test_vllm_0_33_agrees_where_reference_is_caught_on_the_unitary_drop():
    """F2: full attention 16, drop mode, N = 1024 served then repeated: vLLM returns 992."""
    scenario = _repeat(FULL16, Speculation("drop", 1), 1024)
    assert run_scenario(scenario, Stats()) == [(1024, 0), (1024, 992)]
    with pytest.raises(Mismatch, match=r"hit mismatch at lookup #1 \(N=1024\)(.|\n)*vLLM 0.33.0: hit 992"
                                       r"(.|\n)*\[reference\] hit 1008"):
        run_scenario(scenario, Stats(), policy_rules("reference"))


def test_an_unpredicted_index_error_is_a_mismatch():
    """F1 on the first lookup of an empty cache: vLLM raises; a policy whose reads stay within the hashes
    (reference) does not predict it."""
    scenario = _repeat(SWA16, Speculation("lookahead", 2, True), 33)
    assert run_scenario(scenario, Stats()) == [(33, "IndexError"), (33, "IndexError")]
    with pytest.raises(Mismatch, match="vLLM raised IndexError but the model reads within the hashes"):
        run_scenario(scenario, Stats(), policy_rules("reference"))


@pytest.mark.parametrize("policy", ["reference", "historical", "peek_past_hashes", "historical_repeat_drop"])
def test_other_policies_are_caught_on_catalogue_streams(policy):
    caught = []

    @settings(max_examples=150, deadline=None, derandomize=True,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(layout=st.sampled_from(sorted(CATALOGUE)).map(lambda name: to_refimpl(CATALOGUE[name])),
           data=st.data())
    def run(layout, data):
        scenario = data.draw(scenarios(layout))
        try:
            run_scenario(scenario, Stats(), policy_rules(policy))
        except Mismatch as e:
            caught.append(str(e))

    run()
    assert caught, f"no scenario told {policy} apart from vLLM 0.33.0"


# The write-side comparison is not vacuous either.

GEMMA = to_refimpl(CATALOGUE["gemma"])
QWEN3NEXT = to_refimpl(CATALOGUE["qwen3next"])


def test_write_side_comparison_catches_reference_on_w2():
    """W2: the reference keeps the window ending at 704 for the sibling; vLLM keeps it only up to 640."""
    scenario = WriteScenario(GEMMA, Speculation("none"), 0, 704, (("sibling", 96),))
    assert run_write_scenario(scenario, WriteStats()) == [("first", 704, 0), ("sibling +96", 800, 640)]
    with pytest.raises(Mismatch, match=r"retained boundaries of KV-cache group 1 \(spec group 1, swa 32\)"
                                       r"(.|\n)*vLLM 0.33.0: 160..640\n  model \[reference\]: 160..704"):
        run_write_scenario(scenario, WriteStats(), policy_rules("reference"))


def test_write_side_comparison_catches_reference_on_w1():
    """W1: vLLM keeps the Mamba state at 6400 where its own first resend cannot use it; the reference
    keeps it at 4800, where that resend resumes."""
    scenario = WriteScenario(QWEN3NEXT, Speculation("drop", 2, True), 0, 8000, (("resend",), ("resend",)))
    assert [hit for _, _, hit in run_write_scenario(scenario, WriteStats())] == [0, 0, 4800]
    with pytest.raises(Mismatch, match=r"KV-cache group 1 \(spec group 1, mamba 1600\)(.|\n)*"
                                       r"vLLM 0.33.0: 6400\n  model \[reference\]: 4800"):
        run_write_scenario(scenario, WriteStats(), policy_rules("reference"))


def test_write_side_comparison_catches_a_mask_that_keeps_every_boundary():
    """``retain_every_boundary`` (retention 0 acts as dense) predicts sliding-window blocks vLLM drops."""
    scenario = WriteScenario(GEMMA, Speculation("none"), 0, 704, ())
    run_write_scenario(scenario, WriteStats())
    with pytest.raises(Mismatch, match=r"retained boundaries of KV-cache group 1 \(spec group 1, swa 32\)"):
        run_write_scenario(scenario, WriteStats(), policy_rules("retain_every_boundary"))


def test_write_side_comparison_on_a_held_prefix_catches_a_state_inside_the_lookahead(monkeypatch):
    """Full16 (DCP 2) + Mamba 32 + Mamba 128, MTP 2 drop, R = 384, a request of 193 tokens admitted at 176 on
    a held prefix: vLLM keeps no Mamba state at 192 (within Lp of the prompt end), and a write side that keeps
    every state the request computes (the dense mask, whatever R says) is caught holding one there."""
    from kvhit.refimpl import Group

    from . import write_side

    layout = Layout((Group("full", 16), Group("mamba", 32), Group("mamba", 128)), dcp=2, prefix_match_unit=16,
                    name="full16_mamba32_mamba128")
    scenario = WriteScenario(layout, Speculation("drop", 2, True), 384, 193, (), held_before=(192, 176, 176))
    assert run_write_scenario(scenario, WriteStats()) == [("first", 193, 176)]
    real = write_side.request_writes
    monkeypatch.setattr(write_side, "request_writes",
                        lambda sizes, n, interval, *args, **kw: real(sizes, n, None, *args, **kw))
    with pytest.raises(Mismatch, match=r"KV-cache group 1 \(spec group 1, mamba 32\)(.|\n)*"
                                       r"vLLM 0.33.0: 16..176\n  model \[vllm_0_33\]: 16..192"):
        run_write_scenario(scenario, WriteStats())


def test_a_spec_that_ignores_the_auxiliary_outputs_cap_is_caught(monkeypatch):
    """The comparison under auxiliary outputs (``test_hit_tokens_matches_vllm_under_auxiliary_outputs``) is not
    vacuous: with vLLM's connector capping the lookups and the spec's layout without the cap
    (``aux_cap_group`` None), streams on ``qwen3next_pmu160`` (full attention read at hash granularity, where
    the cap binds inside a block) mismatch."""
    from . import differential

    harness_layout = differential.to_harness
    monkeypatch.setattr(differential, "to_harness", lambda layout: {**harness_layout(layout), "aux_cap_group": 0})
    caught = []

    @settings(max_examples=100, deadline=None, derandomize=True,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(scenario=scenarios(to_refimpl(CATALOGUE["qwen3next_pmu160"])))
    def run(scenario):
        try:
            run_scenario(scenario, Stats())
        except Mismatch as e:
            caught.append(str(e))

    run()
    assert caught and "hit mismatch" in caught[0], caught[:1]
