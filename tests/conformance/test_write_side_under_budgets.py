"""The write side under token budgets that cut prefill chunks (2048, 8192 and three scheduler blocks), on the
installed vLLM: vLLM keeps every boundary the model keeps and more only at chunk ends, every lookup is the read
side's on the cache vLLM holds, and the first resend never hits less than the model's first repeat
(:mod:`.budget_side`). Over every catalogue layout with a modelled write side at DCP 1 and each speculative
mode; ``KVHIT_BUDGET_SCENARIOS`` scenarios in all (default 2,000)."""

import os
from dataclasses import replace

import pytest
from hypothesis import given, settings

from kvhit.refimpl import Speculation, derive_sizes, policy_rules
from kvhit.spec.catalogue import CATALOGUE

from .budget_side import BUDGETS, BudgetStats, cutting_budget, run_budgeted_scenario
from .differential import Mismatch, to_refimpl
from .strategies import SPECULATIONS, has_mode, write_scenarios
from .test_hit_tokens_matches_vllm import HEAVY, MODES, VLLM_VERSION
from .test_write_side_matches_vllm import SETTINGS
from .write_side import WriteScenario

SCENARIOS = int(os.environ.get("KVHIT_BUDGET_SCENARIOS", "2000"))
CASES = [(name, mode, budget) for name in sorted(CATALOGUE) for mode in MODES
         if has_mode(to_refimpl(CATALOGUE[name]), mode) for budget in BUDGETS + ("3S",)]
_weights = [HEAVY.get(name, 1.0) for name, _, _ in CASES]
PER_CASE = {case: max(1, round(SCENARIOS * w / sum(_weights))) for case, w in zip(CASES, _weights)}


@pytest.mark.parametrize("name, mode, budget", CASES, ids=[f"{VLLM_VERSION}-{n}-{m}-{b}" for n, m, b in CASES])
def test_write_side_under_a_token_budget(name, mode, budget):
    layout = to_refimpl(replace(CATALOGUE[name], dcp=1))
    specs = [s for s in SPECULATIONS if s.mode.value == mode]

    @settings(max_examples=PER_CASE[(name, mode, budget)], **SETTINGS)
    @given(scenario=write_scenarios(layout, specs))
    def run(scenario):
        tokens = budget if budget != "3S" else cutting_budget(derive_sizes(layout, scenario.speculation))
        run_budgeted_scenario(scenario, tokens)

    run()


def test_the_budgets_cut_chunks_and_vllm_keeps_more_only_there():
    """Non-vacuity of the relaxation: a budget of 2048 cuts Qwen3-Next's 11910-token prompt (dense retention)
    into chunks of 1600, each leaving a Mamba state the unbudgeted model does not have; a budget of three
    scheduler blocks cuts Gemma's 1500-token prompt. Both runs pass the comparison."""
    stats = BudgetStats()
    qwen, gemma = to_refimpl(CATALOGUE["qwen3next"]), to_refimpl(CATALOGUE["gemma"])
    run_budgeted_scenario(WriteScenario(qwen, Speculation("drop", 1), None, 11910, (("resend",),)), 2048, stats)
    run_budgeted_scenario(WriteScenario(gemma, Speculation("drop", 1), 0, 1500, (("resend",), ("sibling", 64))),
                          cutting_budget(derive_sizes(gemma, Speculation("drop", 1))), stats)
    assert stats.scenarios == 2 and stats.cut == 2
    assert stats.extra_boundaries >= 5  # 1600 .. 8000 beside the model's 9600


def test_a_model_that_keeps_more_than_vllm_is_caught():
    """The comparison can fail: against a known-bad write side that keeps a state at every boundary under
    sparse retention (``retain_every_boundary``), Qwen3-Next's first request under a budget of 2048 leaves
    vLLM's cache serving less than that model's."""
    qwen = to_refimpl(CATALOGUE["qwen3next"])
    scenario = WriteScenario(qwen, Speculation("drop", 1), 0, 11910, (("resend",),))
    with pytest.raises(Mismatch, match="no longer serves"):
        run_budgeted_scenario(scenario, 2048, BudgetStats(), rules=policy_rules("retain_every_boundary"))
