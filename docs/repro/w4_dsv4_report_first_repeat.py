#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""W4: the DeepSeek-V4 report, on vLLM 0.33.0's write side. vLLM 0.33 fixed the read side of the report
(an EAGLE group now peeks one block past the aligned candidate, so a cache holding the whole 46240-token
prompt gives 32768, not 16384). But with an EAGLE drop the replay boundaries the retention masks keep are one
scheduler block below the aligned prompt end, and on DeepSeek-V4 the scheduler block is the 16384-token
alignment: at vLLM's default retention interval 0 the EAGLE sliding-window group keeps its tail at 16384, not
at 32768, so the first resend hits 16384 again. It records the junction 32768, so the second resend hits 32768.

Layout: DeepSeek-V4 as in the report: compressed MLA groups of blocks 16384 (tokens_per_state 128), 512 and
512 (tokens_per_state 4), the SWA-MLA cache of block 128 (window 128) that holds the MTP layer (the EAGLE
group), and SWA-MLA compressor states of blocks 8 (window 128) and 4 (window 8); S = A = 16384, h = 4.
Prompt N = 46240, served on an empty cache, then resent three times; drop mode (MTP with a KV connector, or
disable_lookahead_block_hashes), one speculative token.

Standalone: needs only vLLM 0.33.0 (CPU is enough). Run: python w4_dsv4_report_first_repeat.py
Prints the hits of the first request and of three resends at retention 0 and with dense retention.
"""

import types

import torch

import vllm
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import (KVCacheConfig, KVCacheGroupSpec, MambaSpec, MLAAttentionSpec,
                                        SlidingWindowMLASpec)
from vllm.v1.request import Request, RequestStatus

N = 46240
S, H = 16384, 4


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
    k = 1

    def mla(block, tps):
        return MLAAttentionSpec(block_size=block, num_kv_heads=1, head_size=8, dtype=torch.float16,
                                max_tp_shards=1, model_version="deepseek_v4", tokens_per_state=tps)

    def swa(block, window, draft=False, head=8):
        return SlidingWindowMLASpec(block_size=block, num_kv_heads=1, head_size=head, dtype=torch.float16,
                                    max_tp_shards=1, sliding_window=window, is_draft=draft)

    groups = [(mla(16384, 128), False), (mla(512, 4), False), (mla(512, 4), False),
              (swa(128, 128, draft=True), True), (swa(8, 128), False), (swa(4, 8), False)]
    max_len = 2 * N + 4 * S
    blocks = 64 + 2 * sum(-(-max_len // spec.block_size) for spec, _ in groups)
    mgr, sched, hasher = build(groups, S=S, H=H, use_eagle=True, L=0, Lp=1, k=k, retention=retention,
                               max_model_len=max_len, num_blocks=blocks)
    prompt = [(7 * i) % 30000 + 1 for i in range(N)]
    return [serve(mgr, sched, hasher, prompt, k, f"r{i}") for i in range(4)]


def main():
    init_none_hash(sha256)
    print(f"vllm={vllm.__version__} layout=dsv4_report N={N} k=1 drop")
    for retention in (0, None):
        first, *resends = hits(retention)
        print(f"case=drop_retention_{retention} N={N} first={first} resends={','.join(map(str, resends))}")


if __name__ == "__main__":
    main()
