"""The smallest counterexample of a defect (kvhit.proofs.findings): the least N, then the fewest cached blocks.

F2 on full16 (one full-attention group, block 16, EAGLE drop): a resend of 32 tokens hits 0 under vLLM 0.33's
Unitary coordinator where 16 can be served. The least cache that shows it holds the two blocks of the prompt
(one block is not enough: the drop then needs the block past it, which an empty slot cannot give to any
policy), and the hits quoted are replayed through refimpl on that cache, not taken from the search.
"""

from kvhit import refimpl
from kvhit.proofs import findings
from kvhit.proofs.alignment import INVARIANTS as ALIGNMENT
from kvhit.proofs.domains import configs
from kvhit.proofs.model import ReplayContext, cache_from_runs, check
from kvhit.proofs.validity import INVARIANTS as VALIDITY
from kvhit.spec.policy import POLICIES, VLLM_0_33

LONGEST = next(i for i in VALIDITY if i.name == "hit_is_the_longest_valid")
WITHIN = next(i for i in ALIGNMENT if i.name == "lookup_stays_within_hashes")


def _config(label):
    return next(c for c in configs() if c.label == label)


def test_f2_smallest_counterexample_has_the_least_n_and_the_fewest_blocks():
    config = _config("full16 drop Lp=1")
    first = check(LONGEST, VLLM_0_33, config)
    assert first[0] == "REFUTED"
    cex = findings.smallest_counterexample(LONGEST, config, first[2]["N"])
    assert cex["N"] == 32  # two blocks of 16: the least prompt the drop can cost a block on
    least = findings.smallest_cache(LONGEST, config, cex)
    assert least["N"] == 32 and findings.cached_blocks(least) == 2
    assert check(LONGEST, VLLM_0_33, config, max_n=32, max_blocks=1)[0] == "PROVED"
    # the hits on the least cache, replayed through the generated code
    runs = {(int(k), item["unit"]): [tuple(b) for b in item["blocks"]]
            for k, lists in least["cache"].items() for item in lists}
    cache, _ = cache_from_runs(runs)
    values = {"N": 32, **least["witnesses"]}
    hits = {name: ReplayContext(config, POLICIES[name], values, cache).hit()[0]
            for name in ("vllm_0_33", "vllm_0_33_repaired", "reference")}
    assert hits == {"vllm_0_33": 0, "vllm_0_33_repaired": 16, "reference": 16}
    described = findings._describe("hit_is_the_longest_valid", config.label, least)
    assert described["cached_blocks"] == 2 and described["tokens_lost_per_repeat"] == 16


def test_a_read_past_the_hashes_is_described_as_such():
    config = _config("chunked64 lookahead Lp=2 mtp2")
    cex = findings.smallest_counterexample(WITHIN, config, 64)
    least = findings.smallest_cache(WITHIN, config, cex)
    assert findings.cached_blocks(least) == 0  # the lookup reads past the hashes on an empty cache already
    described = findings._describe("lookup_stays_within_hashes", config.label, least)
    past = described["reads_past_hashes"]
    assert past["reach"] > past["hash_reach"]
    sizes = ReplayContext(config, VLLM_0_33, {"N": cex["N"]}, None).sizes()
    assert past["hash_reach"] == refimpl.num_hashes(sizes, cex["N"]) * sizes.hash_block
