"""The one table of vLLM tests whose outcome under ``enforce`` is expected to differ from stock.

vLLM's tests pin vLLM 0.33.0's own hit lengths, so where kvhit's ``reference`` policy hits more (a defect of
docs/findings.md) the enforced run fails the assertion; and where kvhit itself is wrong the table says so
(``Kind.KVHIT_BUG``), to be deleted when the fix lands. ``make vllm-tests`` fails when enforce differs from
stock in a test not listed here, and when a listed test stops differing (or differs another way).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class Finding(enum.Enum):
    """The finding of docs/findings.md that explains a difference."""

    F1 = "F1: IndexError in the lookup with multi-module MTP when no full-attention group caps it"
    F2 = "F2: the Unitary coordinator's eagle drop loses one block more than necessary"
    W1 = "W1: with multi-module MTP in drop mode, the first resend of a block-aligned prompt misses"
    W2 = "W2: under sparse retention a longer sibling of a block-aligned prompt loses a block"
    W3 = "W3: with lookahead hashes (L >= 2) the first resend misses under sparse retention"
    W4 = "W4: the DeepSeek-V4 report's 16384 comes back on the first resend at the default retention"
    S1 = "S1: a prefill never finishes: 0 tokens scheduled every step"


class Kind(enum.Enum):
    IMPROVEMENT = "kvhit improvement"
    """The reference hits more than vLLM 0.33.0 (or keeps what a later lookup hits), and vLLM's test pins
    vLLM's number."""
    KVHIT_BUG = "kvhit bug, being fixed"
    """kvhit is wrong here: delete the entry when the fix lands."""


OUTCOMES = ("passed", "failed", "skipped", "error", "xfailed", "xpassed")
"""A test's outcome as the plugin records it (pytest's words)."""

Numbers = int | tuple[int, ...] | str
"""What a mode computes at the test's assertion: a count, block indices, or the exception raised."""


@dataclass(frozen=True)
class ExpectedDifference:
    """One test whose enforced outcome differs from stock, with the numbers that make it differ."""

    test_id: str
    quantity: str
    """What the numbers are (the quantity the failing assertion checks, and the setting)."""
    stock: Numbers
    enforce: Numbers
    finding: Finding | None
    """The finding the difference comes from (None for a kvhit bug no finding describes)."""
    why: str
    kind: Kind
    enforce_outcome: str = "failed"
    stock_outcome: str = "passed"

    def __post_init__(self) -> None:
        for outcome in (self.enforce_outcome, self.stock_outcome):
            assert outcome in OUTCOMES, f"{self.test_id}: {outcome!r} is not a pytest outcome ({OUTCOMES})"


_PREFIX_CACHING = "tests/v1/core/test_prefix_caching.py::"
_PARTIAL_HITS = "tests/v1/core/prefix_cache/test_partial_prefix_cache_hits.py::"

EXPECTED: tuple[ExpectedDifference, ...] = (
    ExpectedDifference(
        _PREFIX_CACHING + "test_eagle_identical_prompt_hit[False-48-1]",
        quantity="blocks hit by the repeat of a 48-token prompt (full attention 16, Unitary, EAGLE drop)",
        stock=1, enforce=2, finding=Finding.F2, kind=Kind.IMPROVEMENT,
        why="vLLM looks up at N - 1 = 47 and then drops a whole block (hit 16); the block size divides N, so "
            "the dropped block is cached and covered by the hashes: the reference hits 32"),
    ExpectedDifference(
        _PREFIX_CACHING + "test_hybrid_local_kv_retention_latest_only_reuses_replay_boundary",
        quantity="SWA blocks cached after a 128-token prompt (full 32 + SWA 8 window 8, retention 0, no drafter)",
        stock=(11,), enforce=(11, 15), finding=Finding.W2, kind=Kind.IMPROVEMENT,
        why="the reference also keeps the window ending at N = 128, where a longer sibling resumes: a "
            "160-token sibling hits 128 (stock 96); the resend hits 96 in both modes"),
    ExpectedDifference(
        _PREFIX_CACHING + "test_hybrid_local_kv_retention_mtp_reuses_latest_boundary",
        quantity="SWA blocks cached after a 127-token prompt (full 32 + SWA 8 window 8 as the EAGLE group, "
                 "drop, retention 0)",
        stock=(7, 8), enforce=(7, 8, 11, 12), finding=Finding.W4, kind=Kind.IMPROVEMENT,
        why="vLLM's drop-mode replay boundary is floor_S(N - 1) - S = 64, one scheduler block below where its "
            "read side resumes; the reference also keeps the window ending at 96 and the block its EAGLE peek "
            "reads: the resend hits 96 (stock 64)"),
    ExpectedDifference(
        _PREFIX_CACHING + "test_pure_swa_retention_latest_only",
        quantity="SWA blocks cached after a 256-token prompt (pure SWA 16 window 16, retention 0)",
        stock=(14,), enforce=(14, 15), finding=Finding.W2, kind=Kind.IMPROVEMENT,
        why="the reference also keeps the window ending at N = 256: a 288-token sibling hits 256 (stock 240); "
            "the resend hits 240 in both modes"),
    # Full attention (DCP 8) + Mamba, hash-granular hits, Mamba specs with a backend-internal prefill checkpoint
    # (enforced since the adapter keeps vLLM's internal checkpoint where it is the prompt's resume point):
    # a block-aligned prompt, retention 0, then its resend (extension 0) or a 32-token longer sibling (32).
    *(ExpectedDifference(
        _PARTIAL_HITS + f"test_dcp_fine_hit_retention_uses_hash_alignment[{ext}-False-8-{h}-{b}-{n}-1]",
        quantity=(f"Mamba states cached after a {n}-token prompt (full {b} at DCP 8 + Mamba {b}, hash {h}, "
                  "retention 0, no drafter)" if ext == 0 else
                  f"hit of a {n + ext}-token sibling of the {n}-token prompt (the same layout)"),
        stock=(n - h,) if ext == 0 else n - h, enforce=(n - h, n) if ext == 0 else n, finding=Finding.W2,
        kind=Kind.IMPROVEMENT,
        why=f"the reference also keeps the Mamba state at N = {n}, where a longer sibling resumes: the sibling "
            f"hits {n} (stock {n - h}); the resend hits {n - h} in both modes")
      for ext in (0, 32) for h, b, n in ((16, 16, 512), (128, 896, 7168))),
)
"""Every expected enforce difference, observed by ``make vllm-tests``. None is a kvhit bug: the six there
were at 736d285 (docs/vllm-tests.md, "History") were fixed by d2711fb. The last four came with enforcing
layouts whose Mamba specs declare a backend-internal prefill checkpoint (before, left wholly to vLLM)."""
