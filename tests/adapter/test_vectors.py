"""Every pinned counterexample (``tests/vectors/hit_tokens``), replayed on vLLM's real classes: the block
pool is seeded with the vector's cache state and the enforced lookup must give the reference hit.

Among them are the states where vLLM 0.33.0 itself goes wrong: the Unitary drop losing a safe block (F2)
and lookups reading past the request's hashes, which raise ``IndexError`` in vLLM (F1), chunked local
attention's included.
"""

from __future__ import annotations

import json
import random

import pytest
from vllm.v1.core.kv_cache_utils import make_block_hash_with_group_id

import kvhit.adapters.vllm as kvhit_vllm
import kvhit.refimpl as R
from kvhit.adapters.vllm import engine, v0_33
from kvhit.convert import to_refimpl
from kvhit.proofs.model import cache_from_runs
from tests.adapter.layouts import harness_layout, unsound_blocks
from tests.conformance.vllm_harness import VllmHarness
from tests.regressions.test_counterexamples import VECTORS, _config


def _refimpl(config):
    return to_refimpl(config.layout), to_refimpl(config.speculation)


# Read-side vectors pin a cache state and the hits on it; write-side vectors (``repeat_hits``) pin a prompt
# served on an empty cache and the hits of its resends.
READ_VECTORS = [p for p in VECTORS if "hits" in json.loads(p.read_text())]
WRITE_VECTORS = [p for p in VECTORS if "repeat_hits" in json.loads(p.read_text())]


def test_every_vector_is_replayed_by_one_of_the_tests():
    assert sorted(READ_VECTORS + WRITE_VECTORS) == sorted(VECTORS) and WRITE_VECTORS


@pytest.mark.parametrize("path", READ_VECTORS, ids=[p.stem for p in READ_VECTORS])
def test_enforce_gives_the_reference_hit_on_every_pinned_counterexample_state(path):
    record = json.loads(path.read_text())
    config = _config(record)
    layout, spec = _refimpl(config)
    n = record["N"]
    assert kvhit_vllm.install("enforce")
    harness = VllmHarness(harness_layout(config.layout, config.layout.dcp), spec.mode.value,
                          num_speculative_tokens=max(1, spec.num_speculative_tokens),
                          multi_module_mtp=spec.multi_module_mtp, max_model_len=n + 64)
    tokens = [random.Random(path.stem).randrange(1, 50000) for _ in range(n)]
    request = harness._new_request(tokens)
    hashes = request.block_hashes

    # Seed the pool: spec group k holds boundary x (within the hashes) as the vector says.
    runs = {(int(k), item["unit"]): [tuple(span) for span in item["blocks"]]
            for k, items in record["cache"].items() for item in items}
    vector_cache, _ = cache_from_runs(runs)
    sizes = R.derive_sizes(layout, spec)
    h = sizes.hash_block
    pool = harness.manager.block_pool
    free = iter(pool.blocks[1:])
    seeded = set()
    for k, sg in enumerate(sizes.groups):
        for j in range(len(hashes)):
            if vector_cache.has(k, (j + 1) * h):
                seeded.add((k, (j + 1) * h))
                for gid in sg.members:
                    pool.cached_block_hash_to_block.insert(make_block_hash_with_group_id(hashes[j], gid),
                                                           next(free))

    expected = R.hit(layout, spec, n, R.CacheState(lambda k, x: (k, x) in seeded), "reference")
    assert expected == record["hits"]["reference"]
    coordinator = harness.manager.coordinator
    original = v0_33.ORIGINAL.unitary_find if sizes.unitary else v0_33.ORIGINAL.hybrid_find

    def lookup(find):
        try:
            return find(coordinator, hashes, n - 1)[1]
        except IndexError as e:  # vLLM 0.33 reading past the hashes (F1)
            return f"IndexError: {e}"

    stock = lookup(original)
    fallbacks = engine.ENFORCE_FALLBACKS.labels(engine._models[coordinator].label)  # the process's counter
    before = fallbacks._value.get()
    blocks, hit, _ = coordinator.find_longest_cache_hit(hashes, n - 1)
    assert hit == expected, f"{path.stem}: enforce {hit}, reference {expected}, vLLM {stock}"
    assert not unsound_blocks(harness, tokens, blocks, hit)
    assert fallbacks._value.get() == before


@pytest.mark.parametrize("path", WRITE_VECTORS, ids=[p.stem for p in WRITE_VECTORS])
def test_enforce_repeats_every_pinned_write_side_counterexample_as_the_reference(path):
    """Serve the vector's prompt once on an empty cache (one sampled token, as the spec models it), then
    resend it: under enforce each resend hits what the vector records for ``reference``."""
    record = json.loads(path.read_text())
    config = _config(record)
    layout, spec = _refimpl(config)
    n = record["N"]
    want = tuple(record["repeat_hits"]["reference"])
    sizes = R.derive_sizes(layout, spec)
    assert R.repeat_hits(sizes, n, record["retention"], R.REFERENCE, len(want)) == want
    assert kvhit_vllm.install("enforce")
    harness = VllmHarness(harness_layout(config.layout, config.layout.dcp), spec.mode.value,
                          num_speculative_tokens=max(1, spec.num_speculative_tokens),
                          multi_module_mtp=spec.multi_module_mtp, retention_interval=record["retention"],
                          max_model_len=n + 64)
    tokens = [random.Random(path.stem).randrange(1, 50000) for _ in range(n)]
    harness.serve(tokens, decode_steps=0)
    hits = []
    for _ in want:
        hits.append(harness.probe(tokens)["hit"])
        harness.serve(tokens, decode_steps=0)
    assert tuple(hits) == want, f"{path.stem}: enforce {hits}, reference {want}, {record['repeat_hits']}"
