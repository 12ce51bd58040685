"""D3 on the engine: a dropping group's state one block below the shared-prefix junction.

vLLM 0.33's ``SingleTypeKVCacheManager.cache_blocks`` keeps a dropping group's state at the junction ``J``
and at ``J - b``; vLLM 0.32's only at ``J`` (``Rules.junction_below``; docs/notes/vllm-0.32-policy.md, D3).
The stream (section 5.3 of the notes): Gemma-like (full attention 64 + sliding window 32, window 512; no
EAGLE flag, so the coordinator flags both groups), EAGLE drop with one speculative token, retention 0, each
request sampling one token: serve ``A`` (2000 fresh tokens), serve ``B = A[:1500] + 500`` fresh (its
lookup records ``J = 1408``), then look up ``C = B[:J] + 300`` fresh. ``C`` needs the sliding-window tail
below ``J - 64`` and the peek block past it, which only 0.33 keeps: 0 on 0.32, 1344 on 0.33.

Run on whichever vLLM the venv has, against that release's policy (:data:`.differential.POLICY`), whose
written cache (the two requests' :func:`request_writes`, each clipped to what ``C`` shares with it) must
predict the engine's hit; the other release's rule predicts the other number, so the pin tells them apart.
"""

import random

from kvhit.refimpl import CacheState, Speculation, derive_sizes, hit_tokens, policy_rules
from kvhit.refimpl.policy import clip, junction_of, request_writes, written_cache
from kvhit.spec.catalogue import CATALOGUE

from .differential import POLICY, to_harness, to_refimpl
from .vllm_harness import VLLM_VERSION, VllmHarness

GEMMA = to_refimpl(CATALOGUE["gemma"])
DROP = Speculation("drop", 1)
N, CUT, TAIL = 2000, 1500, 300
JUNCTION = 1408
# C's hit per release (the notes' section 5.3, measured on both engines).
C_HIT = {"0.32.0": 0, "0.33.0": 1344}
OTHER = {"0.32.0": "vllm_0_33", "0.33.0": "vllm_0_32"}


def _model_c_hit(rules, hit_b: int, junction: int) -> int:
    """The hit of ``C`` on the cache ``A`` and ``B`` leave under ``rules``' write side, as ``C`` reads it."""
    sizes = derive_sizes(GEMMA, DROP)
    writes_a = request_writes(sizes, N, 0, rules)
    writes_b = request_writes(sizes, N, 0, rules, hit_b, junction)
    layered = tuple((clip(sizes, writes_a[k], junction), clip(sizes, writes_b[k], junction))
                    for k in range(len(sizes.groups)))
    return hit_tokens(written_cache(layered), sizes, junction + TAIL, rules)[0]


def _model_b(rules):
    """``B``'s hit and junction on the cache ``A`` leaves, as ``B`` (sharing ``CUT`` tokens) reads it."""
    sizes = derive_sizes(GEMMA, DROP)
    cache_a = written_cache(tuple((clip(sizes, g, CUT),) for g in request_writes(sizes, N, 0, rules)))
    hit, _, longest, _ = hit_tokens(cache_a, sizes, N, rules)
    return hit, junction_of(sizes, hit, longest, rules)


def serve_stream() -> tuple[int, int, int, int]:
    """Serve ``A`` and ``B`` on a new harness of vLLM's classes and look up ``C``, which shares the junction
    ``B`` recorded: ``(A's hit, B's hit, B's junction, C's hit)``."""
    rng = random.Random(N)

    def fresh(n):
        return [rng.randrange(1, 50_000) for _ in range(n)]

    harness = VllmHarness(to_harness(GEMMA), "drop", num_speculative_tokens=1, retention_interval=0,
                          max_model_len=4096)
    a_tokens = fresh(N)
    a = harness.serve(a_tokens, decode_steps=0)
    b_tokens = a_tokens[:CUT] + fresh(N - CUT)
    b = harness.serve(b_tokens, decode_steps=0)
    c = harness.probe(b_tokens[:b["spb"]] + fresh(TAIL))
    return a["hit"], b["hit"], b["spb"], c["hit"]


def test_a_prompt_diverging_right_after_the_junction_hits_what_the_release_keeps():
    a_hit, b_hit, junction, c_hit = serve_stream()
    assert a_hit == 0
    assert (b_hit, junction) == (0, JUNCTION) == _model_b(POLICY)

    assert c_hit == C_HIT[VLLM_VERSION], f"vLLM {VLLM_VERSION}: C hits {c_hit}"
    assert _model_c_hit(POLICY, b_hit, junction) == c_hit, POLICY.name
    other = policy_rules(OTHER[VLLM_VERSION])
    assert _model_c_hit(other, b_hit, junction) != c_hit, f"{other.name} does not tell the releases apart"
