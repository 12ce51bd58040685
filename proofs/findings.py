"""Every refuted check of vLLM 0.33, attributed to a defect: the smallest set of repairs that proves it.

A *repair* (:data:`kvhit.spec.policy.REPAIRS`) changes one rule of vLLM 0.33's algorithm the way a small
upstream patch would. For every (invariant, configuration) that ``vllm_0_33`` fails, the repair sets are
tried smallest first: the first size at which some set makes the same check PROVED gives the defect's
repairs (every set of that size that does, so that a tie is shown rather than hidden). Checks with the same
repair sets are one defect, whatever the invariant: one root cause, one patch. A check no set of repairs
proves is reported as unattributed, and fails ``kvhit prove --findings``.

Each defect's smallest counterexample minimises the prompt length ``N`` (a binary search of bounded
checks, each decided under the same resource limits as the proofs, so the answer does not depend on the
machine) on the defect's configuration whose counterexample is shortest.
"""

from __future__ import annotations

import multiprocessing
import os
from dataclasses import dataclass, field
from itertools import combinations

from kvhit.spec.policy import REPAIRS, VLLM_0_33, repaired

from .model import Config, check


@dataclass
class Defect:
    """One distinct defect of vLLM 0.33: the repairs that remove it and every check it fails."""

    repairs: tuple  # the minimal repair sets: a tuple of tuples of repair names
    checks: list = field(default_factory=list)  # (invariant row, config label, N)
    smallest: dict | None = None

    @property
    def id(self) -> str:
        """The findings the repairs name (docs/findings.md's headings), e.g. ``F2`` or ``F5+W``."""
        return " | ".join("+".join(REPAIRS[r].finding for r in s) for s in self.repairs)

    def as_json(self) -> dict:
        first = self.repairs[0]
        return {"id": self.id, "repairs": [list(s) for s in self.repairs],
                "vllm": [REPAIRS[r].vllm for r in first],
                "invariants": sorted({inv for inv, _, _ in self.checks}),
                "layouts": sorted({label.split()[0] for _, label, _ in self.checks}),
                "modes": sorted({_mode(label) for _, label, _ in self.checks}),
                "configs": [f"{inv} / {label}" for inv, label, _ in self.checks],
                "smallest": self.smallest}


def _mode(label: str) -> str:
    words = label.split()
    words = [w for w in words[1:] if not w.startswith(("dcp", "R="))]
    return " ".join(words)


def minimal_repairs(invariant, target, scenario=None) -> tuple:
    """Every smallest set of repairs under which ``invariant`` is PROVED on ``target`` (a configuration,
    or the scenario's); ``()`` if none is."""
    names = tuple(REPAIRS)
    for size in range(1, len(names) + 1):
        found = tuple(combo for combo in combinations(names, size)
                      if check(invariant, repaired(combo), target, scenario)[0] == "PROVED")
        if found:
            return found
    return ()


_WORK = {}  # what the forked workers read: the invariants, the targets


def _attribute_one(key):
    invariant, target, scenario = _WORK[key]
    return key, minimal_repairs(invariant, target, scenario)


def _smallest_one(key):
    invariant, config, n = _WORK[key]
    return key, smallest_counterexample(invariant, config, n)


def _map(fn, keys, jobs):
    if jobs <= 1 or len(keys) <= 1:
        return dict(map(fn, keys))
    with multiprocessing.get_context("fork").Pool(min(jobs, len(keys))) as pool:
        return dict(pool.imap_unordered(fn, keys, chunksize=1))


def smallest_counterexample(invariant, config: Config, n_tokens: int) -> dict:
    """The counterexample of ``vllm_0_33`` with the least ``N`` (binary search below a known one)."""
    lo, hi = 1, n_tokens
    best = None
    while lo <= hi:
        mid = (lo + hi) // 2
        verdict, _, cex, _ = check(invariant, VLLM_0_33, config, max_n=mid)
        if verdict == "REFUTED":
            best, hi = cex, cex["N"] - 1
        else:
            lo = mid + 1
    if best is None:  # cannot happen for a refuted check; guard against a solver that disagrees with itself
        raise RuntimeError(f"{invariant.name} / {config.label}: no counterexample with N <= {n_tokens}")
    return best


def attribute(verdicts, invariants: dict, configs: list, scenarios: tuple, jobs: int | None = None):
    """``(defects, unattributed)`` of every configuration ``vllm_0_33`` fails in ``verdicts`` (``jobs``
    worker processes, by default the CPUs)."""
    jobs = jobs or min(os.cpu_count() or 1, 4)
    by_label = {c.label: c for c in configs}
    by_scenario = {s.name: s for s in scenarios}
    refuted = []
    for v in verdicts:
        if v.policy != VLLM_0_33.name or v.verdict != "REFUTED":
            continue
        name, _, at = v.invariant.partition("@")
        for r in v.refutations:
            scenario = by_scenario.get(at) if at else None
            target = scenario.config if scenario else by_label[r["config"]]
            key = (v.invariant, r["config"])
            _WORK[key] = (invariants[name], target, scenario)
            refuted.append((key, r["N"], scenario is not None))
    sets_of = _map(_attribute_one, [key for key, _, _ in refuted], jobs)
    defects: dict[tuple, Defect] = {}
    unattributed = []
    for (inv_row, label), n, pinned in refuted:
        sets = sets_of[(inv_row, label)]
        if not sets:
            unattributed.append((inv_row, label, n))
            continue
        defects.setdefault(sets, Defect(sets)).checks.append((inv_row, label, n, pinned))
    # each defect's shortest counterexample among its configurations, minimised (a scenario pins its N)
    firsts = {d.repairs: min(d.checks, key=lambda c: (c[2], c[0], c[1])) for d in defects.values()}
    to_minimise = []
    for sets, (inv_row, label, n, pinned) in firsts.items():
        if not pinned:
            _WORK[("min",) + sets] = (invariants[inv_row.partition("@")[0]], by_label[label], n)
            to_minimise.append(("min",) + sets)
    smallest = _map(_smallest_one, to_minimise, jobs)
    for d in defects.values():
        inv_row, label, n, pinned = firsts[d.repairs]
        cex = smallest.get(("min",) + d.repairs)
        d.smallest = {"invariant": inv_row, "config": label, "N": n} if cex is None else _describe(inv_row, label, cex)
        d.checks = [(i, l, m) for i, l, m, _ in d.checks]
    _WORK.clear()
    return sorted(defects.values(), key=lambda d: d.id), unattributed


def _describe(inv_row: str, label: str, cex: dict) -> dict:
    out = {"invariant": inv_row, "config": label, "N": cex["N"], "witnesses": cex["witnesses"],
           "cache": cex["cache"], "shown": cex["replayed"]}
    if "repeat_hits" in cex:
        hits = cex["repeat_hits"]
        out["first_repeat"] = {p: h[0] for p, h in hits.items()}
        out["tokens_lost_per_repeat"] = hits["vllm_0_33_repaired"][0] - hits["vllm_0_33"][0]
    else:
        out["hits"] = cex["hits"]
        out["tokens_lost_per_repeat"] = cex["hits"]["vllm_0_33_repaired"] - cex["hits"]["vllm_0_33"]
    return out


def table(defects, unattributed) -> str:
    lines = ["Defects of vllm_0_33 (each: the smallest set of repairs that proves every check it fails):",
             f"{'id':8} {'repairs':44} {'checks':>6}  smallest counterexample"]
    for d in defects:
        s = d.smallest
        hits = s.get("hits") or s.get("first_repeat") or {}
        shown = (f"vllm_0_33 {hits.get('vllm_0_33')}, repaired {hits.get('vllm_0_33_repaired')}, "
                 f"reference {hits.get('reference')}, lost {s.get('tokens_lost_per_repeat')}") if hits else ""
        lines.append(f"{d.id:8} {' | '.join('+'.join(x) for x in d.repairs):44} {len(d.checks):>6}  "
                     f"{s['invariant']} on {s['config']} N={s['N']}: {shown}")
        lines.append(f"{'':8} changes {'; '.join(REPAIRS[r].vllm for r in d.repairs[0])}")
        lines.append(f"{'':8} invariants: {', '.join(sorted({c[0] for c in d.checks}))}")
        lines.append(f"{'':8} layouts: {', '.join(sorted({c[1].split()[0] for c in d.checks}))}")
    for inv, label, n in unattributed:
        lines.append(f"UNATTRIBUTED {inv} / {label} N={n}: no set of repairs proves it")
    return "\n".join(lines)
