#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""F6: vLLM 0.33.0's (and 0.32.0's) FullAttentionManager.find_longest_cache_hit reads its run of cached full
blocks only up to max_length // block_size and, at hash granularity, probes the hash boundaries inside the next
block only up to max_length // alignment_tokens. A full block cached past M = N - 1 vouches for every token
before it (the hashes are prefix-chained), but the lookup never reads it; and vLLM caches only a prompt's LAST
hash boundary inside a partial block (_cache_partial_tail_block), so the boundaries below it are not there to be
probed. A prompt that ends exactly at the end of a cached full block, or inside one, misses what is cached.

Hash-granular layouts only: DCP > 1 with Mamba (Qwen3-Next-like: full attention 1600 sharded, so the
effective block is 1600 * dcp, + Mamba/GDN 1600 in align mode; hash unit and alignment 1600).

Standalone: needs only vLLM 0.32.0 or 0.33.0 (CPU is enough) and first_repeat.py beside it.
Run: python f6_full_probe_past_max.py
Serves a first prompt the way the scheduler does (chunked prefill with a per-step token budget, the
scheduler's own _mamba_block_aligned_split, allocate_slots caching at schedule time, one sampled token,
free; dense retention so every Mamba state the chunks computed is kept), then looks a prompt made of its
first N tokens up with KVCacheManager.get_computed_blocks. Prints, per case: N, the first prompt's length,
the hash boundaries of the second prompt cached for full attention and for Mamba, and vLLM's hit.
"""

import torch

import first_repeat  # docs/repro/first_repeat.py, beside this script: the manager and one served request
import vllm
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import init_none_hash
from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec
from vllm.v1.request import Request

H = 1600        # hash unit = Mamba block = alignment (partial hash hits: h < S, DCP scales full attention)
BUDGET = 2048   # SchedulerConfig.max_num_batched_tokens: the prefill is chunked


def build(dcp, retention):
    full = FullAttentionSpec(block_size=1600, num_kv_heads=1, head_size=8, dtype=torch.float16)
    mamba = MambaSpec(1600, ((4,),), (torch.float32,), mamba_cache_mode="align")
    mgr, sched, hasher = first_repeat.build([(full, False), (mamba, False)], S=1600 * dcp, H=H, use_eagle=False,
                                            L=0, Lp=0, k=0, retention=retention, max_model_len=16000,
                                            num_blocks=200, dcp=dcp, budget=BUDGET)
    assert mgr.coordinator.enable_partial_hash_hits and sched.mamba_partial_cache_hit
    return mgr, sched, hasher


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
        assert first_repeat.serve(mgr, sched, hasher, prompt, 0, "first") == 0
        second = Request("second", prompt[:n], SamplingParams(max_tokens=1), None, block_hasher=hasher)
        full, mamba = held(mgr, second, 0), held(mgr, second, 1)
        _, hit, _ = mgr.get_computed_blocks(second)
        print(f"case={name} N={n} first={first_len} hashes={len(second.block_hashes)} "
              f"full={','.join(map(str, full)) or '-'} mamba={','.join(map(str, mamba)) or '-'} hit={hit}")


if __name__ == "__main__":
    main()
