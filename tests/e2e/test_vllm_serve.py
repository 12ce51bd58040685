"""`vllm serve` with kvhit's plugin, on the CPU, checked by a real OpenAI client (issue 7).

Each server serves a tiny random-weight Llama with an EAGLE-1 draft, prefix caching and prompt-token details,
block size 32, in vLLM's lookahead mode (the default) or drop mode (``disable_lookahead_block_hashes``), with
``KVHIT_MODE=enforce``, ``shadow`` or ``off``. Every prompt is sent twice. The expected ``cached_tokens`` come from the
generated ``kvhit.refimpl`` for the layout the plugin saw inside the engine-core process (its
``KVHIT_STATUS_FILE``), never from a hard-coded table: the first request hits what the policy hits on an empty
cache, the first repeat what it hits on the cache vLLM's write side leaves behind (kvhit enforces only the
read side), with the ``reference`` read side under ``enforce`` and ``vllm_0_33`` under ``off`` and ``shadow``;
shadow's /metrics counts exactly the repeats where the two differ.
"""

from __future__ import annotations

import re

import pytest
from server import LENGTHS, SPEC_MODES, cache_config_block_size, counter_total

from kvhit.refimpl import (REFERENCE, VLLM_0_33, Group, Layout, Speculation, derive_sizes, hit,
                           hit_tokens, request_writes, written_cache)

RETENTION_INTERVAL = 0   # vLLM 0.33's default prefix_cache_retention_interval (the server does not set it)
POLICY_OF_MODE = {"enforce": REFERENCE, "shadow": VLLM_0_33, "off": VLLM_0_33}
KVHIT_MODES = list(POLICY_OF_MODE)


def engine_layout(status: dict) -> tuple[Layout, Speculation]:
    """The refimpl layout and speculation the plugin reported from the engine-core process."""
    assert status["modelled"], f"kvhit did not model the engine's layout: {status.get('unmodelled')}"
    layout = status["layout"]
    groups = tuple(Group(**g) for g in layout["groups"])
    return (Layout(groups, layout["dcp"], layout["prefix_match_unit"]), Speculation(**status["speculation"]))


def predicted_cached_tokens(layout: Layout, speculation: Speculation, n: int, rules) -> tuple[int, int]:
    """(first request, first repeat) of an ``n``-token prompt under ``rules``' read side.

    The first request finds an empty cache; the repeat finds what vLLM 0.33's write side left (the
    ``vllm_0_33`` write side: kvhit does not change which blocks are cached).
    """
    sizes = derive_sizes(layout, speculation)
    first = hit(layout, speculation, n, [0] * len(sizes.groups), rules.name)
    left = written_cache(request_writes(sizes, n, RETENTION_INTERVAL, VLLM_0_33))
    return first, hit_tokens(left, sizes, n, rules)[0]


def kvhit_lines(log: str) -> list[str]:
    """kvhit's own log lines (its messages start with ``kvhit:``, ``kvhit enforce:`` or ``kvhit shadow:``)."""
    return [line for line in log.splitlines() if re.search(r"\] kvhit( enforce| shadow)?: ", line)]


@pytest.fixture
def layout_of(serve):
    def get(spec_mode: str) -> tuple[Layout, Speculation]:
        status = serve(spec_mode, "enforce").status()
        assert status is not None, "the enforce server wrote no KVHIT_STATUS_FILE"
        return engine_layout(status)

    return get


@pytest.mark.parametrize("kvhit_mode", ["enforce", "shadow"])
@pytest.mark.parametrize("spec_mode", SPEC_MODES)
def test_plugin_runs_in_the_engine_core_process(serve, spec_mode, kvhit_mode):
    run = serve(spec_mode, kvhit_mode)
    status = run.status()
    assert status is not None and status["mode"] == kvhit_mode, status
    lines = kvhit_lines(run.log())
    core = [line for line in lines if re.match(rf"\(EngineCore\w* pid={status['pid']}\) ", line)]
    assert any(f"kvhit: mode {kvhit_mode} on vLLM 0.33.0: replaced" in line for line in core), lines
    assert any(f"kvhit: layout {status['label']} (" in line and f"is modelled; mode {kvhit_mode}" in line
               for line in core), lines
    assert not [line for line in lines if "answered by vLLM" in line or "left to vLLM" in line
                or "not compared" in line or "failed" in line], lines


@pytest.mark.parametrize("spec_mode", SPEC_MODES)
def test_off_leaves_vllm_untouched(serve, layout_of, spec_mode):
    run = serve(spec_mode, "off")
    assert kvhit_lines(run.log()) == []
    assert run.status() is None
    # The off server has the layout the predictions use (the plugin does not run there to report it).
    layout, speculation = layout_of(spec_mode)
    assert cache_config_block_size(run.metrics) == derive_sizes(layout, speculation).scheduler_block


@pytest.mark.parametrize("n", LENGTHS)
@pytest.mark.parametrize("kvhit_mode", KVHIT_MODES)
@pytest.mark.parametrize("spec_mode", SPEC_MODES)
def test_cached_tokens_are_the_policy_prediction(serve, layout_of, spec_mode, kvhit_mode, n):
    layout, speculation = layout_of(spec_mode)
    run = serve(spec_mode, kvhit_mode)
    first, repeat = run.first[n], run.repeat[n]
    assert (first.prompt_tokens, repeat.prompt_tokens) == (n, n)
    expected = predicted_cached_tokens(layout, speculation, n, POLICY_OF_MODE[kvhit_mode])
    assert expected[0] == 0
    assert (first.cached_tokens, repeat.cached_tokens) == expected, (
        f"{spec_mode}, KVHIT_MODE={kvhit_mode}, N={n}: served (first, repeat) = "
        f"{(first.cached_tokens, repeat.cached_tokens)}, {POLICY_OF_MODE[kvhit_mode].name} predicts {expected}")


def test_enforce_keeps_the_block_vllm_0_33_drops_on_block_aligned_prompts(serve, layout_of):
    """Drop mode: on a block-aligned prompt vLLM 0.33's Unitary coordinator caps at N - 1 and then drops a
    whole block (F2); the reference keeps it. The served numbers must show the difference."""
    layout, speculation = layout_of("drop")
    block = derive_sizes(layout, speculation).scheduler_block
    differ = [n for n in LENGTHS
              if predicted_cached_tokens(layout, speculation, n, REFERENCE)[1]
              != predicted_cached_tokens(layout, speculation, n, VLLM_0_33)[1]]
    assert differ == [n for n in LENGTHS if n % block == 0], differ
    enforce, off = serve("drop", "enforce"), serve("drop", "off")
    for n in differ:
        assert enforce.repeat[n].cached_tokens == off.repeat[n].cached_tokens + block, n


@pytest.mark.parametrize("spec_mode", SPEC_MODES)
def test_shadow_metrics_count_the_repeats_where_reference_and_vllm_differ(serve, layout_of, spec_mode):
    layout, speculation = layout_of(spec_mode)
    gaps = []
    for n in LENGTHS:
        ours = predicted_cached_tokens(layout, speculation, n, REFERENCE)
        stock = predicted_cached_tokens(layout, speculation, n, VLLM_0_33)
        gaps += [abs(a - b) for a, b in zip(ours, stock) if a != b]
    metrics = serve(spec_mode, "shadow").metrics
    if gaps:   # a labelled counter appears on /metrics once it has a sample
        assert "kvhit_hit_divergences_total{" in metrics
    assert counter_total(metrics, "kvhit_hit_divergences_total") == len(gaps)
    assert counter_total(metrics, "kvhit_hit_divergence_tokens_total") == sum(gaps)


@pytest.mark.parametrize("spec_mode", SPEC_MODES)
def test_greedy_outputs_are_identical_in_every_kvhit_mode(serve, spec_mode):
    off = serve(spec_mode, "off")
    for kvhit_mode in ("enforce", "shadow"):
        run = serve(spec_mode, kvhit_mode)
        for n in LENGTHS:
            assert off.first[n].text, n
            assert (run.first[n].text, run.repeat[n].text) == (off.first[n].text, off.repeat[n].text), (
                kvhit_mode, n)
    for n in LENGTHS:
        assert off.repeat[n].text == off.first[n].text, n
