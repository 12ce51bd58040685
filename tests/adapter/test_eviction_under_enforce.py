"""Why enforce served less than stock on ``dsv4_cuda-drop/preempting/2048`` (issues 17 and 18), and the
eviction order that restores enforce >= stock there, measured through vLLM 0.33's real ``Scheduler``
(``tests.adapter.serving``'s stream and pool, in a process per mode).

The stream: ``a`` (5374 tokens) and ``b`` (5373, sharing a's first 3000) arrive together on a pool of 966
blocks, the stream's stock peak less one, so ``b`` waits until ``a`` has finished; then ``b`` twice
(``b-1``, ``b-2``) and ``a`` again (``a-1``). Three processes: stock; enforce; and enforce with vLLM's own
eviction order (``EvictionTier.evict_extra_first`` disabled in that process: the adapter before it). The
claims, in the order the cause runs:

1. The write side is the model's: after ``a`` the pool holds, per KV-cache group, exactly the boundaries
   ``refimpl.request_writes`` says (``vllm_0_33`` under stock, ``reference`` under enforce): nothing is held
   that the model does not retain. Until ``b`` ends the requests hold as many blocks per group at every
   step in both modes (no sliding-window block outside the window is kept longer).
2. The reference keeps a second set of sliding-window tails: at its own resend point 5120 beside vLLM's
   4864, 21 blocks more (SWA-64 (EAGLE) 3, SWA-8 16, SWA-4 2; the MLA groups the same). The adapter marks
   exactly these as extra (vLLM's mask on vLLM's boundaries would not cache them).
3. Those 21 blocks are what the pool lacks: ``b``'s prefill needs more uncached free blocks than remain
   under enforce, and its first allocation that reaches cached blocks (512 SWA-4 blocks for a 2048-token
   chunk) would evict the 14 cached blocks at the front of vLLM's free queue: a sliding-window block is
   freed when the window passes it, during ``a``'s last prefill chunk, before ``a``'s MLA blocks are freed
   at its end, so those 14 are all six of ``a``'s SWA-64 tail blocks (vLLM's tail at 4864 as well as the
   reference's at 5120) and eight SWA-8 blocks of the tail at 5120. Eleven of them are extra; in place of
   the other three (vLLM's SWA-64 tail at 4864) the adapter hands vLLM the three oldest marked extra blocks
   further back in the queue (SWA-8 5000, 5008, 5016). So 14 evictions, all of extra blocks, against none
   under stock, and vLLM's own tails survive.
4. Every request then hits at least stock's hit: ``b-1`` 5120 (stock 4864: the reference's tail at 5120
   that ``b`` left), ``b-2`` 5120, ``a-1`` 4864 (stock's, the tail vLLM's write side keeps); 14 evictions in
   the whole stream. With vLLM's order the same 14 evictions take vLLM's SWA-64 tail too, ``a-1`` falls back
   to ``b``'s junction at 2816, and its longer prefill evicts 87 blocks more (101).
5. The reference read side is not what loses: on stock's pool at ``a-1``'s lookup it hits 4864, stock's
   hit.
"""

from __future__ import annotations

import json
import sys

import pytest

import kvhit.refimpl as R
from tests.adapter import child_runs, scheduler_run, serving

CASE, CONDITION, BUDGET = "dsv4_cuda-drop", "preempting", 2048
VLLM_ORDER = "enforce-vllm-order"  # enforce with vLLM's own eviction order (EvictionTier's disabled)
MODES = ("stock", "enforce", VLLM_ORDER)
# Per KV-cache group, the boundaries a's first serve leaves under enforce beyond stock's (claim 2)
EXTRA = [[], [], [], [5056, 5120, 5184], list(range(5000, 5121, 8)), [5116, 5120]]


def _serve(models_dir: str) -> dict:
    """The stream under the installed mode: what each request got, the pool's boundaries of each prompt
    when its first request finished, the blocks evicted in order (``(KV-cache group, boundary)``),
    the blocks the requests hold per group after each step, and the lookups (with the pool they saw)."""
    from vllm.v1.core.kv_cache_utils import get_group_id

    case = serving.CASES[CASE]
    arrivals = serving.preempting_stream(case, f"{CASE}/{CONDITION}")
    num_gpu_blocks = serving.pool_blocks(case, models_dir, BUDGET, "preempt", arrivals)
    left: dict[str, list[list[int]]] = {}
    evicted: list[tuple[int, int]] = []
    tables: list[list[int]] = []  # per step, the blocks the running requests hold per group
    extra_after_a: list[tuple[int, int]] = []  # the pool's extra blocks when a finished (enforce)
    step = scheduler_run.step
    with serving.Observer(record_pool=True) as observer:
        scheduler, block_hasher = serving.build(case, models_dir, BUDGET, num_gpu_blocks)
        observer.attach(scheduler)
        hashes = {a.prompt: list(scheduler_run.new_request(a.request_id, list(a.tokens), block_hasher,
                                                            1).block_hashes) for a in arrivals}
        pool = scheduler.kv_cache_manager.block_pool
        evict = pool._maybe_evict_cached_block

        def maybe_evict_cached_block(block):
            key, x = block.block_hash, block.block_hash_num_tokens
            if evict(block):
                evicted.append((get_group_id(key), x))
                return True
            return False

        pool._maybe_evict_cached_block = maybe_evict_cached_block
        managers = scheduler.kv_cache_manager.coordinator.single_type_managers

        def observed_step(s, scheduler_output=None, samples=None):
            scheduler_output, engine_outputs = step(s, scheduler_output, samples)
            tables.append([sum(not b.is_null for blocks in m.req_to_blocks.values() for b in blocks)
                           for m in managers])
            for outputs in engine_outputs.values():
                for o in outputs.outputs:
                    if o.finish_reason is not None and o.request_id in hashes:
                        left[o.request_id] = serving.pool_boundaries(s, hashes[o.request_id])
                        if o.request_id == "a":
                            extra_after_a.extend(_marked_extra(pool))
            return scheduler_output, engine_outputs

        scheduler_run.step = observed_step  # serve_stream steps through this name
        try:
            served = serving.serve_stream(scheduler, block_hasher, arrivals, observer)
        finally:
            scheduler_run.step = step
    return {"served": {s["request_id"]: s for s in served}, "left": left, "evicted": evicted,
            "extra_after_a": sorted(extra_after_a),
            "tables": tables, "groups": serving.describe_groups(scheduler), "num_blocks": num_gpu_blocks}


def _marked_extra(pool) -> list[tuple[int, int]]:
    """``(KV-cache group, boundary)`` of the blocks the adapter's ``EvictionTier`` of ``pool`` holds as
    extra (none when kvhit is not loaded or keeps no tier for the pool)."""
    from vllm.v1.core.kv_cache_utils import get_group_id

    engine = sys.modules.get("kvhit.adapters.vllm.engine")
    tier = engine._tiers.get(pool) if engine is not None else None
    if tier is None:
        return []
    marked = [pool.blocks[block_id] for block_id, block_hash in tier.extra.items()
              if pool.blocks[block_id].block_hash is block_hash]
    return [(get_group_id(b.block_hash), b.block_hash_num_tokens) for b in marked]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """``{mode: result}`` for :data:`MODES`: the stream in a process per mode (stock: kvhit's plugin not
    loaded; enforce: loaded through vLLM's plugin loader), one after the other."""
    work = tmp_path_factory.mktemp("eviction")
    scheduler_run.write_models(str(work / "models"))
    results = {}
    for mode in MODES:
        out = work / f"{mode}.json"
        args = [out, work / "models"] + ([VLLM_ORDER] if mode == VLLM_ORDER else [])
        process = child_runs.start("tests.adapter.test_eviction_under_enforce", args,
                                   child_runs.env(None if mode == "stock" else "enforce"))
        results[mode] = child_runs.collect({mode: (out, process)}, timeout=600)[mode][0]
        assert results[mode]["kvhit_mode"] == (None if mode == "stock" else "enforce")
        results[mode]["evicted"] = [tuple(e) for e in results[mode]["evicted"]]
    return results


def _sizes(run) -> R.Sizes:
    layout = serving.planned_layout({"kv_cache_groups": run["groups"],
                                     "scheduler": {"dcp": 1, "prefix_match_unit": None}})
    return R.derive_sizes(layout, serving.speculation_of(serving.CASES[CASE]))


def _model_left(sizes: R.Sizes, n_tokens: int, policy: str) -> list[set[int]]:
    """Per spec group, the hash boundaries a first request of ``n_tokens`` on an empty cache leaves
    (``refimpl.request_writes``, retention 0)."""
    cache = R.written_cache(R.request_writes(sizes, n_tokens, 0, R.POLICIES[policy]))
    return [{x for x in range(sizes.hash_block, n_tokens + 1, sizes.hash_block) if cache.has(k, x)}
            for k in range(len(sizes.groups))]


@pytest.mark.parametrize("mode, policy", [("stock", "vllm_0_33"), ("enforce", "reference")])
def test_the_pool_holds_what_the_model_retains_after_the_first_prompt(runs, mode, policy):
    """After ``a`` (the first request, on an empty cache) every KV-cache group holds exactly the
    boundaries the policy's write side leaves; both modes' requests hold the same blocks at every step."""
    run = runs[mode]
    sizes = _sizes(run)
    want = _model_left(sizes, run["served"]["a"]["prompt_len"], policy)
    got = run["left"]["a"]
    for k, sg in enumerate(sizes.groups):
        for gid in sg.members:
            # the MLA groups' partial-tail entry inside the last block, which the decode steps register
            # (the spec models a request that samples one token): the same in both modes
            decoded = {x for x in got[gid] if x % sg.block}
            assert decoded == ({5372} if sg.kind is R.Kind.FULL else set()), (mode, gid, decoded)
            assert set(got[gid]) - decoded == want[k], (mode, gid, sorted((set(got[gid]) - decoded) ^ want[k]))
    assert runs["stock"]["tables"][:20] == runs["enforce"]["tables"][:20]  # through b's end


def test_the_reference_keeps_a_second_sliding_window_tail_of_21_blocks(runs):
    """Enforce leaves, per KV-cache group, stock's boundaries and the tail at the reference's resend
    point 5120: SWA-64 (EAGLE, the block past the boundary included) 3 blocks, SWA-8 16, SWA-4 2."""
    stock, enforce = (runs[m]["left"]["a"] for m in ("stock", "enforce"))
    assert all(set(s) <= set(e) for s, e in zip(stock, enforce))
    extra = [sorted(set(e) - set(s)) for s, e in zip(stock, enforce)]
    assert [g["block_size"] for g in runs["enforce"]["groups"]] == [256, 256, 256, 64, 8, 4]
    assert extra == EXTRA
    assert [len(s) for s in stock] == [21, 21, 21, 3, 16, 2]


def test_the_adapter_marks_exactly_the_blocks_the_reference_keeps_beyond_vllm(runs):
    """When ``a`` has been cached, the pool's extra blocks (``EvictionTier.extra``) are the 21 of claim 2."""
    assert runs["enforce"]["extra_after_a"] == [list(x) for x in _extra_pairs()]


def _extra_pairs() -> list[tuple[int, int]]:
    return sorted((gid, x) for gid, xs in enumerate(EXTRA) for x in xs)


def test_b_s_prefill_evicts_only_blocks_the_reference_keeps_beyond_vllm(runs):
    """``b``'s prefill evicts nothing under stock and 14 blocks under enforce, all of them extra: the
    eleven extra ones among the 14 cached blocks vLLM's allocation would take (SWA-64 5056..5184, SWA-8
    5064..5120) and, in place of vLLM's SWA-64 tail at 4864, the three oldest marked extra blocks further
    back (SWA-8 5000..5016). Nothing else is evicted in the stream."""
    stock, enforce = runs["stock"], runs["enforce"]
    assert {m: runs[m]["served"]["b-1"]["lookups"][0]["evictions"] for m in ("stock", "enforce")} == {
        "stock": 0, "enforce": 14}
    assert sorted(enforce["evicted"]) == sorted(
        [(3, x) for x in (5056, 5120, 5184)] + [(4, x) for x in (5000, 5008, 5016, *range(5064, 5121, 8))])
    assert set(enforce["evicted"]) <= set(_extra_pairs())
    assert (len(stock["evicted"]), len(enforce["evicted"])) == (0, 14)
    assert stock["num_blocks"] == enforce["num_blocks"] == 966


def test_enforce_serves_every_request_at_least_stock_s_hit(runs):
    """``b-1`` hits the reference's tail at 5120 that ``b`` left (stock 4864), ``b-2`` 5120 as stock, and
    ``a-1`` stock's 4864: vLLM's tail at 4864 survived ``b``'s prefill."""
    hits = {m: [runs[m]["served"][r]["num_cached_tokens"] for r in ("a", "b", "b-1", "b-2", "a-1")]
            for m in ("stock", "enforce")}
    assert hits == {"stock": [0, 0, 4864, 5120, 4864], "enforce": [0, 0, 5120, 5120, 4864]}


def test_with_vllm_s_eviction_order_a_s_resend_hits_less(runs):
    """What the rule changes (the adapter before it): the same 14 evictions before ``b-1``, but the 14
    cached blocks at the front of vLLM's queue: every SWA-64 tail block (4864's and 5120's) and SWA-8's
    5064..5120; ``a-1`` then hits 2816 (``b``'s junction) against stock's 4864, and its prefill evicts
    87 blocks more."""
    run = runs[VLLM_ORDER]
    assert run["served"]["b-1"]["lookups"][0]["evictions"] == 14
    assert sorted(run["evicted"][:14]) == sorted(
        [(3, x) for x in (4800, 4864, 4928, 5056, 5120, 5184)] + [(4, x) for x in range(5064, 5121, 8)])
    assert run["served"]["a-1"]["lookups"][0]["evictions"] == 14  # nothing more before a-1's lookup
    assert [run["served"][r]["num_cached_tokens"] for r in ("b-1", "b-2", "a-1")] == [5120, 5120, 2816]
    assert len(run["evicted"]) == 101


def test_the_reference_read_side_hits_stock_s_hit_on_stock_s_pool(runs):
    """On the cache stock's pool held at ``a-1``'s lookup the reference hits 4864, as stock does: what
    enforce loses is the evicted tails, not its read side."""
    run = runs["stock"]
    sizes = _sizes(run)
    lookup = run["served"]["a-1"]["lookups"][0]
    cache = [set.intersection(*(set(lookup["pool"][m]) for m in sg.members)) for sg in sizes.groups]
    layout = serving.planned_layout({"kv_cache_groups": run["groups"],
                                     "scheduler": {"dcp": 1, "prefix_match_unit": None}})
    reference = R.hit(layout, serving.speculation_of(serving.CASES[CASE]), lookup["max_cache_hit_length"] + 1,
                      cache, "reference")
    assert reference == lookup["hit"] == 4864


def main(argv=None) -> None:
    """``python -m tests.adapter.test_eviction_under_enforce OUT.json MODELS_DIR [enforce-vllm-order]``: the
    stream under the mode ``KVHIT_MODE`` names (with the last argument, enforce keeps vLLM's eviction
    order), as JSON."""
    out, models_dir, *order = argv if argv is not None else sys.argv[1:]
    serving.setup_environment()
    if order == [VLLM_ORDER]:
        from kvhit.adapters.vllm import engine

        engine.EvictionTier.evict_extra_first = lambda self, pool, num_blocks: None
    result = _serve(models_dir)
    result["kvhit_mode"] = (sys.modules["kvhit.adapters.vllm"].current_mode()
                            if "kvhit.adapters.vllm" in sys.modules else None)
    with open(out, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
