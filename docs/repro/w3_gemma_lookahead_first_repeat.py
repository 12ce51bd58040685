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

Standalone: needs only vLLM 0.33.0 (CPU is enough) and first_repeat.py beside it.
Run: python w3_gemma_lookahead_first_repeat.py
On a vLLM without lookahead block hashes (0.32.0) it says so and exits with status 1: W3 cannot occur there.
Each request runs as Scheduler.schedule / update_from_output run it alone with an unlimited token budget
(the scheduler's own _reserve_prefill_lookahead clips the chunks). Prints, per retention interval, the hits
of the first request and of three resends.
"""

import sys

import torch

import vllm
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import init_none_hash
from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

from first_repeat import build, has_lookahead_hashes, serve  # docs/repro/first_repeat.py, beside this script

N = 577
S, H = 64, 32


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
    if not has_lookahead_hashes():
        sys.exit(f"W3 needs lookahead block hashes, which vLLM {vllm.__version__} does not have (its KVCacheManager "
                 f"and get_request_block_hasher take no num_hash_lookahead_tokens), so W3 cannot occur there. "
                 f"Run this script on vLLM 0.33.0.")
    init_none_hash(sha256)
    print(f"vllm={vllm.__version__} layout=full64+swa32w512 N={N} k=2 multi_module_mtp lookahead")
    for retention in (0, None):
        first, *resends = hits(retention)
        print(f"case=retention_{retention} N={N} first={first} resends={','.join(map(str, resends))}")


if __name__ == "__main__":
    main()
