"""Candidate C2 on the engine: the scheduler and the Mamba manager judge a backend-internal prefill checkpoint
on different block sizes, and the prompt's Mamba state is never saved (docs/findings.md).

A Mamba-2 layer's spec declares a backend-internal prefill checkpoint (``num_prefill_checkpoint_blocks = 1``,
alignment 1). On the chunk that reaches the prompt end, vLLM's ``Scheduler._mamba_block_aligned_split`` then
drops its stop at the prompt's checkpoint when ``is_mamba_prefill_checkpoint_valid`` holds on
``cache_config.block_size`` (the smallest block of the layout), and ``MambaManager._needs_internal_checkpoint``
reserves the block the backend saves it in when the same check holds on the Mamba group's own block. On
``three_kind`` (full attention 1600, Mamba 1600, sliding window 160, read at 160) with a token budget of 2048
the last chunk starts inside the Mamba block that holds the checkpoint: the scheduler says yes (on 160), the
manager no (on 1600), and no state is kept at the checkpoint. The first resend hits 0; it recomputes the
prompt, keeps the state, and the second resend hits it.

The harness clips every chunk with the scheduler's own ``_mamba_block_aligned_split`` and allocates with the
real ``KVCacheManager``. The numbers without the checkpoint are the release's model's (``refimpl.repeat_hits``
of ``vllm_0_33``, or ``vllm_0_32`` on 0.32.0), on the same engine; the first resend's 0 is what the engine
does with it. kvhit's enforce does not rely on such a checkpoint (``engine.backend_checkpoint`` asks both):
``tests/adapter/test_enforce_write_side.py::test_enforce_keeps_the_checkpoint_vllm_loses``.
"""

import random

import pytest
from vllm.v1.kv_cache_interface import get_mamba_prefill_checkpoint_position, is_mamba_prefill_checkpoint_valid

import kvhit.refimpl as R
from tests.adapter.layouts import harness_layout, refimpl_layout, speculation

from .differential import POLICY
from .vllm_harness import MODES, VllmHarness

THREE_KIND = refimpl_layout("three_kind")
BUDGET = 2048
# (mode, speculative tokens, N); vLLM 0.32.0 has no lookahead mode
CASES = [c for c in [("lookahead", 2, 8000), ("lookahead", 2, 11910), ("none", 1, 8000), ("none", 1, 11910)]
         if c[0] in MODES]


def _serve_and_resend(mode, k, n, checkpoint):
    """The prompt's chunks on an empty cache, then its first and second resends' hits."""
    harness = VllmHarness(harness_layout("three_kind", prefill_checkpoint=checkpoint), mode,
                          num_speculative_tokens=k, multi_module_mtp=k > 1, retention_interval=0,
                          max_model_len=n + 4000, max_num_batched_tokens=BUDGET)
    tokens = [random.Random(n).randrange(1, 50_000) for _ in range(n)]
    chunks = harness.serve(tokens, decode_steps=0)["chunks"]
    hits = []
    for _ in range(2):
        hits.append(harness.probe(tokens)["hit"])
        harness.serve(tokens, decode_steps=0)
    return chunks, tuple(hits)


@pytest.mark.parametrize("mode, k, n", CASES)
def test_without_the_checkpoint_both_resends_hit_the_models_number(mode, k, n):
    sizes = R.derive_sizes(THREE_KIND, speculation(mode, k, k > 1))
    _, hits = _serve_and_resend(mode, k, n, checkpoint=False)
    assert hits == R.repeat_hits(sizes, n, 0, POLICY, 2)
    assert hits[0] == hits[1] > 0


@pytest.mark.parametrize("mode, k, n", CASES)
def test_c2_with_the_checkpoint_the_first_resend_misses(mode, k, n):
    sizes = R.derive_sizes(THREE_KIND, speculation(mode, k, k > 1))
    chunks, hits = _serve_and_resend(mode, k, n, checkpoint=True)
    assert hits == (0, R.repeat_hits(sizes, n, 0, POLICY, 2)[1]), (chunks, hits)
    # The cause, in vLLM's own functions: the last chunk's checkpoint is valid on the config's block (160)
    # and not on the Mamba block (1600).
    start = n - chunks[-1]
    lookahead = sizes.hash_lookahead
    position = get_mamba_prefill_checkpoint_position(n, sizes.hash_block, False, *((lookahead,) if lookahead else ()))
    valid = [is_mamba_prefill_checkpoint_valid(start, n, position, sizes.hash_block, block, 1)
             for block in (160, 1600)]
    assert valid == [True, False], (start, position)
