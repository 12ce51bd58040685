#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""F1: vLLM 0.33.0's prefix-cache lookup raises IndexError with multi-module MTP (lookahead hashes, L >= 2)
when no full-attention group caps the lookup: the sliding-window, chunked-local and block-granular Mamba
finders index the request's block hashes up to (N - 1) // block without checking how many exist, and only
(N - L) // hash_block do.

Standalone: needs only vLLM 0.33.0 (CPU is enough; no model, no GPU). Run: python f1_index_error.py
On a vLLM without lookahead block hashes (0.32.0) it says so and exits with status 1: F1 cannot occur there.
Prints one line per case: the layout, N, how many block hashes the request has, and what
KVCacheManager.get_computed_blocks (the scheduler's lookup) does on an EMPTY cache.
"""

import inspect
import sys

import torch

import vllm
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.kv_cache_interface import (ChunkedLocalAttentionSpec, KVCacheConfig, KVCacheGroupSpec, MambaSpec,
                                        SlidingWindowSpec)
from vllm.v1.request import Request

# Multi-module MTP with 2 speculative tokens and lookahead block hashes (vLLM's default without a KV
# connector): num_hash_lookahead_tokens = num_prefill_lookahead = 2, no eagle drop.
L = 2


def has_lookahead_hashes():
    """vLLM 0.33.0's KVCacheManager and get_request_block_hasher take num_hash_lookahead_tokens; 0.32.0's do not."""
    return all("num_hash_lookahead_tokens" in inspect.signature(fn).parameters
               for fn in (KVCacheManager, get_request_block_hasher))


def attn(cls, block_size, **kw):
    return cls(block_size=block_size, num_kv_heads=1, head_size=8, dtype=torch.float16, **kw)


CASES = [
    # (name, specs, scheduler block S, hash block h, prompt lengths)
    ("swa16w64", [attn(SlidingWindowSpec, 16, sliding_window=64)], 16, 16, [32, 33]),
    ("chunked16c64", [attn(ChunkedLocalAttentionSpec, 16, attention_chunk_size=64)], 16, 16, [16, 17]),
    ("swa32w64+mamba64", [attn(SlidingWindowSpec, 32, sliding_window=64),
                          MambaSpec(64, ((4,),), (torch.float32,), mamba_cache_mode="align")], 64, 32, [32, 33]),
]


def main():
    if not has_lookahead_hashes():
        sys.exit(f"F1 needs lookahead block hashes, which vLLM {vllm.__version__} does not have (its KVCacheManager "
                 f"and get_request_block_hasher take no num_hash_lookahead_tokens), so F1 cannot occur there. "
                 f"Run this script on vLLM 0.33.0.")
    init_none_hash(sha256)
    print(f"vllm={vllm.__version__} L={L}")
    for name, specs, S, h, lengths in CASES:
        cfg = KVCacheConfig(num_blocks=256, kv_cache_tensors=[], prefix_cache_retention_interval=0,
                            kv_cache_groups=[KVCacheGroupSpec([f"layer.{i}"], s) for i, s in enumerate(specs)])
        mgr = KVCacheManager(kv_cache_config=cfg, max_model_len=1024, scheduler_block_size=S, hash_block_size=h,
                             enable_caching=True, use_eagle=False, num_hash_lookahead_tokens=L,
                             num_prefill_lookahead=L)
        hasher = get_request_block_hasher(h, sha256, L)
        for n in lengths:
            req = Request(f"{name}-{n}", list(range(1, n + 1)), SamplingParams(max_tokens=4), None,
                          block_hasher=hasher)
            try:
                _, hit, _ = mgr.get_computed_blocks(req)
                result = f"hit={hit}"
            except IndexError as e:
                result = f"error=IndexError({e})"
            print(f"case={name} N={n} hashes={len(req.block_hashes)} {result}")


if __name__ == "__main__":
    main()
