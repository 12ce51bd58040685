"""The differential comparison is not vacuous: run with a policy other than ``vllm_0_33`` on the same
scenarios, it reports mismatches, with the layout, stream, cache state and both outputs in the message."""

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvhit.refimpl import Layout, Speculation, policy_rules
from kvhit.spec.catalogue import CATALOGUE

from .differential import Mismatch, Op, Scenario, Stats, run_scenario, to_refimpl
from .strategies import scenarios

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
