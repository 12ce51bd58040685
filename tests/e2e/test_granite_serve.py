"""A Mamba-2 + attention hybrid under a real vLLM 0.32.0 server, with kvhit's plugin (issue 19).

The tiny GraniteMoeHybridForCausalLM of make_models.py is served by vLLM 0.32.0's CPU build with prefix
caching in Mamba align mode, in the settings of granite.py: with the test's plugin that turns off the Mamba-2
mid-prefill checkpoints the CPU cannot take (``nockpt-*``), at retention 0 and dense, and as vLLM ships it with
a one-block token budget (``budget128``: the backend takes no checkpoint in a one-block chunk); kvhit models
each layout, write side included. No speculation: vLLM has no MTP module for Granite
and its model class does not support EAGLE (it lacks ``SupportsEagle``), and ngram gives wrong outputs on it.

Expected numbers come from refimpl for the layout the enforce server reported: the first request 0, the first
repeat the policy's hit on the cache its own write side leaves (``reference`` under enforce, whose write side
kvhit owns here; vLLM 0.32.0's ``vllm_0_32`` under off and shadow).
"""

from __future__ import annotations

import pytest
from granite import BLOCK, LENGTHS, SETTINGS
from server import VLLM_VERSION
from test_vllm_serve import engine_layout, kvhit_lines

from kvhit.refimpl import REFERENCE, VLLM_0_32, derive_sizes, repeat_hits

POLICY_OF_MODE = {"enforce": REFERENCE, "shadow": VLLM_0_32, "off": VLLM_0_32}
NOCKPT = [s for s, (plugin, _, _) in SETTINGS.items() if plugin]


def test_this_is_vllm_0_32():
    assert VLLM_VERSION == "0.32.0"


@pytest.mark.parametrize("setting", NOCKPT)
def test_the_engine_builds_the_hybrid_layout_and_kvhit_models_it(serve_granite, setting):
    run = serve_granite(setting, "enforce")
    status = run.status()
    assert status is not None and status["modelled"] and status["write_side"] == "reference", status
    layout, speculation = engine_layout(status)
    assert [(g.kind.value, g.block_size) for g in layout.groups] == [("mamba", BLOCK), ("full", BLOCK)]
    assert speculation.mode.value == "none"
    assert "granite_nockpt: Mamba-2 prefill checkpoints off" in run.log()
    assert any("is modelled; mode enforce" in line for line in kvhit_lines(run.log()))


# Off and enforce in both settings; one shadow server (the dense one) is enough to compare shadow with off.
SERVERS = [("nockpt-r0", "off"), ("nockpt-r0", "enforce"), ("nockpt-dense", "off"), ("nockpt-dense", "shadow"),
           ("nockpt-dense", "enforce")]


@pytest.mark.parametrize(("setting", "kvhit_mode"), SERVERS)
def test_first_repeats_are_the_policy_prediction(serve_granite, setting, kvhit_mode):
    layout, speculation = engine_layout(serve_granite(setting, "enforce").status())
    sizes = derive_sizes(layout, speculation)
    retention = SETTINGS[setting][1]
    run = serve_granite(setting, kvhit_mode)
    served = {n: (run.first[n].cached_tokens, run.repeat[n].cached_tokens) for n in LENGTHS}
    expected = {n: (0, repeat_hits(sizes, n, retention, POLICY_OF_MODE[kvhit_mode], 1)[0]) for n in LENGTHS}
    assert served == expected, (setting, kvhit_mode)


@pytest.mark.parametrize("setting", NOCKPT)
def test_enforce_never_hits_less_than_stock_on_a_stream_sharing_a_prefix(serve_granite, setting):
    """Prompts that share 1, 2 or 3 blocks of an earlier one and then diverge: per request, enforce's
    cached tokens are at least stock's (off's); the greedy outputs are the same. Dense, the stream tells
    the two apart: enforce's write side keeps the Mamba states at P's block boundaries, vLLM 0.32.0's only
    where a prefill chunk ended, so some sibling hits more under enforce (the README's table)."""
    enforce, off = serve_granite(setting, "enforce"), serve_granite(setting, "off")
    assert [name for name, _ in enforce.stream] == [name for name, _ in off.stream]
    for (name, ours), (_, stock) in zip(enforce.stream, off.stream):
        assert ours.cached_tokens >= stock.cached_tokens, (setting, name, ours, stock)
        assert ours.text == stock.text, (setting, name)
    if SETTINGS[setting][1] is None:
        assert any(ours.cached_tokens > stock.cached_tokens
                   for (_, ours), (_, stock) in zip(enforce.stream, off.stream)), setting


def test_shadow_is_stock_on_the_hybrid(serve_granite):
    shadow, off = serve_granite("nockpt-dense", "shadow"), serve_granite("nockpt-dense", "off")
    assert shadow.status()["mode"] == "shadow"
    assert [(r.cached_tokens, r.text) for _, r in shadow.stream] == [(r.cached_tokens, r.text) for _, r in off.stream]
    assert {n: (shadow.first[n], shadow.repeat[n]) for n in LENGTHS} == {n: (off.first[n], off.repeat[n])
                                                                         for n in LENGTHS}


def test_as_vllm_ships_it_kvhit_enforces_the_layout(serve_granite):
    """With vLLM's own Mamba-2 spec (checkpoint blocks declared, a one-block budget so that the backend
    takes none), kvhit models the layout and owns its write side: the first repeats are the reference's,
    every request of the stream gets at least the off server's cached tokens, and the greedy outputs are
    the same."""
    enforce, off = serve_granite("budget128", "enforce"), serve_granite("budget128", "off")
    status = enforce.status()
    assert status is not None and status["modelled"] and status["write_side"] == "reference", status
    assert any("is modelled; mode enforce" in line for line in kvhit_lines(enforce.log()))
    layout, speculation = engine_layout(status)
    assert [(g.kind.value, g.block_size) for g in layout.groups] == [("mamba", BLOCK), ("full", BLOCK)]
    sizes = derive_sizes(layout, speculation)
    assert {n: (enforce.first[n].cached_tokens, enforce.repeat[n].cached_tokens) for n in LENGTHS} == {
        n: (0, repeat_hits(sizes, n, 0, REFERENCE, 1)[0]) for n in LENGTHS}
    assert [name for name, _ in enforce.stream] == [name for name, _ in off.stream]
    for (name, ours), (_, stock) in zip(enforce.stream, off.stream):
        assert ours.cached_tokens >= stock.cached_tokens, (name, ours, stock)
        assert ours.text == stock.text, name
    # and stock's first repeats are vllm_0_32's
    assert {n: off.repeat[n].cached_tokens for n in LENGTHS} == {n: repeat_hits(sizes, n, 0, VLLM_0_32, 1)[0]
                                                                 for n in LENGTHS}
