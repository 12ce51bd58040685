"""Every invariant's verdict for one policy on the default configurations, outside `make prove`.

For a policy not (yet) in ``kvhit.spec.policy.POLICIES`` (``vllm_0_32``): every invariant of
``kvhit.proofs.runner.INVARIANTS`` on each default configuration it applies to (heavy ones left out, as the
default run does) whose speculative setting the policy has (:func:`kvhit.proofs.model.accepts`: no lookahead
for vllm_0_32), checked and tabled as ``make prove`` does (the runner's chunks, each in a fresh process,
its verdict rows and its table, with one counterexample per refuted row).

    .venv/bin/python -m tests.tools.verdicts_for_policy vllm_0_32 [--jobs 1] [--json out.json]
    .venv/bin/python -m tests.tools.verdicts_for_policy vllm_0_33 --like vllm_0_32   # the same configurations
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from kvhit.proofs import runner
from kvhit.proofs.model import accepts, isolated_map
from kvhit.spec.policy import ALL_POLICIES


def _tasks(policy: str, like: str | None = None) -> list:
    rules = ALL_POLICIES[like or policy]
    cfgs = runner._configs()
    return [(inv.name, policy, i, None) for inv in runner.INVARIANTS for i, c in enumerate(cfgs)
            if inv.write_side == c.write_side and inv.applies(c) and not inv.heavy(c) and accepts(rules, c)]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("policy", choices=sorted(ALL_POLICIES))
    parser.add_argument("--jobs", type=int, default=1)
    parser.add_argument("--like", choices=sorted(ALL_POLICIES),
                        help="check only the configurations this policy accepts (to compare two policies)")
    parser.add_argument("--json", help="write the rows, with every refuted configuration, to this file")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    todo = _tasks(args.policy, args.like)
    results = [r for chunk in isolated_map(runner._run_chunk, runner.chunks(todo), args.jobs) for r in chunk]
    wall = time.perf_counter() - start
    order = {t: i for i, t in enumerate(todo)}
    results.sort(key=lambda r: order[r[0]])
    verdicts = list(runner.verdicts_of(results, runner._configs()).values())
    print(runner.table(verdicts))
    seconds, units = sum(v.seconds for v in verdicts), sum(v.rlimit for v in verdicts)
    print(f"{len(results)} checks, {seconds:.1f} s of checks, {wall:.1f} s wall on {args.jobs} job(s), "
          f"{units / 1e9:.2f} G units")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"policy": args.policy, "rows": [v.as_json() for v in verdicts], "checks": len(results),
                       "seconds": seconds, "wall": wall, "rlimit": units}, f, indent=1, default=str)
    return 0 if all(v.verdict in ("PROVED", "REFUTED") for v in verdicts) else 1


if __name__ == "__main__":
    sys.exit(main())
