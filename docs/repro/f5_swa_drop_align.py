#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""F5: with the EAGLE last-block drop (use_eagle=True: eagle/MTP with a KV connector, or
disable_lookahead_block_hashes; on vLLM 0.32.0, every eagle/MTP drafter with prefix caching), vLLM 0.33.0's
and 0.32.0's SlidingWindowManager.find_longest_cache_hit loses an alignment unit when no full window is cached
(prompts shorter than about the window: the `if not match_found:` path). It keeps the run of cached blocks
from block 0, aligns it down to alignment_tokens, then pops the EAGLE block and aligns again: the second
alignment takes a whole unit more. Popping first and aligning once keeps it.

Layout: Gemma-like: full attention (block 64) + sliding window (block 32, window 512); S = A = 64, h = 32.
Also full attention 32 + sliding window 16 (window 64); S = A = 32, h = 16.

Standalone: needs only vLLM 0.32.0 or 0.33.0 (CPU is enough) and first_repeat.py beside it.
Run: python f5_swa_drop_align.py
Serves a prompt once the way the scheduler does with the drop (one prefill chunk, allocate_slots caches at
schedule time, one sampled token re-cached by cache_blocks, free; retention interval 0, vLLM's default), then
looks the identical prompt up with KVCacheManager.get_computed_blocks, as the scheduler admits a resend.
Prints, per case: N, the hash boundaries of the prompt cached for full attention and for the sliding window,
and the resend's hit.
"""

import torch

import vllm
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import init_none_hash
from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec
from vllm.v1.request import Request

from first_repeat import build, serve  # docs/repro/first_repeat.py, beside this script

LAYOUTS = {
    # name: (full block, sliding-window block, window, S, h)
    "gemma": (64, 32, 512, 64, 32),
    "full32+swa16w64": (32, 16, 64, 32, 16),
}
CASES = [("gemma", 128), ("gemma", 256), ("gemma", 512), ("gemma", 576), ("full32+swa16w64", 64),
         ("full32+swa16w64", 96)]


def resend_hit(name, n):
    full_block, swa_block, window, S, H = LAYOUTS[name]
    full = FullAttentionSpec(block_size=full_block, num_kv_heads=1, head_size=8, dtype=torch.float16)
    swa = SlidingWindowSpec(block_size=swa_block, num_kv_heads=1, head_size=8, dtype=torch.float16,
                            sliding_window=window)
    # Single-module EAGLE with the drop: 1 speculative token, no lookahead hashes, prefill lookahead 1.
    # No group is flagged as the draft group, so vLLM drops in every group (kv_cache_coordinator.py).
    mgr, sched, hasher = build([(full, False), (swa, False)], S=S, H=H, use_eagle=True, L=0, Lp=1, k=1,
                               retention=0, max_model_len=2048, num_blocks=400)
    prompt = list(range(1, n + 1))
    assert serve(mgr, sched, hasher, prompt, 1, "first") == 0
    resend = Request("resend", prompt, SamplingParams(max_tokens=1), None, block_hasher=hasher)
    pool = mgr.block_pool
    held = [[(j + 1) * H for j, x in enumerate(resend.block_hashes) if pool.get_cached_block(x, [g]) is not None]
            for g in (0, 1)]
    _, hit, _ = mgr.get_computed_blocks(resend)
    return held, hit


def main():
    init_none_hash(sha256)
    print(f"vllm={vllm.__version__} drop k=1 retention=0")
    for name, n in CASES:
        (full, swa), hit = resend_hit(name, n)
        print(f"case={name} N={n} full={','.join(map(str, full)) or '-'} swa={','.join(map(str, swa)) or '-'} "
              f"hit={hit}")


if __name__ == "__main__":
    main()
