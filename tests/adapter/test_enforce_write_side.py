"""KVHIT_MODE=enforce on vLLM 0.33.0's write side: what a request leaves is the reference's.

Every expected value comes from ``kvhit.refimpl`` on the catalogue layout (``tests/adapter/layouts.py``):
``request_writes``/``written_cache`` for what one request leaves, ``repeat_hits`` for the resends. The
engine is vLLM's real ``KVCacheManager`` and scheduler chunk functions (``tests/conformance/vllm_harness``).

The spec models a request that samples one token and ends, so requests are served with
``decode_steps=0``; with decode steps vLLM caches once more after the sampled token (see
``test_decode_steps_only_add_state``).
"""

from __future__ import annotations

import random

import pytest

import kvhit.adapters.vllm as kvhit_vllm
import kvhit.refimpl as R
from kvhit.adapters.vllm import engine
from tests.adapter.layouts import harness_layout, refimpl_layout, speculation
from tests.conformance.vllm_harness import VllmHarness

# (catalogue layout, DCP sizes, prompt lengths): one prompt ending inside a block, one on a block edge.
LAYOUTS = [
    ("full16", (1, 2, 4), (1000, 1024)),
    ("llama_eagle", (1, 2, 4), (1000, 1024)),
    ("gemma", (1,), (1000, 704)),
    ("qwen3next", (1, 2, 4), (11910, 8000)),
    ("qwen3next_pmu160", (1,), (11910, 8000)),
    ("three_kind", (1,), (11910, 8000)),
    ("dsv4_cuda", (1,), (3000, 2816)),
    ("dsv4_report", (1,), (46240,)),
]
MODES = ("none", "lookahead", "drop")


def _retentions(name, dcp=1):
    """None, 0 and 2 S where vLLM accepts them (an interval other than 0 needs an SWA or Mamba group)."""
    layout = refimpl_layout(name, dcp)
    if not any(g.kind in (R.Kind.SWA, R.Kind.MAMBA) for g in layout.groups):
        return (0,)
    s = R.derive_sizes(layout, speculation("none")).scheduler_block
    return (None, 0, 2 * s)


def _cases():
    for name, dcps, lengths in LAYOUTS:
        for dcp in dcps:
            for mode in MODES:
                for retention in _retentions(name, dcp):
                    yield pytest.param(name, dcp, lengths, mode, 1, retention, False,
                                       id=f"{name}-dcp{dcp}-{mode}-ri{retention}")
    for mode in ("lookahead", "drop"):  # Qwen3-Next-like with multi-module MTP, 2 speculative tokens
        for retention in _retentions("qwen3next"):
            yield pytest.param("qwen3next", 1, (11910, 8000), mode, 2, retention, False,
                               id=f"qwen3next-dcp1-{mode}-mtp2-ri{retention}")
    # With a Mamba group read at hash granularity, multi-module MTP only with lookahead hashes: in drop mode
    # the layout is left to vLLM (test_mamba_read_at_hash_granularity_with_mtp_drop_is_left_wholly_to_vllm).
    for name in ("qwen3next_pmu160", "three_kind"):
        for retention in _retentions(name):
            yield pytest.param(name, 1, (11910, 8000), "lookahead", 2, retention, False,
                               id=f"{name}-dcp1-lookahead-mtp2-ri{retention}")
    # Every Mamba layer declaring a backend-internal prefill checkpoint, as vLLM's Mamba-2 layers do: the
    # scheduler lets the prompt's last chunk run past the checkpoint, which the backend saves inside it.
    for name, mode, k in (("qwen3next", "none", 1), ("qwen3next", "drop", 2), ("qwen3next", "lookahead", 2),
                          ("qwen3next_pmu160", "drop", 1), ("three_kind", "lookahead", 2)):
        for retention in _retentions(name):
            yield pytest.param(name, 1, (11910, 8000), mode, k, retention, True,
                               id=f"{name}-dcp1-{mode}-k{k}-ri{retention}-checkpoint")


def _harness(name, dcp, n, mode, k=1, retention=0, checkpoint=False):
    S = R.derive_sizes(refimpl_layout(name, dcp), speculation("none")).scheduler_block
    return VllmHarness(harness_layout(name, dcp, checkpoint), mode, num_speculative_tokens=k,
                       multi_module_mtp=k > 1, retention_interval=retention, max_model_len=n + 2 * S + 64)


def _tokens(n, seed=0):
    rng = random.Random(f"{n}/{seed}")
    return [rng.randrange(1, 50000) for _ in range(n)]


def _retained(harness, sizes, tokens):
    """Per spec group, the boundaries up to ``N - L`` vLLM's block pool holds for ``tokens`` (a spec group
    holds one when every KV-cache group it merges does)."""
    limit = len(tokens) - sizes.hash_lookahead
    per_group = harness.retained(tokens)
    return [sorted(x for x in set.intersection(*(set(per_group[m]) for m in sg.members)) if x <= limit)
            for sg in sizes.groups]


def _reference_retained(sizes, n, retention):
    """Per spec group, the boundaries up to ``N - L`` of ``refimpl.written_cache(request_writes(...))``."""
    cache = R.written_cache(R.request_writes(sizes, n, retention, R.REFERENCE))
    h = sizes.hash_block
    return [[x for x in range(h, n - sizes.hash_lookahead + 1, h) if cache.has(k, x)]
            for k in range(len(sizes.groups))]


@pytest.mark.parametrize("name, dcp, lengths, mode, k, retention, checkpoint", list(_cases()))
def test_enforce_write_side_leaves_the_reference_cache_and_repeats_are_stable(name, dcp, lengths, mode, k,
                                                                              retention, checkpoint):
    """One request on an empty cache leaves exactly the reference's retained boundaries (up to N - L),
    and its first and second resends hit ``refimpl.repeat_hits(..., REFERENCE)``, which are equal; with
    backend-internal Mamba prefill checkpoints (``checkpoint``) too."""
    assert kvhit_vllm.install("enforce")
    layout, spec = refimpl_layout(name, dcp), speculation(mode, k, k > 1)
    sizes = R.derive_sizes(layout, spec)
    for n in lengths:
        harness = _harness(name, dcp, n, mode, k, retention, checkpoint)
        model = engine._models[harness.manager.coordinator]
        assert model is not None and model.write is not None, model and model.write_note
        fallbacks = engine.ENFORCE_FALLBACKS.labels(model.label)._value.get()  # the process's counter
        tokens = _tokens(n)
        served = harness.serve(tokens, decode_steps=0)
        context = f"{name} dcp{dcp} {spec.describe()} R={retention} N={n} chunks={served['chunks']}"
        assert _retained(harness, sizes, tokens) == _reference_retained(sizes, n, retention), context
        expected = R.repeat_hits(sizes, n, retention, R.REFERENCE, 2)
        assert expected[0] == expected[1], (context, expected)
        hits = []
        for _ in range(2):
            probe = harness.probe(tokens)
            hits.append(probe["hit"])
            assert probe["spb"] == 0, (context, probe)  # the reference records no junction
            harness.serve(tokens, decode_steps=0)
        assert tuple(hits) == expected, (context, hits, expected)
        assert engine.ENFORCE_FALLBACKS.labels(model.label)._value.get() == fallbacks


MTP2_DROP = ("drop", 2)


def _repeats(name, n, retention, mode="drop", k=2, repeats=3):
    harness = _harness(name, 1, n, mode, k, retention)
    tokens = _tokens(n)
    harness.serve(tokens, decode_steps=0)
    hits = []
    for _ in range(repeats):
        hits.append(harness.probe(tokens)["hit"])
        harness.serve(tokens, decode_steps=0)
    return tuple(hits)


def test_stock_w1_block_aligned_prompt_misses_its_first_repeat():
    """W1 on vLLM 0.33.0 itself: qwen3next, MTP 2 in drop mode, N = 8000, retention 0: [0, 4800, 4800]."""
    assert _repeats("qwen3next", 8000, 0) == (0, 4800, 4800)


@pytest.mark.parametrize("retention", [None, 0, 3200])
def test_enforce_w1_hits_4800_from_the_first_repeat(retention):
    assert kvhit_vllm.install("enforce")
    assert _repeats("qwen3next", 8000, retention) == (4800, 4800, 4800)


def test_enforce_qwen3_next_report_first_repeat_hits_9600():
    """The Qwen3-Next report: 1600 + 1600, MTP 2 in drop mode, default retention 0, N = 11910."""
    assert kvhit_vllm.install("enforce")
    assert _repeats("qwen3next", 11910, 0) == (9600, 9600, 9600)


def test_decode_steps_only_add_state():
    """With decode steps vLLM caches once more after the sampled token (the spec models one sampled token):
    the pool then holds at least the reference's boundaries, and the enforced hit is at least the
    reference's first repeat (qwen3next, MTP 2 drop, N = 8000: the EAGLE group's block at 8000 becomes
    cacheable, so the hit is 6400)."""
    assert kvhit_vllm.install("enforce")
    sizes = R.derive_sizes(refimpl_layout("qwen3next"), speculation("drop", 2, True))
    for retention in (None, 0):
        harness = _harness("qwen3next", 1, 8000, "drop", 2, retention)
        tokens = _tokens(8000)
        harness.serve(tokens, decode_steps=2)
        got = _retained(harness, sizes, tokens)
        want = _reference_retained(sizes, 8000, retention)
        assert all(set(w) <= set(g) for g, w in zip(got, want)), (got, want)
        assert harness.probe(tokens)["hit"] >= R.repeat_hits(sizes, 8000, retention, R.REFERENCE, 1)[0]


def _stock_run(name, n, mode, k, retention):
    harness = _harness(name, 1, n, mode, k, retention)
    tokens = _tokens(n)
    chunks = [harness.serve(tokens)["chunks"]]
    sibling = tokens[: 2 * n // 3] + _tokens(n - 2 * n // 3, seed=1)
    chunks.append(harness.serve(sibling)["chunks"])
    chunks.append(harness.serve(tokens)["chunks"])
    return chunks, harness.retained(tokens), harness.retained(sibling), harness.probe(tokens)


@pytest.mark.parametrize("name, n, mode, k, retention", [
    ("qwen3next", 8000, "drop", 2, 0), ("qwen3next", 11910, "drop", 1, None),
    ("dsv4_cuda", 3000, "drop", 1, 0),
    ("gemma", 704, "none", 1, 0),
])
def test_off_and_shadow_leave_the_write_side_stock(name, n, mode, k, retention):
    """Chunks, retained boundaries and hits are vLLM's own after install/uninstall and under shadow."""
    stock = _stock_run(name, n, mode, k, retention)
    assert kvhit_vllm.install("enforce")
    enforced = _stock_run(name, n, mode, k, retention)
    kvhit_vllm.uninstall()
    assert _stock_run(name, n, mode, k, retention) == stock
    assert kvhit_vllm.install("shadow")
    assert _stock_run(name, n, mode, k, retention) == stock
    if (name, n) in (("qwen3next", 8000), ("dsv4_cuda", 3000)):
        assert enforced != stock  # the comparison can fail: enforce does change these


def test_mamba_read_at_hash_granularity_with_mtp_drop_is_left_wholly_to_vllm(kvhit_log):
    """qwen3next with prefix_match_unit 160 and MTP 2 in drop mode, no group flagged EAGLE, so vLLM flags every
    one and the Mamba group drops (``refimpl.FINE_MAMBA_MTP_DROP``: its caching calls end before the chunk and
    no tail is keyed at the resend's resume point). The whole layout is left to vLLM, said
    once in the log, and the chunks, the cache left and the hits are vLLM's. With one drafted token the same
    layout is enforced (``test_enforce_write_side_leaves_the_reference_cache_and_repeats_are_stable``)."""
    stock = _stock_run("qwen3next_pmu160", 11910, "drop", 2, 0)
    assert kvhit_vllm.install("enforce")
    harness = _harness("qwen3next_pmu160", 1, 11910, "drop", 2, 0)
    assert engine._models[harness.manager.coordinator] is None
    notes = [r.getMessage() for r in kvhit_log.records if "not model its write side" in r.getMessage()]
    assert notes and R.FINE_MAMBA_MTP_DROP in notes[0], notes
    assert _stock_run("qwen3next_pmu160", 11910, "drop", 2, 0) == stock
    assert engine._models[_harness("qwen3next_pmu160", 1, 11910, "drop", 1, 0).manager.coordinator] is not None


def test_write_side_failure_is_answered_by_vllm_and_counted(monkeypatch):
    """If the reference write side raises, vLLM's own boundaries and chunk stops are used for that call,
    the fallback counter grows and the scheduler goes on: the cache left is stock vLLM's."""
    stock = _harness("qwen3next", 1, 8000, "drop", 2, 0)
    tokens = _tokens(8000)
    stock_chunks = stock.serve(tokens, decode_steps=0)["chunks"]

    def broken(self, n_tokens):
        raise RuntimeError("broken on purpose")

    monkeypatch.setattr(engine.WriteModel, "resume_points", broken)
    assert kvhit_vllm.install("enforce")
    harness = _harness("qwen3next", 1, 8000, "drop", 2, 0)
    model = engine._models[harness.manager.coordinator]
    before = engine.ENFORCE_FALLBACKS.labels(model.label)._value.get()
    assert harness.serve(tokens, decode_steps=0)["chunks"] == stock_chunks
    assert harness.retained(tokens) == stock.retained(tokens)
    assert engine.ENFORCE_FALLBACKS.labels(model.label)._value.get() > before


@pytest.mark.parametrize("mode, k", [("lookahead", 2), ("none", 1)])
@pytest.mark.parametrize("n", [8000, 11910])
def test_enforce_keeps_the_checkpoint_vllm_loses(mode, k, n):
    """C2 (docs/findings.md; ``tests/conformance/test_backend_checkpoint.py``): on ``three_kind`` with
    backend-internal Mamba prefill checkpoints and a token budget of 2048, vLLM's scheduler lets the last
    chunk run past the prompt's checkpoint and its Mamba manager reserves no block for it, so stock's first
    resend hits 0. Enforce ends the chunk there itself (``engine.backend_checkpoint`` asks the manager too):
    what the request leaves holds the reference's (and the states at the budget's chunk ends that vLLM's mask
    keeps: the model's prefill runs in one chunk per Mamba stop), and both resends hit
    ``refimpl.repeat_hits``."""
    assert kvhit_vllm.install("enforce")
    sizes = R.derive_sizes(refimpl_layout("three_kind"), speculation(mode, k, k > 1))
    harness = VllmHarness(harness_layout("three_kind", prefill_checkpoint=True), mode, num_speculative_tokens=k,
                          multi_module_mtp=k > 1, retention_interval=0, max_model_len=n + 4000,
                          max_num_batched_tokens=2048)
    tokens = _tokens(n)
    harness.serve(tokens, decode_steps=0)
    held = _retained(harness, sizes, tokens)
    for group, (got, want) in enumerate(zip(held, _reference_retained(sizes, n, 0))):
        assert set(want) <= set(got), (group, got, want)
    hits = []
    for _ in range(2):
        hits.append(harness.probe(tokens)["hit"])
        harness.serve(tokens, decode_steps=0)
    assert tuple(hits) == R.repeat_hits(sizes, n, 0, R.REFERENCE, 2)
    assert hits[0] > 0
