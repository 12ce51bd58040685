#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""F2: with the EAGLE last-block drop (use_eagle=True: eagle/MTP with a KV connector or
disable_lookahead_block_hashes; on vLLM 0.32.0, every eagle/MTP drafter with prefix caching), vLLM 0.33.0's
and 0.32.0's Unitary coordinator (one KV-cache group) looks the prompt up at N - 1 and then drops a whole
block. When the block size divides N, the block it drops is cached and covered by the request's hashes, so one
block more than necessary is recomputed on every repeat. The Hybrid coordinator peeks one block past the
candidate (the "eagle margin") and keeps it.

Standalone: needs only vLLM 0.32.0 or 0.33.0 (CPU is enough). Run: python f2_unitary_drop.py
Serves a prompt once (allocate_slots caches its full blocks), frees it, and looks the identical prompt up
again, the way the scheduler admits a repeated request. Prints, per case: N, the block, how many of the
repeat's block hashes are cached, and the hit vLLM returns, with the drop and without it.
"""

import inspect

import torch

import vllm
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.request import Request

BLOCK = 16


def lookahead_kwargs(fn):
    """``num_hash_lookahead_tokens=0`` where ``fn`` takes it (vLLM 0.33.0); vLLM 0.32.0 has no lookahead hashes."""
    takes = "num_hash_lookahead_tokens" in inspect.signature(fn).parameters
    return {"num_hash_lookahead_tokens": 0} if takes else {}


def draft_kwargs(spec_cls):
    """``is_draft=True`` where the spec has the field (vLLM 0.33.0, read by its planner only); vLLM 0.32.0 marks
    the draft group only by KVCacheGroupSpec.is_eagle_group, as both do here."""
    return {"is_draft": True} if "is_draft" in inspect.signature(spec_cls).parameters else {}


def hit_after_serving(n, use_eagle, draft_group):
    specs = [FullAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=8, dtype=torch.float16)]
    groups = [KVCacheGroupSpec(["layer.0"], specs[0], is_eagle_group=use_eagle and not draft_group)]
    if draft_group:
        # Llama + EAGLE: the draft layer in its own (replicated) group: two groups, the Hybrid coordinator.
        draft = FullAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=16, dtype=torch.float16,
                                  dcp_sharded=False, **draft_kwargs(FullAttentionSpec))
        groups.append(KVCacheGroupSpec(["draft.0"], draft, is_eagle_group=use_eagle))
    cfg = KVCacheConfig(num_blocks=4 * (n // BLOCK + 4), kv_cache_tensors=[], kv_cache_groups=groups,
                        prefix_cache_retention_interval=0)
    mgr = KVCacheManager(kv_cache_config=cfg, max_model_len=4 * n, scheduler_block_size=BLOCK,
                         hash_block_size=BLOCK, enable_caching=True, use_eagle=use_eagle,
                         num_prefill_lookahead=1 if use_eagle else 0, **lookahead_kwargs(KVCacheManager))
    hasher = get_request_block_hasher(BLOCK, sha256, **lookahead_kwargs(get_request_block_hasher))
    prompt = list(range(1, n + 1))
    first = Request("first", prompt, SamplingParams(max_tokens=1), None, block_hasher=hasher)
    blocks, hit, _ = mgr.get_computed_blocks(first)
    assert hit == 0
    assert mgr.allocate_slots(first, n, num_new_computed_tokens=0, new_computed_blocks=blocks) is not None
    first.num_computed_tokens = n
    mgr.free(first)
    repeat = Request("repeat", prompt, SamplingParams(max_tokens=1), None, block_hasher=hasher)
    pool = mgr.block_pool
    cached = sum(all(pool.get_cached_block(x, [g]) is not None for g in range(len(groups)))
                 for x in repeat.block_hashes)
    _, hit, _ = mgr.get_computed_blocks(repeat)
    return cached, len(repeat.block_hashes), hit


def main():
    init_none_hash(sha256)
    print(f"vllm={vllm.__version__} block={BLOCK}")
    for n in (32, 1024, 1000):
        for coordinator, draft_group in (("unitary", False), ("hybrid", True)):
            cached, hashes, dropped = hit_after_serving(n, True, draft_group)
            _, _, plain = hit_after_serving(n, False, draft_group)
            print(f"case={coordinator} N={n} hashes={hashes} cached={cached} hit_drop={dropped} "
                  f"hit_no_speculation={plain}")


if __name__ == "__main__":
    main()
