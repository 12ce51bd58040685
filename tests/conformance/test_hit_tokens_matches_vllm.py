"""Differential tests: the installed vLLM's policy (``vllm_0_33`` on 0.33.0, ``vllm_0_32`` on 0.32.0) hits
what that vLLM does on every lookup of every generated request stream, over every catalogue layout (DCP 1, 2
and 4 where vLLM supports it), every speculative mode the release has and every retention interval, and
random layouts (see :mod:`.differential` for what is compared; :data:`.vllm_harness.SEAMS` for the release).

The number of scenarios is ``KVHIT_CONFORMANCE_SCENARIOS`` (default 2,400; ``make conformance-long`` runs
50,000), split over the test cases below in proportion to their weights.
"""

import os
import time
from dataclasses import replace

import pytest
from hypothesis import HealthCheck, given, settings

from kvhit.spec.catalogue import CATALOGUE

from .differential import STATS, run_scenario, to_refimpl
from .strategies import SPECULATIONS, has_mode, random_layouts, scenarios
from .vllm_harness import MODES, VLLM_VERSION  # noqa: F401 (MODES: the suites import it from here)

SCENARIOS = int(os.environ.get("KVHIT_CONFORMANCE_SCENARIOS", "2400"))

# (layout, DCP sizes vLLM supports for it). DCP > 1 needs every group full attention, Mamba or replicated.
CATALOGUE_DCP = {"full16": (1, 2, 4), "llama_eagle": (1, 2, 4), "qwen3next": (1, 2, 4),
                 "qwen3next_pmu160": (1, 2, 4)}
# DeepSeek-V4's report layout (S = 16384) serves prompts of tens of thousands of tokens: fewer scenarios.
HEAVY = {"dsv4_report": 0.25}

CASES = [(name, dcp, mode) for name in sorted(CATALOGUE) for dcp in CATALOGUE_DCP.get(name, (1,))
         for mode in MODES if has_mode(to_refimpl(replace(CATALOGUE[name], dcp=dcp)), mode)]
RANDOM_SHARE = 0.3
_weights = [HEAVY.get(name, 1.0) for name, _, _ in CASES]
PER_CASE = {case: max(1, round(SCENARIOS * (1 - RANDOM_SHARE) * w / sum(_weights)))
            for case, w in zip(CASES, _weights)}
RANDOM_EXAMPLES = max(1, SCENARIOS - sum(PER_CASE.values()))


def _timed(scenario):
    start = time.perf_counter()
    try:
        run_scenario(scenario)
    finally:
        STATS.seconds += time.perf_counter() - start


def _case_test(name, dcp, mode, aux_cap_group=None, examples=None):
    layout = to_refimpl(replace(CATALOGUE[name], dcp=dcp, aux_cap_group=aux_cap_group))
    specs = [s for s in SPECULATIONS if s.mode.value == mode]

    @settings(max_examples=examples or PER_CASE[(name, dcp, mode)], deadline=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(scenario=scenarios(layout, specs))
    def run(scenario):
        _timed(scenario)

    return run


@pytest.mark.parametrize("name, dcp, mode", CASES, ids=[f"{VLLM_VERSION}-{n}-dcp{d}-{m}" for n, d, m in CASES])
def test_hit_tokens_matches_vllm(name, dcp, mode):
    _case_test(name, dcp, mode)()


@settings(max_examples=RANDOM_EXAMPLES, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(data=random_layouts().flatmap(scenarios))
def test_hit_tokens_matches_vllm_on_random_layouts(data):
    _timed(data)


# Auxiliary outputs (vLLM 0.33; vLLM 0.32's cap nothing): vLLM's own AuxOutputSchedulerConnector caps every
# lookup at the leading blocks of full attention (KV-cache group 0 in these layouts), the spec's
# Layout.aux_cap_group. With partial hits (qwen3next_pmu160) the cap binds inside the hit.
AUX_CASES = [(name, mode) for name in ("llama_eagle", "qwen3next", "qwen3next_pmu160", "gemma")
             for mode in MODES if has_mode(to_refimpl(CATALOGUE[name]), mode)] if VLLM_VERSION == "0.33.0" else []

if AUX_CASES:
    @pytest.mark.parametrize("name, mode", AUX_CASES, ids=[f"{VLLM_VERSION}-{n}-aux-{m}" for n, m in AUX_CASES])
    def test_hit_tokens_matches_vllm_under_auxiliary_outputs(name, mode):
        _case_test(name, 1, mode, aux_cap_group=0, examples=max(PER_CASE.values()))()
