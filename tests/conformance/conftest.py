"""Conformance session summary: scenarios run, lookups compared, throughput and coverage."""

from .budget_side import BUDGET_STATS
from .differential import STATS
from .vllm_harness import VLLM_VERSION
from .write_side import WRITE_STATS

# Tied to vLLM 0.33.0's findings, patches and lookahead hashes: collected on 0.33.0 only (the 0.32.0 run,
# `make conformance-032`, is the two differential suites, test_junction_below.py, the findings the 0.32.0
# repros share in test_findings_reproduce.py and the 0.32.0 adapter's test_adapter_on_0_32.py). Any other
# release is an error, not a quietly smaller suite.
if VLLM_VERSION == "0.32.0":
    collect_ignore = ["test_comparison_can_fail.py", "test_counterexamples_on_vllm.py", "test_patched_vllm.py"]
elif VLLM_VERSION == "0.33.0":
    collect_ignore = ["test_adapter_on_0_32.py"]  # make conformance-032's
else:
    raise RuntimeError(f"tests/conformance runs on vLLM 0.33.0 (make test) or 0.32.0 (make conformance-032), "
                       f"not {VLLM_VERSION}")


def pytest_terminal_summary(terminalreporter):
    _read_side(terminalreporter)
    _write_side(terminalreporter)
    _budgets(terminalreporter)


def _budgets(terminalreporter):
    s = BUDGET_STATS
    if s.scenarios == 0:
        return
    w = terminalreporter.write_line
    terminalreporter.section(f"vLLM {VLLM_VERSION} write side under token budgets")
    w(f"scenarios {s.scenarios} (first request cut by the budget: {s.cut}); lookups compared with the read side "
      f"on vLLM's cache {s.lookups} (IndexError predicted and raised: {s.crashes}; stalls predicted: {s.stalls})")
    w(f"boundaries vLLM kept beyond the model, at chunk ends: {s.extra_boundaries}; boundaries the model keeps "
      f"and vLLM freed, none serving an aligned hit: {s.lost_boundaries}; first resends above the model's: "
      f"{s.resends_above_model}")
    w(f"throughput {s.scenarios / s.seconds if s.seconds else 0.0:.1f} scenarios/s ({s.seconds:.1f} s)")
    for line in s.lines():
        w(line)


def _write_side(terminalreporter):
    s = WRITE_STATS
    if s.scenarios == 0:
        return
    w = terminalreporter.write_line
    terminalreporter.section(f"vLLM {VLLM_VERSION} write-side conformance")
    w(f"scenarios {s.scenarios}: retained boundaries compared for {s.retained_groups} KV-cache groups, "
      f"{s.resends} resends, {s.siblings} sibling lookups (hit > 0: {s.positive}); IndexError predicted and "
      f"raised: {s.crashes_predicted}; scheduler stalls (docs/findings.md, S1): {s.stalls}")
    w(f"resends hitting less than with every state retained (dense): {s.below_dense}")
    w(f"diverging prompts served: {s.diverging}; prompts sharing their junction looked up: {s.at_junction} "
      f"(hit > 0: {s.at_junction_positive})")
    w(f"throughput {s.scenarios / s.seconds if s.seconds else 0.0:.1f} scenarios/s ({s.seconds:.1f} s)")
    for line in s.lines():
        w(line)


def _read_side(terminalreporter):
    if STATS.scenarios == 0 and STATS.rejected_by_both == 0:
        return
    rate = STATS.scenarios / STATS.seconds if STATS.seconds else 0.0
    w = terminalreporter.write_line
    terminalreporter.section(f"vLLM {VLLM_VERSION} conformance")
    w(f"scenarios {STATS.scenarios} ({STATS.rejected_by_both} more rejected by both vLLM and the spec), "
      f"lookups compared {STATS.lookups} (hit > 0: {STATS.positive_hits}, IndexError predicted and "
      f"raised: {STATS.crashes_predicted}; scheduler stalls, see docs/findings.md: {STATS.stalls})")
    w(f"lookups where vLLM's hit is below the reference policy's on the same cache state: "
      f"{STATS.below_reference}")
    w(f"throughput {rate:.1f} scenarios/s ({STATS.seconds:.1f} s in scenarios)")
    for line in STATS.lines():
        w(line)
