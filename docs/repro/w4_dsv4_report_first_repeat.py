#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""W4: the DeepSeek-V4 report, on vLLM 0.33.0's (and 0.32.0's) write side. Both have the read side of the report
fixed (an EAGLE group now peeks one block past the aligned candidate, so a cache holding the whole 46240-token
prompt gives 32768, not 16384). But with an EAGLE drop the replay boundaries the retention masks keep are one
scheduler block below the aligned prompt end, and on DeepSeek-V4 the scheduler block is the 16384-token
alignment: at vLLM's default retention interval 0 the EAGLE sliding-window group keeps its tail at 16384, not at
32768, so the first resend hits 16384 again. It records the junction 32768, so the second resend hits 32768.

Layout: DeepSeek-V4 as in the report: compressed MLA groups of blocks 16384 (tokens_per_state 128), 512 and
512 (tokens_per_state 4), the SWA-MLA cache of block 128 (window 128) that holds the MTP layer (the EAGLE
group), and SWA-MLA compressor states of blocks 8 (window 128) and 4 (window 8); S = A = 16384, h = 4.
Prompt N = 46240, served on an empty cache, then resent three times; drop mode (MTP with a KV connector, or
disable_lookahead_block_hashes), one speculative token.

Standalone: needs only vLLM 0.32.0 or 0.33.0 (CPU is enough) and first_repeat.py beside it.
Run: python w4_dsv4_report_first_repeat.py
Prints the hits of the first request and of three resends at retention 0 and with dense retention.
"""

import inspect

import torch

import vllm
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import init_none_hash
from vllm.v1.kv_cache_interface import MLAAttentionSpec, SlidingWindowMLASpec

from first_repeat import build, serve  # docs/repro/first_repeat.py, beside this script

N = 46240
S, H = 16384, 4


def draft_kwargs(spec_cls, draft):
    """``is_draft=draft`` where the spec has the field (vLLM 0.33.0, read by its planner only); vLLM 0.32.0 marks
    the draft group only by KVCacheGroupSpec.is_eagle_group, as both do here."""
    return {"is_draft": draft} if "is_draft" in inspect.signature(spec_cls).parameters else {}


def hits(retention):
    k = 1

    def mla(block, tps):
        return MLAAttentionSpec(block_size=block, num_kv_heads=1, head_size=8, dtype=torch.float16,
                                max_tp_shards=1, model_version="deepseek_v4", tokens_per_state=tps)

    def swa(block, window, draft=False, head=8):
        return SlidingWindowMLASpec(block_size=block, num_kv_heads=1, head_size=head, dtype=torch.float16,
                                    max_tp_shards=1, sliding_window=window,
                                    **draft_kwargs(SlidingWindowMLASpec, draft))

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
