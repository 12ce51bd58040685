#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""F6: vLLM 0.33.0's FullAttentionManager.find_longest_cache_hit reads its run of cached full blocks only up
to max_length // block_size and, at hash granularity, probes the hash boundaries inside the next block only up
to max_length // alignment_tokens. A full block cached past M = N - 1 vouches for every token before it (the
hashes are prefix-chained), but the lookup never reads it; and vLLM caches only a prompt's LAST hash boundary
inside a partial block (_cache_partial_tail_block), so the boundaries below it are not there to be probed.
A prompt that ends exactly at the end of a cached full block, or inside one, misses what is cached.

Hash-granular layouts only: DCP > 1 with Mamba (Qwen3-Next-like: full attention 1600 sharded, so the
effective block is 1600 * dcp, + Mamba/GDN 1600 in align mode; hash unit and alignment 1600).

Standalone: needs only vLLM 0.33.0 (CPU is enough). Run: python f6_full_probe_past_max.py
Serves a first prompt the way the scheduler does (chunked prefill with a per-step token budget, the
scheduler's own _mamba_block_aligned_split, allocate_slots caching at schedule time, one sampled token,
free; dense retention so every Mamba state the chunks computed is kept), then looks a prompt made of its
first N tokens up with KVCacheManager.get_computed_blocks. Prints, per case: N, the first prompt's length,
the hash boundaries of the second prompt cached for full attention and for Mamba, and vLLM's hit.
"""

import types

import torch

import vllm
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, MambaSpec
from vllm.v1.request import Request, RequestStatus

H = 1600        # hash unit = Mamba block = alignment (partial hash hits: h < S, DCP scales full attention)
BUDGET = 2048   # SchedulerConfig.max_num_batched_tokens: the prefill is chunked


def build(dcp, retention):
    full = FullAttentionSpec(block_size=1600, num_kv_heads=1, head_size=8, dtype=torch.float16)
    mamba = MambaSpec(1600, ((4,),), (torch.float32,), mamba_cache_mode="align")
    cfg = KVCacheConfig(num_blocks=200, kv_cache_tensors=[], prefix_cache_retention_interval=retention,
                        kv_cache_groups=[KVCacheGroupSpec(["full.0"], full), KVCacheGroupSpec(["mamba.0"], mamba)])
    S = 1600 * dcp  # lcm(1600 * dcp, 1600)
    mgr = KVCacheManager(kv_cache_config=cfg, max_model_len=16000, scheduler_block_size=S, hash_block_size=H,
                         enable_caching=True, use_eagle=False, num_hash_lookahead_tokens=0,
                         num_prefill_lookahead=0, dcp_world_size=dcp, pcp_world_size=1)
    assert mgr.coordinator.enable_partial_hash_hits
    partial = mgr.coordinator.enable_partial_hash_hits
    sched = types.SimpleNamespace(  # what Scheduler.__init__ sets (scheduler.py:295-464)
        cache_config=types.SimpleNamespace(block_size=1600, mamba_cache_mode="align"),
        block_size=S, hash_block_size=H, use_eagle_block_drop=False, num_hash_lookahead_tokens=0,
        num_prefill_lookahead=0, need_mamba_block_aligned_split=True,
        mamba_prefill_checkpoint_alignment=mamba.prefill_checkpoint_alignment,
        mamba_has_prefill_checkpoint_blocks=mamba.num_prefill_checkpoint_blocks > 0,
        mamba_partial_cache_hit=partial, mamba_shared_prefix_checkpoint=partial and mgr.mamba_shared_prefix_checkpoint,
        max_num_scheduled_tokens=BUDGET, scheduler_config=types.SimpleNamespace(long_prefill_token_threshold=0))
    return mgr, sched, get_request_block_hasher(H, sha256, 0)


def serve(mgr, sched, hasher, prompt, rid):
    """One request as Scheduler.schedule / update_from_output run it alone: admission lookup, prefill chunks
    of at most BUDGET tokens clipped by the scheduler's own Mamba split, one sampled token, free."""
    req = Request(rid, prompt, SamplingParams(max_tokens=1), None, block_hasher=hasher)
    mgr.new_step_starts()
    blocks, hit, spb = mgr.get_computed_blocks(req)
    req.shared_prefix_boundary = spb
    computed, first = hit, True
    while computed < req.num_tokens:
        n = min(req.num_tokens - computed, sched.max_num_scheduled_tokens)
        n = Scheduler._mamba_block_aligned_split(sched, req, n, hit if first else 0, 0)
        assert n > 0, f"scheduled 0 tokens at {computed} of {req.num_tokens}"
        if first:
            out = mgr.allocate_slots(req, n, num_new_computed_tokens=hit, new_computed_blocks=blocks)
            req.status = RequestStatus.RUNNING
        else:
            out = mgr.allocate_slots(req, n)
        assert out is not None
        computed += n
        req.num_computed_tokens = computed
        first = False
        mgr.new_step_starts()
    req.append_output_token_ids(0)
    mgr.free(req)
    mgr.new_step_starts()
    return hit


def held(mgr, req, group):
    pool = mgr.block_pool
    return [(j + 1) * H for j, x in enumerate(req.block_hashes) if pool.get_cached_block(x, [group]) is not None]


CASES = [
    # (name, DCP size, first prompt, second prompt = its first N tokens)
    ("dcp2", 2, 4800, 3200),
    ("dcp2", 2, 8000, 6400),
    ("dcp4", 4, 6400, 4800),
    ("dcp4", 4, 8000, 6400),
    ("dcp2", 2, 4800, 4800),   # a plain resend: its last boundary inside a block is cached, no loss
]


def main():
    init_none_hash(sha256)
    print(f"vllm={vllm.__version__} layout=full1600(dcp-sharded)+mamba1600 h={H} budget={BUDGET} retention=None")
    for name, dcp, first_len, n in CASES:
        mgr, sched, hasher = build(dcp, None)
        prompt = list(range(1, first_len + 1))
        assert serve(mgr, sched, hasher, prompt, "first") == 0
        second = Request("second", prompt[:n], SamplingParams(max_tokens=1), None, block_hasher=hasher)
        full, mamba = held(mgr, second, 0), held(mgr, second, 1)
        _, hit, _ = mgr.get_computed_blocks(second)
        print(f"case={name} N={n} first={first_len} hashes={len(second.block_hashes)} "
              f"full={','.join(map(str, full)) or '-'} mamba={','.join(map(str, mamba)) or '-'} hit={hit}")


if __name__ == "__main__":
    main()
