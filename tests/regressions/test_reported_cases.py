"""Numbers from outside kvhit: the DeepSeek-V4 report, and hits measured on the real vLLM 0.33.0.

The vLLM numbers were measured by driving vLLM 0.33.0's own KVCacheManager on the CPU (serve the prompt once,
then look up the identical prompt), and by `vllm serve` of a tiny Llama with an EAGLE draft and block size 32,
reading `usage.prompt_tokens_details.cached_tokens` of the first repeat. The `vllm_0_33` policy must
reproduce them on a cache holding the served prompt.
"""

import pytest

from kvhit.convert import to_refimpl
from kvhit.refimpl import Group, Layout, Speculation, hit
from kvhit.spec.catalogue import CATALOGUE

DROP, NONE = Speculation("drop", 1), Speculation("none")
LOOKAHEAD = Speculation("lookahead", 1)


def _whole_prompt(layout, n):
    from kvhit.refimpl import derive_sizes

    return [n] * len(derive_sizes(layout, NONE).groups)


def test_historical_mtp_drop_halves_the_deepseek_v4_hit_as_reported():
    layout = to_refimpl(CATALOGUE["dsv4_report"])
    cache = _whole_prompt(layout, 46240)
    assert hit(layout, NONE, 46240, cache, "historical") == 32768
    assert hit(layout, DROP, 46240, cache, "historical") == 16384


def test_reference_and_vllm_0_33_keep_the_deepseek_v4_hit_on_a_dense_cache():
    layout = to_refimpl(CATALOGUE["dsv4_report"])
    cache = _whole_prompt(layout, 46240)
    assert hit(layout, DROP, 46240, cache, "reference") == 32768
    assert hit(layout, DROP, 46240, cache, "vllm_0_33") == 32768


@pytest.mark.parametrize("name, pmu, n, mode, measured", [
    ("full16", None, 1024, NONE, 1008), ("full16", None, 1024, LOOKAHEAD, 1008),
    ("full16", None, 1024, DROP, 992),
    ("gemma", None, 1024, NONE, 960), ("gemma", None, 1024, LOOKAHEAD, 960), ("gemma", None, 1024, DROP, 960),
    ("qwen3next", None, 11910, NONE, 11200), ("qwen3next", None, 11910, LOOKAHEAD, 11200),
    ("qwen3next", None, 11910, DROP, 9600),
    ("qwen3next_pmu160", 160, 11910, NONE, 11840), ("qwen3next_pmu160", 160, 11910, LOOKAHEAD, 11840),
    ("qwen3next_pmu160", 160, 11910, DROP, 11680),
])
def test_vllm_0_33_reproduces_hits_measured_on_vllm_kv_cache_manager(name, pmu, n, mode, measured):
    layout = to_refimpl(CATALOGUE[name])
    assert hit(layout, mode, n, _whole_prompt(layout, n), "vllm_0_33") == measured


@pytest.mark.parametrize("n, lookahead, drop", [(100, 96, 64), (128, 96, 64), (250, 224, 192),
                                                (256, 224, 192), (511, 480, 448)])
def test_vllm_0_33_reproduces_cached_tokens_of_vllm_serve_with_eagle(n, lookahead, drop):
    """Target and draft layers share one full-attention group of block 32 (the engine's layout)."""
    layout = Layout((Group("full", 32, eagle=True),))
    assert hit(layout, LOOKAHEAD, n, [n], "vllm_0_33") == lookahead
    assert hit(layout, DROP, n, [n], "vllm_0_33") == drop


# ----------------------------------------------------------------------------------------------------
# The write side: what a served prompt leaves behind, and what its repeats hit
# ----------------------------------------------------------------------------------------------------

MTP2_DROP = Speculation("drop", 2, True)
MTP2_LOOKAHEAD = Speculation("lookahead", 2, True)


def _repeats(name, speculation, n, interval, policy, times=3):
    from kvhit.refimpl import ALL_POLICIES, derive_sizes, repeat_hits

    layout = to_refimpl(CATALOGUE[name])
    return repeat_hits(derive_sizes(layout, speculation), n, interval, ALL_POLICIES[policy], times)


def test_historical_mask_misses_the_first_repeat_of_the_qwen3_next_report():
    """Qwen3.8-27B-FP8-like (1600-token blocks, MTP with two speculative tokens, retention 0): the mask
    kept the state at 11200, the EAGLE-adjusted resume point was 9600, the first repeat missed."""
    from kvhit.refimpl import HISTORICAL, derive_sizes, request_writes

    sizes = derive_sizes(to_refimpl(CATALOGUE["qwen3next"]), MTP2_DROP)
    mamba = request_writes(sizes, 11910, 0, HISTORICAL)[1]
    assert sorted({p for p in mamba.points if p > 0}) == [11200]
    assert _repeats("qwen3next", MTP2_DROP, 11910, 0, "historical") == (0, 9600, 9600)


@pytest.mark.parametrize("policy", ["reference", "vllm_0_33"])
def test_first_repeat_of_the_qwen3_next_report_hits_under_vllm_0_33_and_reference(policy):
    assert _repeats("qwen3next", MTP2_DROP, 11910, 0, policy) == (9600, 9600, 9600)


@pytest.mark.parametrize("name, speculation, n, interval, measured", [
    # measured on vLLM 0.33.0's KVCacheManager and scheduler chunk rules (tests/conformance harness):
    # serve the prompt once, then resend it three times
    ("qwen3next", MTP2_DROP, 11910, 0, (9600, 9600, 9600)),
    ("qwen3next", MTP2_DROP, 8000, None, (0, 4800, 4800)),     # W1: a block-aligned prompt misses once
    ("qwen3next", MTP2_DROP, 8000, 0, (0, 4800, 4800)),
    ("gemma", MTP2_LOOKAHEAD, 577, 0, (0, 512, 512)),         # W3: replay boundary ignores the lookahead
    ("dsv4_report", DROP, 46240, 0, (16384, 32768, 32768)),   # W4: the DeepSeek-V4 report at retention 0
    ("dsv4_report", DROP, 46240, None, (32768, 32768, 32768)),
])
def test_vllm_0_33_reproduces_repeat_hits_measured_on_vllm(name, speculation, n, interval, measured):
    assert _repeats(name, speculation, n, interval, "vllm_0_33") == measured


def test_vllm_0_33_loses_a_block_for_a_longer_sibling_of_a_block_aligned_prompt():
    """W2, measured on vLLM 0.33.0: gemma, no drafter, retention 0, prompt 704 served, then a prompt of
    800 tokens extending it hits 640 (704 with dense retention)."""
    from kvhit.refimpl import ALL_POLICIES, derive_sizes, hit_tokens, request_writes, written_cache

    sizes = derive_sizes(to_refimpl(CATALOGUE["gemma"]), NONE)
    for interval, policy, want in ((0, "vllm_0_33", 640), (None, "vllm_0_33", 704), (0, "reference", 704)):
        rules = ALL_POLICIES[policy]
        cache = written_cache(request_writes(sizes, 704, interval, rules))
        assert hit_tokens(cache, sizes, 800, rules)[0] == want, (interval, policy)


@pytest.mark.parametrize("interval, mamba32", [(384, []), (0, []), (None, [192])])
def test_vllm_0_33_keeps_a_mamba_state_inside_the_prefill_lookahead_only_where_vllm_does(interval, mamba32):
    """Measured on vLLM 0.33.0 (tests/conformance, a write scenario on a held prefix): full16 (DCP 2) + Mamba 32
    + Mamba 128, prefix_match_unit 16, MTP 2 drop, a prompt of 193 tokens admitted at 176 with no junction.
    Its one chunk runs 176 -> 193 through Mamba 32's block end at 192, within Lp = 2 of the prompt end; vLLM
    keeps that state only with dense retention, and Mamba 128 keeps nothing past the hit."""
    from kvhit.refimpl import ALL_POLICIES, derive_sizes, request_writes, written_cache
    from kvhit.refimpl.policy import NO_JUNCTION

    layout = Layout((Group("full", 16), Group("mamba", 32), Group("mamba", 128)), dcp=2, prefix_match_unit=16)
    sizes = derive_sizes(layout, MTP2_DROP)
    cache = written_cache(request_writes(sizes, 193, interval, ALL_POLICIES["vllm_0_33"], 176, NO_JUNCTION))
    assert [x for x in range(177, 194) if cache.has(1, x)] == mamba32
    assert [x for x in range(177, 194) if cache.has(2, x)] == []
