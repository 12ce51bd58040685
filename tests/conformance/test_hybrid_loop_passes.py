"""How far the unrolled Hybrid loop reaches: every input in the default run, not on three-group layouts.

The Z3 lowering unrolls vLLM's ``HybridKVCacheCoordinator.find_longest_cache_hit`` loop to
:func:`kvhit.spec.policy.pass_bound` passes, and the claims of ``vllm_0_33``, ``historical`` and
``vllm_0_33_repaired`` assume the loop stopped within them (``converged``). Two facts bound what that
leaves out (README, "How the checks work, and what is not proved"):

* In the default run every layout on which vLLM's policies are checked and that has more than one spec group
  is vLLM's simple case (two spec groups led by full attention), where vLLM itself leaves after one pass: the
  one unrolled pass is vLLM's whole loop, so those verdicts cover every input. (The HEAVY layouts are in the
  default run for the reference only, whose hit is not vLLM's loop.)
* On a layout of two non-full-attention groups no bound of passes exists: the loop goes on while two groups
  keep lowering each other's candidate, as often as the cache lets them. The cache below makes vLLM 0.33.0's
  own coordinator take nine passes on ``full64_mamba64_mamba128`` (an ``--extended`` layout), where the
  lowering unrolls four, so the unrolled loop's verdicts there cover only the runs that stop within the
  bound; the loop's two-pass summary (:mod:`kvhit.proofs.loop`) covers this run too (the last test).
"""

import pytest

from kvhit.proofs.domains import configs, reference_only
from kvhit.proofs.model import cache_from_runs
from kvhit.refimpl import REFERENCE, VLLM_0_33, VLLM_0_33_REPAIRED, derive_sizes, hit_tokens
from kvhit.refimpl import policy as refimpl_policy
from kvhit.spec import policy as spec_policy
from kvhit.spec.sizes import derive_sizes as spec_sizes
from kvhit.spec.terms import Lowering, installed

from .differential import seeded_harness, to_refimpl


def test_every_default_hybrid_layout_stops_after_one_pass():
    hybrid = [c for c in configs(False) if not spec_sizes(c.layout, c.speculation).unitary
              and not reference_only(c, extended=False)]
    assert hybrid, "the default run checks vLLM's policies on hybrid layouts"
    for c in hybrid:
        sizes = spec_sizes(c.layout, c.speculation)
        assert spec_policy.is_simple(sizes) and spec_policy.pass_bound(sizes) == 1, c.label


# Full attention 64 + Mamba 64 + Mamba 128, no speculation, alignment 64; a prompt of 2049 tokens whose
# full-attention blocks are all cached. The Mamba 64 group holds states at 256 j + 192, the Mamba 128 group
# at 256 j (j >= 1), up to 2048. Each pass the first lowers the candidate to the next 256 j + 192 below it
# and the second to the 256 j below that: 2048 -> 1792 -> 1536 -> ... -> 256 -> 0, eight passes that lower
# it and a ninth that finds nothing to lower. The hit is 0 (no boundary holds both states).
N = 2049
CACHE = {(0, 64): [(0, 32)],                                 # boundaries 64 .. 2048
         (1, 64): [(j, j + 1) for j in range(2, 32, 4)],     # 192, 448, ..., 1984
         (2, 128): [(j, j + 1) for j in range(1, 16, 2)]}    # 256, 512, ..., 2048
PASSES = 9
HIT = 0


def _config():
    return next(c for c in configs(True) if c.layout.name == "full64_mamba64_mamba128" and not c.write_side
                and c.layout.dcp == 1 and c.speculation.describe() == "none")


class _Unrolled(Lowering):
    """Python's operators with the Z3 lowering's count of passes (``range(bound)``, no early exit)."""

    def passes(self, bound: int):
        return range(bound)


def test_vllm_loop_takes_more_passes_than_the_lowering_unrolls(monkeypatch):
    import vllm.v1.core.single_type_kv_cache_manager as single_type

    config = _config()
    cache, described = cache_from_runs(CACHE)
    bound = spec_policy.pass_bound(spec_sizes(config.layout, config.speculation))
    assert bound < PASSES

    # vLLM 0.33.0: each pass looks up both Mamba groups once (full attention only on the first).
    lookups = []
    find = single_type.MambaManager.find_longest_cache_hit.__func__

    def counted(cls, *args, **kwargs):
        lookups.append(kwargs["max_length"])
        return find(cls, *args, **kwargs)

    seeded = seeded_harness(config, N, described)
    monkeypatch.setattr(single_type.MambaManager, "find_longest_cache_hit", classmethod(counted))
    assert seeded.harness.probe(seeded.tokens)["hit"] == HIT
    assert len(lookups) == 2 * PASSES

    # refimpl (the spec's loop in Python, unbounded): the same hit after the same passes.
    passes = []
    one_pass = refimpl_policy.hybrid_pass
    monkeypatch.setattr(refimpl_policy, "hybrid_pass", lambda *a: passes.append(1) or one_pass(*a))
    sizes = derive_sizes(to_refimpl(config.layout), to_refimpl(config.speculation))
    assert hit_tokens(cache, sizes, N, VLLM_0_33)[0] == HIT
    assert len(passes) == PASSES

    # The spec's loop cut at the lowering's bound has not converged: the claims assume it away.
    with installed(_Unrolled()):
        hit, _, _, converged = spec_policy.hybrid_hit_tokens(cache, spec_sizes(config.layout, config.speculation),
                                                            N, spec_policy.VLLM_0_33)
    assert converged is False and hit > HIT


@pytest.mark.parametrize("name", ["full64_mamba64_mamba128", "three_kind", "dsv4_cuda", "swa32_mamba64"])
def test_extended_hybrid_layouts_are_not_the_simple_case(name):
    """The layouts where the bound matters: more than one non-full-attention group, or none led by full
    attention; the README names them."""
    config = next(c for c in configs(True) if c.layout.name == name)
    sizes = spec_sizes(config.layout, config.speculation)
    assert not sizes.unitary and not spec_policy.is_simple(sizes)
    assert spec_policy.pass_bound(sizes) == len(sizes.groups) + 1


class _Chosen:
    """A context for :func:`kvhit.proofs.loop.hit_tokens_summary` whose free values are a run's own."""

    def __init__(self, values: dict):
        self.values, self.symbols = values, {}

    def fresh(self, name: str):
        return self.values[name.split("_", 1)[1]]

    fresh_bool = fresh


def test_the_nine_pass_run_is_one_of_the_loop_summarys_inputs(monkeypatch):
    """The two-pass summary (kvhit.proofs.loop) covers runs of any length: with its free values set to the
    state vLLM's nine-pass run starts its last pass in, it returns that run's hit, reach and longest."""
    from kvhit.proofs.loop import hit_tokens_summary

    config = _config()
    cache, _ = cache_from_runs(CACHE)
    sizes = spec_sizes(config.layout, config.speculation)
    calls = []
    one_pass = spec_policy.hybrid_pass

    def recorded(*args):
        out = one_pass(*args)
        calls.append((args, out))
        return out

    monkeypatch.setattr(spec_policy, "hybrid_pass", recorded)
    hit, reach, longest, converged = spec_policy.hybrid_hit_tokens(cache, sizes, N, spec_policy.VLLM_0_33)
    assert (hit, converged, len(calls)) == (HIT, True, PASSES)
    (_, _, _, start, verified, lengths, first, _), _ = calls[-1]
    between = [out for _, out in calls[1:-1]]
    values = {"L": start, "longest_between": max(out[3] for out in between),
              "reach_between": max(out[4] for out in between),
              **{f"verified{k}": v for k, v in enumerate(verified)},
              **{f"length{k}": n for k, n in enumerate(lengths)}}
    calls.clear()
    summary = hit_tokens_summary(_Chosen(values), cache, sizes, N, spec_policy.VLLM_0_33)
    assert not first and len(calls) == 2
    assert summary == (hit, reach, longest, True)
    assert lengths[0] == calls[0][1][2][0]  # the full-attention length pass 1 set, as the summary keeps it


def test_vllm_keeps_an_eagle_verification_across_another_groups_drop():
    """A REFUTED verdict the loop's summary left to the unrolled check (docs/findings.md, "Candidate C1"):
    `swa32_mamba64` (an ``--extended`` layout, no full attention in front), drop mode, N = 352. Pass 1 looks
    the sliding window up with the drop (window at 320, dropped to 288, verified), then the Mamba group drops
    to its only state, 32: a shrink by a drop lookup, so the sliding window stays verified, and pass 2 takes
    32 from it without the drop, though the block past 32 was never cached. vLLM 0.33.0's coordinator hits 32
    exactly as the vllm_0_33 policy says; the reference finds nothing every group serves, and neither does
    vllm_0_33 with the repair reverify_after_shrink."""
    config = next(c for c in configs(True) if c.layout.name == "swa32_mamba64" and c.layout.dcp == 1
                  and c.speculation.describe() == "drop Lp=1" and not c.write_side)
    cache, described = cache_from_runs({(0, 32): [(0, 1), (4, 6), (7, 10)], (1, 32): [(0, 1)]})
    seeded = seeded_harness(config, 352, described)
    assert seeded.harness.probe(seeded.tokens)["hit"] == 32
    sizes = derive_sizes(to_refimpl(config.layout), to_refimpl(config.speculation))
    assert hit_tokens(cache, sizes, 352, VLLM_0_33)[0] == 32
    assert hit_tokens(cache, sizes, 352, REFERENCE)[0] == 0
    # the repair reverify_after_shrink clears the verification on every shrink (tests/conformance/test_patched_vllm.py)
    assert hit_tokens(cache, sizes, 352, VLLM_0_33_REPAIRED)[0] == 0
    assert hit_tokens(cache, sizes, 352, refimpl_policy.repaired(("reverify_after_shrink",)))[0] == 0
