#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""W1: with multi-module MTP in drop mode (use_eagle=True: MTP with a KV connector or
disable_lookahead_block_hashes, num_speculative_tokens=2; on vLLM 0.32.0, MTP with prefix caching), vLLM 0.33.0
and 0.32.0 keep one token of the prompt "reprefillable" (num_reprefillable_tokens = Lp - 1), so on a prompt whose
length is a multiple of the block the EAGLE group's cached prefix ends one block short of N. A resend then peeks
past the last cached block, drops it and resumes one scheduler block below the Mamba checkpoint the first request
stored, where no Mamba state exists: the first resend hits 0 and recomputes the whole prompt. That resend stores
the state at its junction, so the second resend hits.

Layout: Qwen3-Next-like: full attention (block 1600) + Mamba/GDN (block 1600, align mode); S = A = h = 1600.
Prompt N = 8000 (5 * 1600), served on an empty cache, then resent three times.

Standalone: needs only vLLM 0.32.0 or 0.33.0 (CPU is enough) and first_repeat.py beside it.
Run: python w1_qwen3next_mtp_drop_first_repeat.py
Each request runs as Scheduler.schedule / update_from_output run it alone with an unlimited token budget
(the scheduler's own _mamba_block_aligned_split and _reserve_prefill_lookahead clip the chunks). Prints,
per retention interval, the hits of the first request and of three resends, and the same with dense
retention and without speculation for comparison.
"""

import torch

import vllm
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import init_none_hash
from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec

from first_repeat import build, serve  # docs/repro/first_repeat.py, beside this script

N = 8000
S = H = 1600


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
