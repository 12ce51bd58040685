"""Checks under the scans' contracts (:class:`kvhit.spec.lower_z3.ContractLowering`,
:func:`kvhit.proofs.loop.check_by_contract`; README, "Contracts").

The contract's facts are true of ``max_aligned``'s value, whatever the probes (so a claim proved under them
holds of the exact lowering), and they pin that value down once every candidate point is a probe (so the
maximality part says something). On configurations where the exact check finishes, the contract never
proves what the exact check refutes, the verdict of the composition equals the exact one, and a known-bad
variant is refuted through it (the exact fallback decides)."""

from __future__ import annotations

import pytest
import z3
from hypothesis import given, settings
from hypothesis import strategies as st

from kvhit.proofs.domains import configs
from kvhit.proofs.loop import check_by_contract
from kvhit.proofs.model import check
from kvhit.proofs.runner import BY_NAME
from kvhit.spec import runtime
from kvhit.spec.lower_z3 import ContractLowering, fresh_int
from kvhit.spec.policy import ALL_POLICIES
from kvhit.spec.terms import _zv, eq, installed, or_


def _scan(step, hv, held, probes):
    """A scan of ``max_aligned(step, hi, x in held)`` under the contract lowering, ``hi`` a symbol pinned
    to ``hv``: ``(facts, r, pins)``, each probe a fresh symbol pinned to its value."""
    lowering = ContractLowering()
    with installed(lowering):
        hi = fresh_int("hi")
        points = [fresh_int("probe") for _ in probes]

        def pred(x):
            out = False
            for v in sorted(held):
                out = or_(out, eq(x, v))
            return out

        r = lowering.max_aligned(step, hi, pred)
        facts = lowering.facts(points)
    pins = [hi.z == hv] + [p.z == v for p, v in zip(points, probes)]
    return facts, r, pins


@settings(max_examples=60, deadline=None)
@given(step=st.sampled_from((1, 4, 16)), hv=st.integers(-8, 80), held=st.sets(st.integers(-8, 96), max_size=8),
       probes=st.lists(st.integers(-8, 96), max_size=4))
def test_the_facts_hold_of_max_aligned_whatever_the_probes(step, hv, held, probes):
    """Soundness: with ``r`` the scan's value, no fact fails, for any probe values (the points the
    predicate holds at among them, where a wrong range would show)."""
    facts, r, pins = _scan(step, hv, held, sorted(held) + probes)
    exact = runtime.max_aligned(step, hv, lambda x: x in held)
    solver = z3.Solver()
    solver.add(*pins, r.z == exact, z3.Not(z3.And(facts)))
    assert solver.check() == z3.unsat


@settings(max_examples=40, deadline=None)
@given(step=st.sampled_from((1, 4, 16)), hv=st.integers(0, 64), held=st.sets(st.integers(0, 80), max_size=8))
def test_probes_at_every_candidate_pin_the_value_down(step, hv, held):
    """The maximality part is not vacuous: probed at every multiple of the step up to ``hi``, the facts
    leave ``r`` only the scan's value."""
    candidates = list(range(step, hv + 1, step))
    facts, r, pins = _scan(step, hv, held, candidates)
    exact = runtime.max_aligned(step, hv, lambda x: x in held)
    solver = z3.Solver()
    solver.add(*pins, *facts, r.z != exact)
    assert solver.check() == z3.unsat


def test_without_probes_the_maximality_is_open():
    """No probe, one scan: a model may take 0 where the exact value is higher (so the caller must not read
    a satisfiable contract check as a refutation)."""
    facts, r, pins = _scan(4, 16, {8, 16}, [])
    solver = z3.Solver()
    solver.add(*pins, *facts, r.z == 0)
    assert solver.check() == z3.sat


def _config(label, write_side=False):
    return next(c for c in configs(True) if c.label == label and c.write_side == write_side)


# (invariant, policy, configuration label, write side): the exact check finishes on each in seconds.
# Read side: the reference's claims on a full-attention + Mamba layout, a sliding-window layout and
# DeepSeek-V4's five groups (where the exact hit_is_the_longest_valid does not finish, a lighter claim);
# vLLM's refuted validity on swa32_mamba64 (Candidate C1). Write side: the Qwen3-Next report's layout.
AGREE = [
    ("hit_is_the_longest_valid", "reference", "qwen3next drop Lp=1", False),
    ("eagle_loses_at_most_one_block_beyond_alignment", "reference", "qwen3next lookahead Lp=2 mtp2", False),
    ("hit_is_valid_in_every_group", "reference", "gemma lookahead Lp=2 mtp2", False),
    ("hit_is_valid_in_every_group", "reference", "dsv4_cuda drop Lp=1", False),
    ("hit_is_valid_in_every_group", "vllm_0_33", "swa32_mamba64 drop Lp=1", False),
    ("hit_is_the_longest_valid", "vllm_0_33", "qwen3next drop Lp=1", False),
    ("second_repeat_is_stable", "reference", "qwen3next drop Lp=1 R=0", True),
    ("scheduler_and_mask_boundaries_agree", "vllm_0_33", "qwen3next drop Lp=1 R=0", True),
]


@pytest.mark.parametrize("invariant,policy,label,write_side", AGREE)
def test_the_composition_gives_the_exact_verdict(invariant, policy, label, write_side):
    """The contract check proves only what the exact one proves, never refutes, and the composition's
    verdict is the exact one."""
    cfg, rules = _config(label, write_side), ALL_POLICIES[policy]
    exact = check(BY_NAME[invariant], rules, cfg)[0]
    by_contract = check(BY_NAME[invariant], rules, cfg, contract=True)[0]
    assert exact in ("PROVED", "REFUTED")
    assert by_contract == "PROVED" if exact == "PROVED" else by_contract == "UNDECIDED"
    assert check_by_contract(BY_NAME[invariant], rules, cfg)[0] == exact


@pytest.mark.parametrize("invariant,bad,label,write_side", [
    ("hit_is_the_longest_valid", "historical_repeat_drop", "qwen3next drop Lp=1", False),
    ("hit_is_valid_in_every_group", "eagle_never_recomputes", "qwen3next drop Lp=1", False),
    ("hit_is_aligned_and_capped", "no_last_token_cap", "dsv4_cuda none", False),
    ("second_repeat_is_stable", "junction_past_hit", "qwen3next drop Lp=1 R=0", True),
])
def test_a_known_bad_variant_is_refuted_through_the_composition(invariant, bad, label, write_side):
    """The contract does not prove it, and the exact fallback finds the run that breaks it (replayed)."""
    cfg, rules = _config(label, write_side), ALL_POLICIES[bad]
    assert check(BY_NAME[invariant], rules, cfg, contract=True)[0] == "UNDECIDED"
    verdict, _, cex, _ = check_by_contract(BY_NAME[invariant], rules, cfg)
    assert verdict == "REFUTED" and cex
