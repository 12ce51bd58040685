"""Every counterexample `make prove` pinned for ``vllm_0_33`` and ``historical`` (tests/vectors/hit_tokens/)
replayed on the real vLLM 0.33.0: the vector's cache state is put into vLLM's block pool for the
request's own block hashes, the prompt is looked up, and vLLM's answer must be the ``vllm_0_33`` hit the
vector records (Z3's number, replayed by the refimpl) or, for F1, an IndexError. So vLLM 0.33.0 shows F1
and F2, and does not show F3 (the historical DeepSeek-V4 drop): there it returns the ``vllm_0_33`` hit."""

import json
from pathlib import Path

import pytest

from kvhit.proofs.domains import SCENARIOS, configs
from kvhit.refimpl import CacheState, hit_tokens
from kvhit.refimpl.policy import num_hashes

from .differential import VLLM_0_33, seeded_harness, to_refimpl

_ALL = sorted(p for p in (Path(__file__).resolve().parents[1] / "vectors" / "hit_tokens").glob("*.json")
              if json.loads(p.read_text())["policy"] in ("vllm_0_33", "historical"))
# Read-side vectors record a cache state and the hits on it; write-side vectors (the request runs on an
# empty cache) record the repeat hits instead and are replayed by test_write_counterexample_replays_on_vllm.
VECTORS = [p for p in _ALL if "hits" in json.loads(p.read_text())]
WRITE_VECTORS = [p for p in _ALL if "repeat_hits" in json.loads(p.read_text())]
# Invariants refuted by F1 (reads past the hashes): vLLM raises IndexError on these vectors.
F1_INVARIANTS = {"hit_is_aligned_and_capped", "lookup_stays_within_hashes", "hit_is_valid_in_every_group"}


def _config(record):
    if "@" in record["invariant_row"]:
        return next(s.config for s in SCENARIOS if s.name == record["invariant_row"].split("@")[1])
    for config in configs(extended=True):
        if (config.layout.name, config.layout.dcp, config.speculation.describe()) == (
                record["layout"], record["dcp"], record["speculation"]):
            return config
    raise LookupError(record["layout"])


def test_every_vllm_0_33_counterexample_is_replayed():
    names = {p.stem for p in VECTORS}
    assert {"hit_is_aligned_and_capped__vllm_0_33", "lookup_stays_within_hashes__vllm_0_33",
            "hit_is_valid_in_every_group__vllm_0_33", "hit_is_the_longest_valid__vllm_0_33",
            "eagle_loses_at_most_one_block_beyond_alignment__vllm_0_33"} <= names


@pytest.mark.parametrize("path", VECTORS, ids=[p.stem for p in VECTORS])
def test_counterexample_replays_on_vllm(path):
    record = json.loads(path.read_text())
    n = record["N"]
    s = seeded_harness(_config(record), n, record["cache"])
    harness, sizes, tokens, seeded = s.harness, s.sizes, s.tokens, s.seeded
    model_hit, reach, _, _ = hit_tokens(CacheState.from_sets(seeded), sizes, n, VLLM_0_33)
    crash = reach > num_hashes(sizes, n) * sizes.hash_block
    try:
        got = harness.probe(tokens)["hit"]
    except IndexError:
        got = "IndexError"
    print(f"{path.stem}: N={n} vLLM={got} vllm_0_33={model_hit} recorded={record['hits']} "
          f"seeded={[len(b) for b in seeded]}")
    if record["invariant"] in F1_INVARIANTS:
        assert crash and got == "IndexError", f"F1 does not reproduce on {path.name}: vLLM returned {got}"
    else:
        assert not crash
        assert got == model_hit == record["hits"]["vllm_0_33"], (got, model_hit, record["hits"])
        if record["policy"] == "historical" and record["hits"]["historical"] != record["hits"]["vllm_0_33"]:
            # F3 is fixed in vLLM 0.33.0: it returns the vllm_0_33 hit, not the historical one.
            assert got != record["hits"]["historical"]
        if record["policy"] == "vllm_0_33":
            assert got < record["hits"]["reference"], "the finding is a loss against the reference policy"


def test_every_vector_is_replayed_on_one_side():
    assert set(VECTORS) | set(WRITE_VECTORS) == set(_ALL) and WRITE_VECTORS


@pytest.mark.parametrize("path", WRITE_VECTORS, ids=[p.stem for p in WRITE_VECTORS])
def test_write_counterexample_replays_on_vllm(path):
    """The prompt runs on an empty cache and is resent three times through vLLM's real classes (the
    write-side suite's comparison under ``vllm_0_33``: retained boundaries, hits, junctions): the resends'
    hits are the ``vllm_0_33`` repeat hits the vector records."""
    from .write_side import WriteScenario, WriteStats, run_write_scenario

    record = json.loads(path.read_text())
    config = _config(record)
    layout = to_refimpl(config.layout)
    speculation = to_refimpl(config.speculation)
    scenario = WriteScenario(layout, speculation, record["retention"], record["N"], (("resend",),) * 3)
    history = run_write_scenario(scenario, WriteStats())
    got = [hit for _, _, hit in history[1:]]
    assert got == record["repeat_hits"]["vllm_0_33"], (got, record["repeat_hits"])
