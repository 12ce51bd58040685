#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""W1: with multi-module MTP in drop mode (use_eagle=True: MTP with a KV connector or
disable_lookahead_block_hashes, num_speculative_tokens=2), vLLM 0.33.0 keeps one token of the prompt
"reprefillable" (num_reprefillable_tokens = Lp - 1), so on a prompt whose length is a multiple of the block
the EAGLE group's cached prefix ends one block short of N. A resend then peeks past the last cached block,
drops it and resumes one scheduler block below the Mamba checkpoint the first request stored, where no
Mamba state exists: the first resend hits 0 and recomputes the whole prompt. That resend stores the state at
its junction, so the second resend hits.

Layout: Qwen3-Next-like: full attention (block 1600) + Mamba/GDN (block 1600, align mode); S = A = h = 1600.
Prompt N = 8000 (5 * 1600), served on an empty cache, then resent three times.

Standalone: needs only vLLM 0.33.0 (CPU is enough). Run: python w1_qwen3next_mtp_drop_first_repeat.py
Each request runs as Scheduler.schedule / update_from_output run it alone with an unlimited token budget
(the scheduler's own _mamba_block_aligned_split and _reserve_prefill_lookahead clip the chunks). Prints,
per retention interval, the hits of the first request and of three resends, and the same with dense
retention and without speculation for comparison.
"""

import types

import torch

import vllm
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import (FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, MambaSpec,
                                        SlidingWindowSpec)
from vllm.v1.request import Request, RequestStatus

N = 8000
S = H = 1600


def build(groups, *, S, H, use_eagle, L, Lp, k, retention, max_model_len, num_blocks):
    """A real KVCacheManager plus the Scheduler attributes its chunk-clipping methods read."""
    cfg = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[],
                        kv_cache_groups=[KVCacheGroupSpec([f"layer.{i}"], spec, is_eagle_group=eagle)
                                         for i, (spec, eagle) in enumerate(groups)],
                        prefix_cache_retention_interval=retention)
    mgr = KVCacheManager(kv_cache_config=cfg, max_model_len=max_model_len, scheduler_block_size=S,
                         hash_block_size=H, enable_caching=True, use_eagle=use_eagle,
                         num_hash_lookahead_tokens=L, num_prefill_lookahead=Lp)
    mamba = [spec for spec, _ in groups if isinstance(spec, MambaSpec)]
    partial = bool(mamba) and H < S and mgr.coordinator.enable_partial_hash_hits
    sched = types.SimpleNamespace(  # what Scheduler.__init__ sets (scheduler.py:295-464)
        cache_config=types.SimpleNamespace(block_size=min(spec.block_size for spec, _ in groups),
                                           mamba_cache_mode="align" if mamba else "none"),
        block_size=S, hash_block_size=H, use_eagle_block_drop=use_eagle, num_hash_lookahead_tokens=L,
        num_prefill_lookahead=Lp, need_mamba_block_aligned_split=bool(mamba),
        mamba_prefill_checkpoint_alignment=mamba[0].prefill_checkpoint_alignment if mamba else None,
        mamba_has_prefill_checkpoint_blocks=bool(mamba) and all(m.num_prefill_checkpoint_blocks > 0 for m in mamba),
        mamba_partial_cache_hit=partial, mamba_shared_prefix_checkpoint=partial and mgr.mamba_shared_prefix_checkpoint,
        max_num_scheduled_tokens=10**6, scheduler_config=types.SimpleNamespace(long_prefill_token_threshold=0))
    return mgr, sched, get_request_block_hasher(H, sha256, L)


def serve(mgr, sched, hasher, prompt, k, rid):
    """One request as Scheduler.schedule / update_from_output run it alone with an unlimited token budget:
    admission lookup, prefill chunks clipped by the scheduler's own Mamba split and prefill-lookahead
    reservation (allocate_slots caches at schedule time), one sampled token (re-cached with a drafter,
    scheduler.py:2404-2415), free. Returns the admission hit."""
    req = Request(rid, prompt, SamplingParams(max_tokens=1), None, block_hasher=hasher)
    mgr.new_step_starts()
    blocks, hit, spb = mgr.get_computed_blocks(req)
    req.shared_prefix_boundary = spb
    computed, first = hit, True
    while computed < req.num_tokens:
        n = req.num_tokens - computed
        if sched.need_mamba_block_aligned_split:
            n = Scheduler._mamba_block_aligned_split(sched, req, n, hit if first else 0, 0)
        n = Scheduler._reserve_prefill_lookahead(sched, req, computed, n)
        assert n > 0, f"scheduled 0 tokens at {computed} of {req.num_tokens}"
        if first:
            out = mgr.allocate_slots(req, n, num_new_computed_tokens=hit, new_computed_blocks=blocks,
                                     num_lookahead_tokens=k)
            req.status = RequestStatus.RUNNING
        else:
            out = mgr.allocate_slots(req, n, num_lookahead_tokens=k)
        assert out is not None
        computed += n
        req.num_computed_tokens = computed
        first = False
        mgr.new_step_starts()
    req.append_output_token_ids(0)
    if k > 0:
        mgr.cache_blocks(req, req.num_computed_tokens)
    mgr.free(req)
    mgr.new_step_starts()
    return hit


def hits(mode, retention):
    k = 2 if mode != "none" else 0
    use_eagle, L, Lp = {"none": (False, 0, 0), "drop": (True, 0, 2)}[mode]
    full = FullAttentionSpec(block_size=1600, num_kv_heads=1, head_size=8, dtype=torch.float16)
    mamba = MambaSpec(1600, ((4,),), (torch.float32,), mamba_cache_mode="align", num_speculative_blocks=k)
    # vLLM's planner flags no group as the draft's for this layout (the MTP layers are separate modules), so
    # use_eagle=True makes every group drop (the all-groups fallback).
    mgr, sched, hasher = build([(full, False), (mamba, False)], S=S, H=H, use_eagle=use_eagle, L=L, Lp=Lp,
                               k=k, retention=retention, max_model_len=4 * N, num_blocks=64)
    prompt = list(range(1, N + 1))
    return [serve(mgr, sched, hasher, prompt, k, f"r{i}") for i in range(4)]


def main():
    init_none_hash(sha256)
    print(f"vllm={vllm.__version__} layout=full1600+mamba1600 N={N} k=2 multi_module_mtp")
    for mode, retention in (("drop", 0), ("drop", None), ("none", 0)):
        first, *resends = hits(mode, retention)
        print(f"case={mode}_retention_{retention} N={N} first={first} "
              f"resends={','.join(map(str, resends))}")


if __name__ == "__main__":
    main()
