"""Benchmark of the operator tools (prints; asserts nothing). Run: .venv/bin/python -m tests.tools.bench_tools

Targets (issue 6): explain and plan of one prompt well under 1 s, plan of a 10,000-prompt workload under 10 s.
The dense-cache table's baseline, measured in the same run, is the straightforward evaluation: refimpl.hit
with a CacheState.up_to cache per request, without DenseCache or the per-(N, P) memo (timed on a sample and
scaled). The written-cache table (the default of ``kvhit plan``: each request reads what its shared prefix
left) times what the CLI does (``plan.plan_settings``: every setting at R = 0 and then the best three at
the other intervals under the ranking policy, the other two policies for the rows shown, or for every
setting with --json) on 10,000 prompts, in one process and in the worker processes ``kvhit plan`` uses by
default (one per available CPU); its baseline, in the same run, is the evaluation before kvhit.written
(refimpl.request_writes and refimpl.written_cache per distinct P and (N, P), every setting and policy),
timed on the first 300 requests and scaled by the distinct (N, P) pairs. Last, the whole ``kvhit plan``
command (interpreter start and imports included) on each of those workloads.
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


def _written_baseline(cands, workload, sample=300):
    """The written-cache evaluation as it was before kvhit.written: refimpl.request_writes once per distinct
    P, refimpl.written_cache once per distinct (N, P), for every setting of ``cands``."""
    part = workload[:sample]
    started = time.perf_counter()
    for s in cands.settings:
        for policy in plan.POLICIES:
            rules = refimpl.policy_rules(policy)
            written, hits = {}, {}
            for n, p in part:
                if (n, p) not in hits:
                    if p not in written:
                        w = refimpl.request_writes(s.sizes, p, s.retention, rules)
                        written[p] = w, plan.retained_of(w)
                    hit, reach, _, _ = refimpl.hit_tokens(refimpl.written_cache(written[p][0]), s.sizes, n, rules)
                    hits[(n, p)] = hit, reach > refimpl.hash_reach(s.sizes, n)
    return (time.perf_counter() - started) * len(set(workload)) / len(set(part))


def _written_plan(name, spec, workload, jobs, shown):
    """What ``kvhit plan`` does on the written cache (``plan.plan_settings``: every setting at R = 0 and
    the best three at the other retention intervals under the ranking policy, then the other two policies
    for the ``shown`` best, every setting for ``--json``), in ``jobs`` processes. Returns the candidates
    and the seconds it took."""
    started = time.perf_counter()
    cands = plan.candidates(catalogue()[name], spec)
    plan.plan_settings(cands, workload, "reference", 3, shown=shown, jobs=jobs)
    return cands, time.perf_counter() - started


# (layout, speculation, shared-prefix distribution) of the written-cache table
WRITTEN_CASES = [("qwen3next", speculation("drop", 2, True), "uniform:2000:30000"),
                 ("dsv4_report", speculation("drop", 1), "uniform:8000:70000"),
                 ("dsv4_cuda", speculation("drop", 1), "uniform:8000:70000"),
                 ("gemma", speculation("drop", 1), "uniform:500:30000"),
                 ("three_kind", speculation("drop", 1), "uniform:2000:30000")]


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
        cands = plan.evaluate(plan.candidates(catalogue()[name], spec, cache="dense"), workload, jobs=1)
        plan.rank(cands, "reference")
        elapsed = time.perf_counter() - started
        base = _baseline(cands, workload)
        print(f"{name + ' ' + dist:<40} {len(cands.settings):>8} {elapsed:>8.2f} {base:>11.1f} {base / elapsed:>6.1f}x")
    print()
    jobs = plan.default_jobs()
    print("written cache (the default): 'table' is kvhit plan's work for its table (the other two policies for the\n"
          "10 rows shown), 'json' for --json (every policy for every setting); the baseline is the evaluation\n"
          "before kvhit.written, all settings and policies, timed on 300 requests and scaled")
    print(f"{'layout, prefix ~':<34} {'requests':>8} {'(N, P)':>7} {'settings':>8} {'jobs':>4} "
          f"{'table s':>8} {'json s':>7} {'baseline s':>11} {'ratio':>7}")
    for name, spec, dist in WRITTEN_CASES:
        workload = plan.synthetic_workload(dist, "uniform:0:2000", 10000, 0)
        base = None
        for j in sorted({1, jobs}):
            cands, table = _written_plan(name, spec, workload, j, 10)
            json_s = _written_plan(name, spec, workload, j, None)[1] if j == jobs else None
            base = _written_baseline(cands, workload) if base is None else base
            print(f"{name + ' ' + dist:<34} {len(workload):>8} {len(set(workload)):>7} {len(cands.settings):>8} "
                  f"{j:>4} {table:>8.2f} {'' if json_s is None else f'{json_s:.2f}':>7} {base:>11.1f} "
                  f"{base / table:>6.1f}x")
    print()
    print(f"{'kvhit plan, 10,000 requests, default jobs (the whole command)':<64} {'seconds':>8}")
    for name, spec, dist in WRITTEN_CASES:
        args = ["plan", name, "--speculative", spec.mode.value, "--num-speculative-tokens",
                str(spec.num_speculative_tokens)] + (["--multi-module-mtp"] if spec.multi_module_mtp else [])
        seconds = _cli(*args, "--shared-prefix", dist, "--suffix", "uniform:0:2000", "--requests", "10000")
        print(f"{name + ' ' + dist:<64} {seconds:>8.2f}")


def _cli_start():
    started = time.perf_counter()
    subprocess.run([sys.executable, "-c", "pass"], check=True)
    return time.perf_counter() - started


if __name__ == "__main__":
    main()
