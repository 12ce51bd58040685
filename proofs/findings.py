"""Every refuted check of vLLM 0.33, attributed to a defect: the smallest set of repairs that proves it.

A *repair* (:data:`kvhit.spec.policy.REPAIRS`) changes one rule of vLLM 0.33's algorithm the way a small
upstream patch would. For every (invariant, configuration) that ``vllm_0_33`` fails, the repair sets are
tried smallest first: the first size at which some set makes the same check PROVED gives the defect's
repairs (every set of that size that does, so that a tie is shown rather than hidden). Checks with the same
repair sets are one defect, whatever the invariant: one root cause, one patch. A check no set of repairs
proves is reported as unattributed, and fails ``kvhit prove --findings``.

Each defect's smallest counterexample has the least prompt length ``N`` over all its configurations (a
binary search of bounded checks per configuration, below the best found so far; ties go to the first
label); at that ``N``, on the read side, the cache holds the fewest blocks any counterexample's does (a
binary search of bounded checks on the count). Each bounded check is a verdict decided under the proofs'
resource limits, so the least ``N``, the configuration and the number of cached blocks shown do not depend
on the machine or on the order the work ran in (which blocks they are is the solver's model).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from itertools import combinations

from kvhit.spec.policy import REPAIRS, VLLM_0_33, repaired

from .model import Config, check, isolated_map


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
        found = []
        for combo in combinations(names, size):
            verdict = check(invariant, repaired(combo), target, scenario)[0]
            if verdict not in ("PROVED", "REFUTED"):  # an undecided check must not move the attribution
                raise RuntimeError(f"{invariant.name} / {target.label} under {'+'.join(combo)}: {verdict}")
            if verdict == "PROVED":
                found.append(combo)
        if found:
            return tuple(found)
    return ()


_WORK = {}  # what the forked workers read: the invariants, the targets


def _attribute_one(key):
    invariant, target, scenario = _WORK[key]
    return key, minimal_repairs(invariant, target, scenario)


def _smallest_one(key):
    """``(N, label, invariant row, cex)`` of the least counterexample over the defect's configurations."""
    best = None
    for invariant, config, n, label, inv_row in sorted(_WORK[key], key=lambda c: (c[2], c[3], c[4])):
        cex = smallest_counterexample(invariant, config, n if best is None else min(n, best[0]))
        if cex is not None and (best is None or (cex["N"], label, inv_row) < best[:3]):
            best = (cex["N"], label, inv_row, cex, invariant, config)
    if best is None:
        return key, None
    n, label, inv_row, cex, invariant, config = best
    return key, (n, label, inv_row, smallest_cache(invariant, config, cex))


def _map(fn, keys, jobs):
    return dict(isolated_map(fn, keys, jobs))


def smallest_counterexample(invariant, config: Config, bound: int) -> dict | None:
    """The counterexample of ``vllm_0_33`` with the least ``N``, if one has ``N <= bound`` (binary search)."""
    lo, hi = 1, bound
    best = None
    while lo <= hi:
        mid = (lo + hi) // 2
        verdict, _, cex, _ = check(invariant, VLLM_0_33, config, max_n=mid)
        if verdict == "REFUTED":
            best, hi = cex, cex["N"] - 1
        elif verdict == "PROVED":
            lo = mid + 1
        else:
            raise RuntimeError(f"{invariant.name} / {config.label}, N <= {mid}: {verdict}")
    return best


def cached_blocks(cex: dict) -> int:
    """How many blocks a counterexample's arbitrary cache holds (0 on the write side, whose caches the
    request builds)."""
    return sum(e - s for lists in cex["cache"].values() for item in lists for s, e in item["blocks"])


def smallest_cache(invariant, config: Config, cex: dict) -> dict:
    """A counterexample at ``cex``'s prompt length (the least one) whose cache holds the fewest blocks
    (binary search on the count; ``cex`` itself on the write side)."""
    if config.write_side:
        return cex
    lo, hi, best = 0, cached_blocks(cex) - 1, cex
    while lo <= hi:
        mid = (lo + hi) // 2
        verdict, _, found, _ = check(invariant, VLLM_0_33, config, max_n=cex["N"], max_blocks=mid)
        if verdict == "REFUTED":
            best, hi = found, cached_blocks(found) - 1
        elif verdict == "PROVED":
            lo = mid + 1
        else:
            raise RuntimeError(f"{invariant.name} / {config.label}, N = {cex['N']}, <= {mid} blocks: {verdict}")
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
            refuted.append((key, r["N"]))
    sets_of = _map(_attribute_one, [key for key, _ in refuted], jobs)
    defects: dict[tuple, Defect] = {}
    unattributed = []
    for (inv_row, label), n in refuted:
        sets = sets_of[(inv_row, label)]
        if not sets:
            unattributed.append((inv_row, label, n))
            continue
        defects.setdefault(sets, Defect(sets)).checks.append((inv_row, label, n))
    # each defect's least counterexample over its configurations; a scenario (``invariant@scenario``) pins
    # its N, and is shown as it is when the defect has nothing else
    to_minimise = []
    for d in defects.values():
        free = [(invariants[i], by_label[l], n, l, i) for i, l, n in d.checks if "@" not in i]
        if free:
            _WORK[("min",) + d.repairs] = free
            to_minimise.append(("min",) + d.repairs)
    smallest = _map(_smallest_one, to_minimise, jobs)
    for d in defects.values():
        found = smallest.get(("min",) + d.repairs)
        if found is None:
            inv_row, label, n = min(d.checks, key=lambda c: (c[2], c[1], c[0]))
            d.smallest = {"invariant": inv_row, "config": label, "N": n}
        else:
            _, label, inv_row, cex = found
            d.smallest = _describe(inv_row, label, cex)
    _WORK.clear()
    return sorted(defects.values(), key=lambda d: d.id), unattributed


def _describe(inv_row: str, label: str, cex: dict) -> dict:
    """The counterexample as the defect table shows it. ``tokens_lost_per_repeat``: on the read side what the
    repaired policy hits beyond vLLM 0.33 on the same cache (``unsound_tokens`` instead where vLLM hits more
    than can be served: F1 reads past the hashes); on the write side what the claim shows the later request
    losing against a cache with every state retained (its resend or its sibling, whichever loses more)."""
    out = {"invariant": inv_row, "config": label, "N": cex["N"], "witnesses": cex["witnesses"],
           "cache": cex["cache"], "cached_blocks": cached_blocks(cex), "shown": cex["replayed"]}
    if "repeat_hits" in cex:
        shown = cex["replayed"]
        out["first_repeat"] = {p: h[0] for p, h in cex["repeat_hits"].items()}
        pairs = (("resume_point", "first_repeat_hit"), ("sibling_hit_dense", "sibling_hit"))
        losses = [shown[a] - shown[b] for a, b in pairs if a in shown and b in shown]
        out["tokens_lost_per_repeat"] = max(losses) if losses else (out["first_repeat"]["vllm_0_33_repaired"]
                                                                   - out["first_repeat"]["vllm_0_33"])
    else:
        out["hits"] = cex["hits"]
        gain = cex["hits"]["vllm_0_33_repaired"] - cex["hits"]["vllm_0_33"]
        out["tokens_lost_per_repeat"] = max(gain, 0)
        if gain < 0:
            out["unsound_tokens"] = -gain
        shown = cex["replayed"]
        if "reach" in shown and "hash_reach" in shown and shown["reach"] > shown["hash_reach"]:
            out["reads_past_hashes"] = {"reach": shown["reach"], "hash_reach": shown["hash_reach"]}
    return out


def _cache_text(smallest: dict) -> str:
    """The read-side cache of a smallest counterexample, e.g. `` (cache: 1 block: group 0 [0, 1) of 16)``."""
    if "hits" not in smallest or "cache" not in smallest:
        return ""
    runs = [f"group {k} [{s}, {e}) of {item['unit']}" for k, lists in smallest["cache"].items() for item in lists
            for s, e in item["blocks"]]
    count = smallest["cached_blocks"]
    return f" (cache: {count} block{'s' if count != 1 else ''}{': ' if runs else ''}{', '.join(runs)})"


def table(defects, unattributed) -> str:
    lines = ["Defects of vllm_0_33 (each: the smallest set of repairs that proves every check it fails):",
             f"{'id':8} {'repairs':44} {'checks':>6}  smallest counterexample"]
    for d in defects:
        s = d.smallest
        hits = s.get("hits") or s.get("first_repeat") or {}
        lost = (f"{s['unsound_tokens']} tokens unsound" if s.get("unsound_tokens")
                else f"lost {s.get('tokens_lost_per_repeat')}")
        if s.get("reads_past_hashes"):
            past = s["reads_past_hashes"]
            lost += f"; reads boundary {past['reach']}, past the hashes' {past['hash_reach']} (IndexError in vLLM)"
        if "first_repeat" in s:
            lost += " by the resend or the sibling against every state retained"
        what = "first repeat: " if "first_repeat" in s else ""
        shown = (f"{what}vllm_0_33 {hits.get('vllm_0_33')}, repaired {hits.get('vllm_0_33_repaired')}, "
                 f"reference {hits.get('reference')}; {lost}") if hits else ""
        lines.append(f"{d.id:8} {' | '.join('+'.join(x) for x in d.repairs):44} {len(d.checks):>6}  "
                     f"{s['invariant']} on {s['config']} N={s['N']}{_cache_text(s)}: {shown}")
        lines.append(f"{'':8} changes {'; '.join(REPAIRS[r].vllm for r in d.repairs[0])}")
        lines.append(f"{'':8} invariants: {', '.join(sorted({c[0] for c in d.checks}))}")
        lines.append(f"{'':8} layouts: {', '.join(sorted({c[1].split()[0] for c in d.checks}))}")
    for inv, label, n in unattributed:
        lines.append(f"UNATTRIBUTED {inv} / {label} N={n}: no set of repairs proves it")
    return "\n".join(lines)
