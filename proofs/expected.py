"""Expected verdicts other than PROVED for the modelled policies (and REFUTED for known-bad variants).

Each entry is a finding: a property the policy does not have, with the reason. A verdict that differs from
this table fails ``make prove``. The counterexamples are in ``tests/vectors/hit_tokens/`` and each one is
pinned by a regression test. Findings on ``vllm_0_33`` are candidate vLLM bugs, to be confirmed on the
real engine by the conformance suite.
"""

# F1: vLLM 0.33's sliding-window, chunked-local and block-granular Mamba lookups read block hashes up to
#     M // b without checking how many exist. M is N - 1 but only (N - L) // h hashes exist, so with
#     L >= 2 lookahead tokens (multi-module MTP) a layout without a full-attention group to cap the
#     candidate reads past the hashes: IndexError in vLLM (seen on vLLM 0.33.0: one SWA(16, window 64)
#     group, L = 2, N = 33). In the model the read returns whatever the cache holds past the hashes, so the
#     same inputs also break the cap and validity.
F1 = "reads past the block hashes when L >= 2 (IndexError in vLLM)"
# F2: the Unitary coordinator looks up at N - 1 and then drops a whole block, even when the dropped block
#     is cached within the hashes (N a multiple of the block): one block lost per repeat (vLLM 0.33.0,
#     full attention block 16, N = 1024, drop mode: 992 where 1008 is safe; the Hybrid coordinator's
#     eagle margin already gets 1008).
F2 = "Unitary drop loses one block more than the drop unit"
# F5: a sliding-window lookup with no full window cached aligns the run from block 0, pops the EAGLE block and
#     aligns again, losing an alignment unit (gemma, drop, N = 960, a run of 480 tokens: 384 where 448 is safe).
F5 = "sliding-window drop aligns, drops and aligns again"
# F6: a full-attention lookup at hash granularity reads blocks and boundaries only up to N - 1, where vLLM caches
#     only a prompt's last boundary inside a block (qwen3next at DCP 2, N = 3200: 0 where 1600 is safe).
F6 = "full attention at hash granularity stops at N - 1"
# F3: the historical Hybrid loop looks an EAGLE group up at the aligned candidate and re-aligns after the
#     drop, so one drop unit becomes a whole alignment unit (DeepSeek-V4: 32768 -> 16384).
F3 = "drop at the aligned candidate, then re-align (the DeepSeek-V4 report)"

# W: vLLM 0.33's write side keeps state where a later request does not resume (all three confirmed on
#    vLLM 0.33.0's KVCacheManager and the scheduler's chunk rules; tests/regressions/test_reported_cases.py):
#    W1 with multi-module MTP in drop mode the reprefillable token keeps the EAGLE group's cached prefix one
#       block short on a block-aligned prompt, so a resend resumes a scheduler block below the Mamba
#       checkpoint and the masks' boundaries: qwen3next, MTP 2, N = 8000: first repeat 0, then 4800;
#    W2 without a drafter only N - 1 is a replay boundary, so a longer sibling of a block-aligned prompt loses
#       a block under sparse retention: gemma, R = 0, N = 704, a sibling of 800 tokens hits 640, not 704;
#    W3 with lookahead hashes (L >= 2) a resend resumes at floor_A(N - L), below the boundary N - 1 the masks
#       keep: gemma, MTP 2 lookahead, R = 0, N = 577: first repeat 0, then 512.
#    W4 with an EAGLE drop the boundaries sit one scheduler block below the aligned prompt end, which on a
#       layout whose scheduler block is the alignment (DeepSeek-V4, 16384) is a whole alignment unit below
#       where the read side resumes: the DeepSeek-V4 report, drop, R = 0 (vLLM's default), N = 46240: the
#       first repeat still hits 16384, then 32768 (32768 with dense retention and under the reference).
W = "replay boundaries miss where the read side resumes (W1 MTP drop, W2 longer sibling, W3 lookahead)"
W4 = "EAGLE replay boundary one 16384-token scheduler block low: the DeepSeek-V4 report's first repeat"
# F4: the historical write side keeps the state at floor_A(N - 1) while the EAGLE-adjusted read resumes a
#     block lower (the Qwen3-Next report: mask 11200, resume point 9600, first repeat 0, second 9600).
F4 = "mask keeps N - 1, EAGLE read resumes a block lower (the Qwen3-Next report)"

EXPECTED = {
    ("scheduler_and_mask_boundaries_agree", "vllm_0_33"): ("REFUTED", W),
    ("scheduler_and_mask_boundaries_agree", "historical"): ("REFUTED", F4 + "; " + W),
    ("scheduler_and_mask_boundaries_agree@qwen3next_11910", "historical"): ("REFUTED", F4),
    ("scheduler_and_mask_boundaries_agree@dsv4_report_46240_retention0", "vllm_0_33"): ("REFUTED", W4),
    ("scheduler_and_mask_boundaries_agree@dsv4_report_46240_retention0", "historical"): ("REFUTED", F4),
    ("hit_is_aligned_and_capped", "vllm_0_33"): ("REFUTED", F1),
    ("lookup_stays_within_hashes", "vllm_0_33"): ("REFUTED", F1),
    ("hit_is_valid_in_every_group", "vllm_0_33"): ("REFUTED", F1),
    ("hit_is_the_longest_valid", "vllm_0_33"): ("REFUTED", F2 + "; " + F5 + "; " + F6),
    ("eagle_loses_at_most_one_block_beyond_alignment", "vllm_0_33"): ("REFUTED", F2 + "; " + F5),
    ("hit_is_aligned_and_capped", "historical"): ("REFUTED", F1),
    ("lookup_stays_within_hashes", "historical"): ("REFUTED", F1),
    ("hit_is_valid_in_every_group", "historical"): ("REFUTED", F1),
    ("hit_is_the_longest_valid", "historical"): ("REFUTED", F2 + "; " + F3),
    ("eagle_loses_at_most_one_block_beyond_alignment", "historical"): ("REFUTED", F2 + "; " + F3),
    ("eagle_loses_at_most_one_block_beyond_alignment@dsv4_report_46240", "historical"): ("REFUTED", F3),
    # vLLM 0.32.0 (checked on the settings its engine has: no lookahead hashes, so neither F1 nor W3, which
    # need them): 0.33's read side, so F2, F5 and F6 on the same configurations, and W1, W2 and W4.
    ("hit_is_the_longest_valid", "vllm_0_32"): ("REFUTED", F2 + "; " + F5 + "; " + F6),
    ("eagle_loses_at_most_one_block_beyond_alignment", "vllm_0_32"): ("REFUTED", F2 + "; " + F5),
    ("scheduler_and_mask_boundaries_agree", "vllm_0_32"): ("REFUTED", W),
    ("scheduler_and_mask_boundaries_agree@dsv4_report_46240_retention0", "vllm_0_32"): ("REFUTED", W4),
}
