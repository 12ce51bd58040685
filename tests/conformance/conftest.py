"""Conformance session summary: scenarios run, lookups compared, throughput and coverage."""

from .differential import STATS


def pytest_terminal_summary(terminalreporter):
    if STATS.scenarios == 0 and STATS.rejected_by_both == 0:
        return
    rate = STATS.scenarios / STATS.seconds if STATS.seconds else 0.0
    w = terminalreporter.write_line
    terminalreporter.section("vLLM 0.33.0 conformance")
    w(f"scenarios {STATS.scenarios} ({STATS.rejected_by_both} more rejected by both vLLM and the spec), "
      f"lookups compared {STATS.lookups} (hit > 0: {STATS.positive_hits}, IndexError predicted and "
      f"raised: {STATS.crashes_predicted}; scheduler stalls, see docs/findings.md: {STATS.stalls})")
    w(f"lookups where vLLM's hit is below the reference policy's on the same cache state: "
      f"{STATS.below_reference}")
    w(f"throughput {rate:.1f} scenarios/s ({STATS.seconds:.1f} s in scenarios)")
    w(f"by layout: {dict(sorted(STATS.by_layout.items()))}")
    w(f"by speculation: {dict(sorted(STATS.by_mode.items()))}")
    w(f"by retention: {dict(sorted(STATS.by_retention.items()))}; by DCP: {dict(sorted(STATS.by_dcp.items()))}")
