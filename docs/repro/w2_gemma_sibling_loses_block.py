#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""W2: without a drafter, vLLM 0.33.0's (and 0.32.0's) sparse retention (prefix_cache_retention_interval=0,
the engine default) keeps sliding-window state only for the replay boundary N - 1. The window tail a resend
needs (ending at floor_A(N - 1)) is kept, but when the block size divides N the block ending at N is not kept,
so a longer prompt extending the first one (the next turn of a chat, a longer sibling) resumes one alignment
unit lower than it would with dense retention.

Layout: Gemma-like: full attention (block 64) + sliding window (block 32, window 512); S = A = 64, h = 32.
First request N = 704 (11 * 64) on an empty cache, then a sibling of 800 tokens sharing the 704.

Standalone: needs only vLLM 0.32.0 or 0.33.0 (CPU is enough). Run: python w2_gemma_sibling_loses_block.py
Serves the first request the way the scheduler does with no drafter and an unlimited token budget (one
prefill chunk, allocate_slots caches at schedule time; one sampled token; free), then looks the sibling up
with KVCacheManager.get_computed_blocks. Prints, per retention interval: the sibling's hit, the resend's
hit, and whether the full 704-token window tail is cached.
"""

import inspect

import torch

import vllm
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, SlidingWindowSpec
from vllm.v1.request import Request

N, SIBLING = 704, 800
S, H = 64, 32  # scheduler block lcm(64, 32); hash unit: the smallest block (cache_config.block_size)


def lookahead_kwargs(fn):
    """``num_hash_lookahead_tokens=0`` where ``fn`` takes it (vLLM 0.33.0); vLLM 0.32.0 has no lookahead hashes."""
    takes = "num_hash_lookahead_tokens" in inspect.signature(fn).parameters
    return {"num_hash_lookahead_tokens": 0} if takes else {}


def manager(retention):
    full = FullAttentionSpec(block_size=64, num_kv_heads=1, head_size=8, dtype=torch.float16)
    swa = SlidingWindowSpec(block_size=32, num_kv_heads=1, head_size=8, dtype=torch.float16, sliding_window=512)
    cfg = KVCacheConfig(num_blocks=400, kv_cache_tensors=[],
                        kv_cache_groups=[KVCacheGroupSpec(["full.0"], full), KVCacheGroupSpec(["swa.0"], swa)],
                        prefix_cache_retention_interval=retention)
    return KVCacheManager(kv_cache_config=cfg, max_model_len=2048, scheduler_block_size=S, hash_block_size=H,
                          enable_caching=True, use_eagle=False, num_prefill_lookahead=0,
                          **lookahead_kwargs(KVCacheManager))


def run(retention):
    mgr = manager(retention)
    hasher = get_request_block_hasher(H, sha256, **lookahead_kwargs(get_request_block_hasher))
    prompt = list(range(1, N + 1))
    first = Request("first", prompt, SamplingParams(max_tokens=1), None, block_hasher=hasher)
    mgr.new_step_starts()
    blocks, hit, spb = mgr.get_computed_blocks(first)
    first.shared_prefix_boundary = spb
    assert hit == 0
    assert mgr.allocate_slots(first, N, num_new_computed_tokens=0, new_computed_blocks=blocks) is not None
    first.num_computed_tokens = N
    first.append_output_token_ids(0)  # the one sampled token; the request ends
    mgr.free(first)
    mgr.new_step_starts()
    sibling = Request("sibling", prompt + list(range(50_001, 50_001 + SIBLING - N)), SamplingParams(max_tokens=1),
                      None, block_hasher=hasher)
    _, sibling_hit, _ = mgr.get_computed_blocks(sibling)
    resend = Request("resend", prompt, SamplingParams(max_tokens=1), None, block_hasher=hasher)
    _, resend_hit, _ = mgr.get_computed_blocks(resend)
    # Which block boundaries of the prompt the sliding-window group (KV-cache group 1) still holds.
    pool = mgr.block_pool
    held = [(j + 1) * H for j, x in enumerate(sibling.block_hashes) if pool.get_cached_block(x, [1]) is not None]
    return sibling_hit, resend_hit, N in held


def main():
    init_none_hash(sha256)
    print(f"vllm={vllm.__version__} layout=full64+swa32w512 N={N} sibling={SIBLING}")
    for retention in (0, None):
        sibling_hit, resend_hit, tail_at_n = run(retention)
        print(f"case=retention_{retention} N={N} sibling={SIBLING} sibling_hit={sibling_hit} "
              f"resend_hit={resend_hit} swa_block_ending_at_N_cached={int(tail_at_n)}")


if __name__ == "__main__":
    main()
