"""Benchmark of the operator tools (prints; asserts nothing). Run: .venv/bin/python -m tests.tools.bench_tools

Targets (issue 6): explain and plan of one prompt well under 1 s, plan of a 10,000-prompt workload under 10 s.
The dense-cache table's baseline, measured in the same run, is the straightforward evaluation: refimpl.hit
with a CacheState.up_to cache per request, without DenseCache or the per-(N, P) memo (timed on a sample and
scaled). The written-cache table (the default of ``kvhit plan``: each request reads what its shared prefix
left, refimpl.request_writes + written_cache) is timed on 1,000 prompts, against the dense evaluation of the
same settings and workload in the same run.
"""

import subprocess
import sys
import time

from kvhit import plan, refimpl
from kvhit.explain import speculation
from kvhit.layouts import catalogue
from kvhit.refimpl import CacheState


def _cli(*args):
    started = time.perf_counter()
    subprocess.run([sys.executable, "-m", "kvhit.cli", *args], check=True, capture_output=True)
    return time.perf_counter() - started


def _baseline(cands, workload, sample=300):
    part = workload[:sample]
    started = time.perf_counter()
    for s in cands.settings:
        groups = len(s.sizes.groups)
        for policy in plan.POLICIES:
            for n, p in part:
                refimpl.hit(s.layout, s.speculation, n, CacheState.up_to([p] * groups), policy)
    return (time.perf_counter() - started) * len(workload) / len(part)


def main():
    print(f"{'what':<58} {'seconds':>8}")
    print(f"{'python -c pass (interpreter start, for scale)':<58} {_cli_start():>8.2f}")
    print(f"{'kvhit explain dsv4_report 46240 --speculative drop --compare':<58} "
          f"{_cli('explain', 'dsv4_report', '46240', '--speculative', 'drop', '--compare'):>8.2f}")
    print(f"{'kvhit plan qwen3next (1 prompt, drop k=2 MTP)':<58} "
          f"{_cli('plan', 'qwen3next', '--speculative', 'drop', '--num-speculative-tokens', '2', '--multi-module-mtp', '--shared-prefix', 'fixed:11910', '--requests', '1'):>8.2f}")
    print()
    print(f"{'10,000-prompt workload, dense cache':<40} {'settings':>8} {'plan s':>8} {'baseline s':>11} {'ratio':>7}")
    for name, spec, dist in [("qwen3next", speculation("drop", 2, True), "uniform:2000:30000"),
                             ("gemma", speculation("drop", 1), "uniform:500:30000"),
                             ("three_kind", speculation("drop", 1), "uniform:2000:30000"),
                             ("dsv4_report", speculation("drop", 1), "uniform:8000:70000"),
                             ("dsv4_cuda", speculation("drop", 1), "uniform:2000:60000")]:
        workload = plan.synthetic_workload(dist, "uniform:0:2000", 10000, 0)
        started = time.perf_counter()
        cands = plan.evaluate(plan.candidates(catalogue()[name], spec, cache="dense"), workload)
        plan.rank(cands, "reference")
        elapsed = time.perf_counter() - started
        base = _baseline(cands, workload)
        print(f"{name + ' ' + dist:<40} {len(cands.settings):>8} {elapsed:>8.2f} {base:>11.1f} {base / elapsed:>6.1f}x")
    print()
    print(f"{'1,000-prompt workload, written cache':<40} {'settings':>8} {'R=0 s':>8} {'+R top3 s':>10} "
          f"{'dense s':>8} {'ratio':>7}")
    for name, spec, dist in [("qwen3next", speculation("drop", 2, True), "uniform:2000:30000"),
                             ("gemma", speculation("drop", 1), "uniform:500:30000"),
                             ("three_kind", speculation("drop", 1), "uniform:2000:30000"),
                             ("dsv4_report", speculation("drop", 1), "uniform:8000:70000")]:
        workload = plan.synthetic_workload(dist, "uniform:0:2000", 1000, 0)
        started = time.perf_counter()
        cands = plan.evaluate(plan.candidates(catalogue()[name], spec), workload)
        stage1 = time.perf_counter() - started
        added = plan.with_retention(cands, plan.rank(cands, "reference")[0], 3)
        plan.evaluate(cands, workload, added)
        written = time.perf_counter() - started
        started = time.perf_counter()
        plan.evaluate(plan.candidates(catalogue()[name], spec, cache="dense"), workload)
        dense = time.perf_counter() - started
        print(f"{name + ' ' + dist:<40} {len(cands.settings):>8} {stage1:>8.2f} {written:>10.2f} {dense:>8.2f} "
              f"{written / dense:>6.1f}x")


def _cli_start():
    started = time.perf_counter()
    subprocess.run([sys.executable, "-c", "pass"], check=True)
    return time.perf_counter() - started


if __name__ == "__main__":
    main()
