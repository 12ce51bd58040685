"""Every invariant's verdict for one policy on the default configurations, outside `make prove`.

For a policy not (yet) in ``kvhit.spec.policy.POLICIES`` (``vllm_0_32``): runs
``kvhit.proofs.model.check`` for each invariant of ``kvhit.proofs.runner.INVARIANTS`` on each default
configuration it applies to (``kvhit.proofs.domains.configs(False)``, heavy ones left out as the default
run does), skipping the speculative settings the policy refuses (``check_speculation``: lookahead hashes
for vllm_0_32), a few configurations per fresh process (``isolated_map``), and prints one row per invariant:
verdict, configurations, refuted ones, seconds and Z3 resource units, and one counterexample.

    .venv/bin/python -m tests.tools.verdicts_for_policy vllm_0_32 [--jobs 1] [--json out.json]
    .venv/bin/python -m tests.tools.verdicts_for_policy vllm_0_33 --like vllm_0_32   # the same configurations
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from kvhit.proofs.domains import configs
from kvhit.proofs.model import brief, check, isolated_map
from kvhit.proofs.runner import INVARIANTS
from kvhit.spec.policy import ALL_POLICIES, check_speculation
from kvhit.spec.sizes import derive_sizes

CHUNK = 8  # configurations per process, as the runner's


def _supported(rules, config) -> bool:
    try:
        check_speculation(derive_sizes(config.layout, config.speculation, rules.scale_replicated), rules)
    except ValueError:
        return False
    return True


def _tasks(policy: str, like: str | None = None):
    rules = ALL_POLICIES[like or policy]
    cfgs = configs(False)
    out = []
    for inv in INVARIANTS:
        row = [i for i, c in enumerate(cfgs) if inv.write_side == c.write_side and inv.applies(c)
               and not inv.heavy(c) and _supported(rules, c)]
        out += [tuple((inv.name, policy, i) for i in row[j:j + CHUNK]) for j in range(0, len(row), CHUNK)]
    return out


def _run_chunk(chunk):
    by_name = {inv.name: inv for inv in INVARIANTS}
    cfgs = configs(False)
    out = []
    for name, policy, i in chunk:
        try:
            verdict, seconds, cex, spent = check(by_name[name], ALL_POLICIES[policy], cfgs[i])
        except Exception as exc:  # a spec or lowering error is a failed check, with its cause
            verdict, seconds, cex, spent = "ERROR", 0.0, {"error": f"{type(exc).__name__}: {exc}"}, 0
        out.append((name, i, verdict, seconds, cex, spent))
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("policy", choices=sorted(ALL_POLICIES))
    parser.add_argument("--jobs", type=int, default=1)
    parser.add_argument("--like", choices=sorted(ALL_POLICIES),
                        help="check only the configurations this policy accepts (to compare two policies)")
    parser.add_argument("--json", help="write the rows, with every refuted configuration, to this file")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    results = [r for chunk in isolated_map(_run_chunk, _tasks(args.policy, args.like), args.jobs) for r in chunk]
    wall = time.perf_counter() - start
    cfgs = configs(False)
    rank = {"PROVED": 0, "REFUTED": 1, "UNKNOWN": 2, "REPLAY-MISMATCH": 3, "ERROR": 4}
    rows = {}
    for name, i, verdict, seconds, cex, spent in sorted(results, key=lambda r: r[1]):
        row = rows.setdefault(name, {"invariant": name, "verdict": "PROVED", "configs": 0, "refuted": [],
                                     "seconds": 0.0, "rlimit": 0, "max_rlimit": 0, "counterexample": None})
        row["configs"] += 1
        row["seconds"] += seconds
        row["rlimit"] += spent
        row["max_rlimit"] = max(row["max_rlimit"], spent)
        if verdict == "REFUTED":
            row["refuted"].append(brief(cfgs[i].label, cex))
        if rank[verdict] > rank[row["verdict"]]:
            row["verdict"], row["counterexample"] = verdict, {"config": cfgs[i].label, **(cex or {})}
    ordered = [rows[inv.name] for inv in INVARIANTS if inv.name in rows]
    for row in ordered:
        print(f"{row['invariant']:48} {row['verdict']:8} {row['configs']:3} configs, {len(row['refuted']):3} refuted, "
              f"{row['seconds']:7.1f} s, {row['rlimit'] / 1e6:8.1f} M units (max {row['max_rlimit'] / 1e6:.1f} M)")
        if row["counterexample"] is not None:
            print(f"    {json.dumps(row['refuted'][0] if row['refuted'] else row['counterexample'], default=str)}")
    total_s = sum(r["seconds"] for r in ordered)
    total_units = sum(r["rlimit"] for r in ordered)
    print(f"{len(results)} checks, {total_s:.1f} s of checks, {wall:.1f} s wall on {args.jobs} job(s), "
          f"{total_units / 1e9:.2f} G units")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"policy": args.policy, "rows": ordered, "checks": len(results), "seconds": total_s,
                       "wall": wall, "rlimit": total_units}, f, indent=1, default=str)
    return 0 if all(r["verdict"] in ("PROVED", "REFUTED") for r in ordered) else 1


if __name__ == "__main__":
    sys.exit(main())
