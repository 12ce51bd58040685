"""Differential tests of the write side: what a request leaves in the installed vLLM's cache (retained block
boundaries after the first request), the hits of its resends, and the hits of longer siblings, equal that
release's policy's write side (``vllm_0_33`` on 0.33.0, ``vllm_0_32`` on 0.32.0: ``refimpl.request_writes``
/ ``written_cache`` / ``repeat_hits``) over every catalogue layout with a modelled write side (DCP 1, 2 and 4
where vLLM supports it), every speculative mode the release has and every retention interval, and random
layouts, and a prompt diverging from the first and one sharing the junction it records (see
:mod:`.write_side` for what is compared).

The number of scenarios is ``KVHIT_WRITE_SCENARIOS`` (default 2,000; ``make conformance-long`` runs 20,000),
split over the cases below in proportion to their weights.
"""

import os
import time
from dataclasses import replace

import pytest
from hypothesis import HealthCheck, given, settings

from kvhit.refimpl import Group, Layout, Speculation, derive_sizes
from kvhit.refimpl.policy import Kind
from kvhit.spec.catalogue import CATALOGUE

from .differential import to_refimpl
from .strategies import SPECULATIONS, has_mode, random_layouts, write_scenarios
from .test_hit_tokens_matches_vllm import CATALOGUE_DCP, HEAVY, MODES, VLLM_VERSION
from .write_side import WRITE_STATS, WriteScenario, run_write_scenario

SCENARIOS = int(os.environ.get("KVHIT_WRITE_SCENARIOS", "2000"))


CASES = [(name, dcp, mode) for name in sorted(CATALOGUE) for dcp in CATALOGUE_DCP.get(name, (1,)) for mode in MODES
         if has_mode(to_refimpl(replace(CATALOGUE[name], dcp=dcp)), mode)]
RANDOM_SHARE = 0.3
_weights = [HEAVY.get(name, 1.0) for name, _, _ in CASES]
PER_CASE = {case: max(1, round(SCENARIOS * (1 - RANDOM_SHARE) * w / sum(_weights)))
            for case, w in zip(CASES, _weights)}
RANDOM_EXAMPLES = max(1, SCENARIOS - sum(PER_CASE.values()))
SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                                      HealthCheck.filter_too_much])


def _timed(scenario):
    start = time.perf_counter()
    try:
        run_write_scenario(scenario)
    finally:
        WRITE_STATS.seconds += time.perf_counter() - start


@pytest.mark.parametrize("name, dcp, mode", CASES, ids=[f"{VLLM_VERSION}-{n}-dcp{d}-{m}" for n, d, m in CASES])
def test_write_side_matches_vllm(name, dcp, mode):
    layout = to_refimpl(replace(CATALOGUE[name], dcp=dcp))
    specs = [s for s in SPECULATIONS if s.mode.value == mode]

    @settings(max_examples=PER_CASE[(name, dcp, mode)], **SETTINGS)
    @given(scenario=write_scenarios(layout, specs))
    def run(scenario):
        _timed(scenario)

    run()


@settings(max_examples=RANDOM_EXAMPLES, **SETTINGS)
@given(scenario=random_layouts().flatmap(write_scenarios))
def test_write_side_matches_vllm_on_random_layouts(scenario):
    _timed(scenario)


# Found by a long run: a sliding window losing blocks that left the window before a later chunk cached them
# (spec/retention.py, sliding_window_gaps). Pinned so every run compares them on vLLM.
_GAP_LAYOUT = Layout((Group("full", 16), Group("mamba", 128), Group("swa", 32, window=17)), name="gaps")
PINNED = [WriteScenario(_GAP_LAYOUT, speculation, retention, n, (("resend",), ("sibling", 1), ("resend",)), seed=n)
          for speculation in (Speculation("drop", 1), Speculation("none"))
          for retention in (0, None, 128) for n in (128, 129, 160, 256, 300, 700)]
# Found by a long run: the Mamba prompt checkpoint (at hash granularity) lands at a Mamba block's end inside a
# chunk (config block 64, Mamba block 128), where no caching call registers it (spec: mamba_held, ``called``).
_TAIL_LAYOUT = Layout((Group("mamba", 128), Group("swa", 64, window=17), Group("full", 64)), prefix_match_unit=32,
                      name="tail")
PINNED += [WriteScenario(_TAIL_LAYOUT, speculation, retention, n, (("resend",), ("sibling", 1)), seed=n)
           for speculation in (Speculation("drop", 1), Speculation("none"))
           for retention in (0, None) for n in (160, 192, 288, 416)]

# D3 (docs/notes/vllm-0.32-policy.md, section 5.3): a prompt diverging from a first one, then one sharing the
# junction it records, with the EAGLE drop at retention 0. vLLM 0.33 keeps the dropping groups' state one block
# below the junction too and 0.32 does not: on gemma at N = 2000, cut 1500 (J = 1408) the third prompt hits
# 1344 on 0.33 and 0 on 0.32 (the generator's gemma prompts stay below 1,544 tokens, where the two agree).
_SWA_EAGLE = Layout((Group("full", 16), Group("swa", 16, window=32, eagle=True)), name="swa_eagle")
PINNED += [WriteScenario(layout, Speculation("drop", 1), 0, n, (("diverge", cut, n - cut, 300),), seed=n)
           for layout in (to_refimpl(CATALOGUE["gemma"]), _SWA_EAGLE)
           for n, cut in ((2000, 1500), (2000, 1000), (700, 450), (300, 200))]

# A request admitted with a hit inside its prompt's last block under multi-module MTP (Lp = 2), on a cache
# holding a prefix of its prompt (held_before; no stream of served prompts reaches such a hit on these layouts).
# A reviewer's case: full16 (DCP 2) + Mamba 32 + Mamba 128, prefix_match_unit 16, drop, R = 384, N = 193, hit
# 176. The only chunk runs 176 -> 193 through Mamba 32's block end at 192; vLLM and the model keep a state
# there only where the mask does (dense), and where a chunk must stop at 192 (config block 32: the block end
# after a start inside it), within Lp of the prompt end, both stall (S1). A single Mamba group and full
# attention with one Mamba group too, and neighbouring prompts.
_MTP2 = Speculation("drop", 2, multi_module_mtp=True)


def _full_mamba(full: int, mambas: tuple, dcp: int = 2, prefix_match_unit: int | None = 16) -> Layout:
    groups = (Group("full", full),) + tuple(Group("mamba", b) for b in mambas)
    return Layout(groups, dcp=dcp, prefix_match_unit=prefix_match_unit,
                  name=f"full{full}_" + "_".join(f"mamba{b}" for b in mambas))


_LAST_BLOCK = [(_full_mamba(16, (32, 128)), (193, 194, 200, 209)), (_full_mamba(32, (32, 128)), (193, 194)),
               (_full_mamba(16, (32,)), (193, 200)), (_full_mamba(16, (128,)), (193, 200)),
               (Layout((Group("mamba", 32),), name="mamba32"), (193, 200))]
for _layout, _prompts in _LAST_BLOCK:
    _h = derive_sizes(_layout, _MTP2).hash_block
    # full attention held up to the prompt's last hash boundary below N, Mamba one unit less (so what the request
    # writes past its hit is its own), or everything one unit lower
    PINNED += [WriteScenario(_layout, _MTP2, retention, n, (("sibling", 1), ("sibling", 16)), seed=n,
                             held_before=tuple((n - 1) // _h * _h - back - (_h if g.kind is Kind.MAMBA else 0)
                                               for g in _layout.groups))
               for retention in (384, None, 0) for n in _prompts for back in (0, _h)]


def _pinned_id(s: WriteScenario) -> str:
    held = f"-held{'_'.join(map(str, s.held_before))}" if s.held_before else ""
    return f"{s.layout.name}-{s.speculation.describe()}-R{s.retention}-N{s.n}{held}"


@pytest.mark.parametrize("scenario", PINNED,
                         ids=[_pinned_id(s) for s in PINNED])
def test_pinned_write_scenarios(scenario):
    _timed(scenario)
