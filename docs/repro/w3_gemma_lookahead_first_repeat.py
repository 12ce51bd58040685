#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""W3: with lookahead block hashes (multi-module MTP with num_speculative_tokens = L >= 2 and no KV
connector: vLLM's default for MTP with prefix caching), a resend is looked up at N - 1 but its hashes only
reach floor(N - L), so it resumes at floor_A(N - L). vLLM 0.33.0's sparse retention
(prefix_cache_retention_interval=0, the engine default) keeps sliding-window state only at the replay
boundary N - 1. When an alignment boundary lies between N - L and N - 1, the window the resend needs is not
kept: the first resend misses entirely. It records that boundary as its junction, so the second hits.

Layout: Gemma-like: full attention (block 64) + sliding window (block 32, window 512); S = A = 64, h = 32.
Prompt N = 577 (9 * 64 + 1), MTP with 2 speculative tokens, lookahead mode, retention 0.

Standalone: needs only vLLM 0.33.0 (CPU is enough). Run: python w3_gemma_lookahead_first_repeat.py
Each request runs as Scheduler.schedule / update_from_output run it alone with an unlimited token budget
(the scheduler's own _reserve_prefill_lookahead clips the chunks). Prints, per retention interval, the hits
of the first request and of three resends.
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

N = 577
S, H = 64, 32


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


def hits(retention):
    k = L = Lp = 2
    full = FullAttentionSpec(block_size=64, num_kv_heads=1, head_size=8, dtype=torch.float16)
    # The planner sets extra_retained_tokens = num_prefill_lookahead - 1 on sliding windows.
    swa = SlidingWindowSpec(block_size=32, num_kv_heads=1, head_size=8, dtype=torch.float16, sliding_window=512,
                            extra_retained_tokens=Lp - 1)
    mgr, sched, hasher = build([(full, False), (swa, False)], S=S, H=H, use_eagle=False, L=L, Lp=Lp, k=k,
                               retention=retention, max_model_len=2048, num_blocks=400)
    prompt = list(range(1, N + 1))
    return [serve(mgr, sched, hasher, prompt, k, f"r{i}") for i in range(4)]


def main():
    init_none_hash(sha256)
    print(f"vllm={vllm.__version__} layout=full64+swa32w512 N={N} k=2 multi_module_mtp lookahead")
    for retention in (0, None):
        first, *resends = hits(retention)
        print(f"case=retention_{retention} N={N} first={first} resends={','.join(map(str, resends))}")


if __name__ == "__main__":
    main()
