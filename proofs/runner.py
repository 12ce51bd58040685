"""Run every invariant against every policy and configuration; print the verdict table.

``make prove`` / ``kvhit prove`` / ``python -m kvhit.proofs``. Exit status 0 only if every invariant is
PROVED for ``reference``, every other verdict matches :data:`kvhit.proofs.expected.EXPECTED`, every
invariant is refuted by its known-bad variants, and no check is UNKNOWN.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import replace
from pathlib import Path

from kvhit.spec.catalogue import CATALOGUE
from kvhit.spec.domain import Mode
from kvhit.spec.policy import ALL_POLICIES, KNOWN_BAD, POLICIES, RELEASES
from kvhit.spec.sizes import derive_sizes

from . import alignment, dcp, eagle, retention, termination, validity
from .domains import SCENARIOS, configs, reference_only
from .expected import EXPECTED
from .loop import WITHIN_PASSES, check_every_run, proved_for_every_run
from .model import SAME_HIT, SAME_HIT_PREMISES, Verdict, accepts, brief, check, isolated_map

INVARIANTS = (alignment.INVARIANTS + validity.INVARIANTS + eagle.INVARIANTS + dcp.INVARIANTS
              + termination.INVARIANTS + retention.INVARIANTS)
BY_NAME = {inv.name: inv for inv in INVARIANTS}
VECTORS = Path(__file__).resolve().parent.parent / "tests" / "vectors" / "hit_tokens"

_CONFIGS = None
EXTENDED = False


# Known-bad write-side variants whose defect shows on the report's layout only with two MTP modules (measured
# on 2026-12-07: retain_prompt_end is REFUTED with two and PROVED with one).
_WITNESS_NEEDS_MTP2 = frozenset({"retain_prompt_end"})


def _write_witness(config, bad: str) -> bool:
    """Where the write side's known-bad variant ``bad`` runs by default (every catalogue layout with
    --extended): the Qwen3-Next report's layout in drop mode at vLLM's default retention 0, with one MTP
    module where that shows the defect. Non-vacuity needs one refutation: the whole stream claim's
    witness costs 2.7 s of checks there against 9.9 s with two modules (2026-12-07)."""
    return (config.layout.name == "qwen3next" and config.speculation.drop and config.retention == 0
            and config.speculation.multi_module_mtp == (bad in _WITNESS_NEEDS_MTP2))


def _configs():
    global _CONFIGS
    if _CONFIGS is None:
        _CONFIGS = configs(EXTENDED)
    return _CONFIGS


def _run_task(task):
    inv_name, policy, index, scenario = task
    invariant = BY_NAME[inv_name]
    try:
        if scenario is not None:
            sc = next(s for s in SCENARIOS if s.name == scenario)
            verdict, seconds, cex, spent = check(invariant, ALL_POLICIES[policy], sc.config, sc)
        else:
            verdict, seconds, cex, spent = check_every_run(invariant, ALL_POLICIES[policy], _configs()[index])
    except Exception as exc:  # a spec or lowering error is a failed check, reported with its cause
        return task, "ERROR", 0.0, {"error": f"{type(exc).__name__}: {exc}"}, 0
    return task, verdict, seconds, cex, spent


# Checks run in chunks of at most CHUNK configurations of one (invariant, policy) row, each chunk in a process
# of its own (:func:`kvhit.proofs.model.isolated_map`): a chunk's checks see the same history whatever ran
# elsewhere, so each check's resource count is one number per commit, and a fork costs once per chunk.
CHUNK = 8


def _run_chunk(chunk):
    return [_run_task(task) for task in chunk]


def chunks(todo) -> list:
    """``todo`` cut into the chunks that run in one process each: a row's tasks in order, CHUNK at a time
    (so a row's chunks are the same whichever other rows run)."""
    rows: dict[tuple, list] = {}
    for task in todo:
        rows.setdefault(task[:2], []).append(task)
    return [tuple(tasks[i:i + CHUNK]) for tasks in rows.values() for i in range(0, len(tasks), CHUNK)]


def tasks(only_catalogue_for_bad: bool = True):
    out = []
    cfgs = _configs()
    catalogue = set(CATALOGUE)
    for inv in INVARIANTS:
        if inv.default_only and EXTENDED:
            continue
        composed = set() if EXTENDED else {policy for policy, _ in inv.by_lemma}  # the default run composes them
        for i, config in enumerate(cfgs):
            if inv.write_side != config.write_side or not inv.applies(config):
                continue
            # a heavy configuration's claim is --extended's; a write-side one's known-bad variants still run on
            # the report's setting below (non-vacuity, whole)
            heavy = inv.heavy(config) and not EXTENDED
            if heavy and not inv.write_side:
                continue
            only_reference = reference_only(config, EXTENDED)
            for policy in () if heavy else POLICIES:
                if policy in composed or (only_reference and policy != "reference"):
                    continue
                if inv.policies is None or policy in inv.policies or (EXTENDED and policy in inv.extended_policies):
                    out.append((inv.name, policy, i, None))
            # every claim about every policy, where the release has it
            for policy in () if heavy or only_reference else RELEASES:
                if inv.policies is None and accepts(ALL_POLICIES[policy], config):
                    out.append((inv.name, policy, i, None))
            for bad in () if only_reference else inv.refuted_by:  # non-vacuity: on the other layouts
                if bad in POLICIES:
                    continue
                if only_catalogue_for_bad and config.layout.name not in catalogue:
                    continue
                if inv.write_side and not EXTENDED and not _write_witness(config, bad):
                    continue  # non-vacuity needs one refutation; the report's setting gives it
                out.append((inv.name, bad, i, None))
    for sc in SCENARIOS:
        for policy in POLICIES:
            out.append((sc.invariant, policy, None, sc.name))
        for policy in RELEASES:
            if accepts(ALL_POLICIES[policy], sc.config):
                out.append((sc.invariant, policy, None, sc.name))
    return out


ONLY: set = set()
# Relative cost of one check, measured on the default run (only the order of the work depends on it).
COST = {"reference_never_below_vllm": 6, "eagle_loses_at_most_one_block_beyond_alignment": 5,
        "vllm_0_33_cache_serves_nothing_the_policy_cache_does_not": 5,
        "a_shared_prefix_is_kept_at_the_junction": 4, "second_repeat_is_stable": 4,
        "scheduler_and_mask_boundaries_agree": 3, "hit_is_valid_in_every_group": 2}


def run(jobs: int | None = None) -> list[Verdict]:
    todo = [t for t in tasks() if not ONLY or t[0] in ONLY]
    jobs = jobs or min(os.cpu_count() or 1, 4)
    # Longest first, one chunk at a time, so no worker is left with a slow tail.
    costly = sorted(chunks(todo), key=lambda c: -COST.get(c[0][0], 1))
    results = [result for done in isolated_map(_run_chunk, costly, jobs) for result in done]
    order = {t: i for i, t in enumerate(todo)}
    results.sort(key=lambda r: order[r[0]])
    cfgs = _configs()
    verdicts = verdicts_of(results, cfgs)
    composed = compose_by_lemmas(verdicts, results, cfgs)
    if not EXTENDED:  # a composed verdict of the reference's carries over as a checked one does
        verdicts.update(compose(results + composed, cfgs))
    return list(verdicts.values())


def verdicts_of(results, cfgs) -> dict[tuple, Verdict]:
    """``{(invariant row, policy): Verdict}`` of :func:`_run_task`'s results, in their order; ``cfgs``: the
    configurations their indices name."""
    verdicts: dict[tuple, Verdict] = {}
    for (inv_name, policy, index, scenario), verdict, seconds, cex, spent in results:
        key = (inv_name if scenario is None else f"{inv_name}@{scenario}", policy)
        v = verdicts.setdefault(key, Verdict(key[0], policy, "PROVED"))
        v.seconds += seconds
        v.rlimit += spent
        v.max_rlimit = max(v.max_rlimit, spent)
        label = cfgs[index].label if scenario is None else scenario
        v.configs.append(label)
        _add(v, label, verdict, cex)
    return verdicts


# The worst verdict of a row's configurations is the row's.
RANK = {"PROVED": 0, "REFUTED": 1, "UNKNOWN": 2, "REPLAY-MISMATCH": 3, "ERROR": 4}


def _add(v: Verdict, label: str, verdict: str, cex) -> None:
    """Count one configuration's verdict into its row ``v``."""
    if RANK[verdict] > RANK[v.verdict]:
        v.verdict = verdict
        v.counterexample = cex
        v.note = label
    if verdict == "REFUTED":
        v.refuted += 1
        v.refutations.append(brief(label, cex))
    if verdict == "PROVED" and not proved_for_every_run(verdict, cex):
        v.bounded.append(f"{label}: {cex[WITHIN_PASSES]}")


def compose(results, cfgs) -> dict:
    """The verdicts the default run composes (:attr:`~kvhit.proofs.model.Invariant.by_lemma`): on each
    configuration where ``results`` hold the claim's verdict for the reference (checked, or composed by
    :func:`compose_by_lemmas`), the policy's verdict is the reference's if
    the lemma is PROVED there for the policy, and UNKNOWN (a failed run) if it is not: the composition then
    says nothing. A REFUTED verdict keeps the reference's counterexample, which the lemma makes the policy's
    too. Without its lemma's checks (``--invariant``), nothing is composed; nor on a configuration where the
    run checks only the reference (:func:`~kvhit.proofs.domains.reference_only`)."""
    by_task = {(inv, policy, index): (verdict, cex) for (inv, policy, index, scenario), verdict, _, cex, _
               in results if scenario is None}
    out = {}
    for inv in INVARIANTS:
        for policy, lemma in inv.by_lemma:
            checked = [i for (name, pol, i) in by_task if name == inv.name and pol == "reference"]
            rows = SAME_HIT_PREMISES if lemma == SAME_HIT else (lemma,)
            if not checked or not all(any(name == row for name, _, _ in by_task) for row in rows):
                continue
            v = Verdict(inv.name, policy, "PROVED", composed_from=f"reference + {lemma}")
            for i in checked:
                if reference_only(cfgs[i], EXTENDED):
                    continue  # the run says nothing of the policy there
                label = cfgs[i].label
                v.configs.append(label)
                verdict, cex = by_task[(inv.name, "reference", i)]
                why = _lemma_fails(by_task, lemma, policy, i, cfgs)
                if why:
                    verdict, cex = "UNKNOWN", {"error": why}
                _add(v, label, verdict, cex)
            out[(inv.name, policy)] = v
    return out


def _lemma_fails(by_task, lemma, policy, i, cfgs) -> str:
    """Why ``lemma`` does not hold for ``policy`` on configuration ``i`` of ``cfgs`` ('' if it holds): its row's
    verdict there, or for :data:`~kvhit.proofs.model.SAME_HIT` the first premise not PROVED for the reference
    or the policy, on the configuration or its twin without speculation (a verdict that covers vLLM's loop
    only within its unrolled passes does not count: :func:`kvhit.proofs.loop.proved_for_every_run`)."""
    if lemma != SAME_HIT:
        verdict, cex = by_task.get((lemma, policy, i), ("not checked", None))
        return "" if proved_for_every_run(verdict, cex) else f"{lemma} is {_not_every_run(verdict)} on {cfgs[i].label}"
    for j in (i, speculation_twin(cfgs[i], cfgs)):
        for premise in SAME_HIT_PREMISES:
            for who in ("reference", policy):
                verdict, cex = by_task.get((premise, who, j), ("not checked", None))
                if not proved_for_every_run(verdict, cex):
                    where = "nowhere (no twin without speculation)" if j is None else cfgs[j].label
                    return f"{SAME_HIT} needs {premise} / {who}, which is {_not_every_run(verdict)} on {where}"
    return ""


def _not_every_run(verdict: str) -> str:
    """How a verdict that a composition does not build on reads (:func:`kvhit.proofs.loop.proved_for_every_run`)."""
    return verdict if verdict != "PROVED" else "PROVED within unrolled passes only"


def speculation_twin(config, cfgs) -> int | None:
    """The index in ``cfgs`` of the read-side configuration of ``config``'s layout without speculation (None
    if there is none)."""
    for i, c in enumerate(cfgs):
        if not c.write_side and c.layout == config.layout and c.speculation.mode is Mode.NONE:
            return i
    return None


def _lookup_sizes(config):
    """What a configuration's lookups read of its sizes: all but the prefill lookahead, which only the write
    side reads (``tests/properties/test_read_twin.py``)."""
    return replace(derive_sizes(config.layout, config.speculation), prefill_lookahead=0)


def read_twin(config, cfgs) -> int | None:
    """The index in ``cfgs`` of the read-side configuration whose lookups are those of ``config`` (a
    write-side one): the same layout, the same sizes but for the prefill lookahead; None if there is none."""
    want = _lookup_sizes(config)
    for i, c in enumerate(cfgs):
        if not c.write_side and c.layout == config.layout and _lookup_sizes(c) == want:
            return i
    return None


def compose_by_lemmas(verdicts: dict, results, cfgs) -> list:
    """Compose the reference's verdict of each invariant with :attr:`~kvhit.proofs.model.Invariant.lemmas` (when
    the run judges it and ran every lemma's row) on the configurations the run checked its first lemma on
    but not the claim itself: PROVED if every lemma is PROVED there for every run of vLLM's loop (a read-side
    lemma on the configuration's :func:`read_twin`), else UNKNOWN (the composition says nothing, and the run
    fails). Where the claim was checked whole too, a composed PROVED with a whole verdict other than PROVED is
    an ERROR: the composition would be unsound. Returns each configuration's composed verdict as a result of
    :func:`_run_task` (no seconds, no units), for :func:`compose` to carry over to the policies of
    :attr:`~kvhit.proofs.model.Invariant.by_lemma`."""
    out = []
    by_task = {(inv, policy, index): (verdict, cex) for (inv, policy, index, scenario), verdict, _, cex, _
               in results if scenario is None}
    ran = {(inv, policy) for inv, policy, _ in by_task}
    for inv in INVARIANTS:
        if not inv.lemmas or (ONLY and inv.name not in ONLY) or not ran.issuperset(inv.lemmas):
            continue  # not judged in this run, or a lemma's row not run (``--invariant``): nothing composed
        first = inv.lemmas[0]
        composed = 0
        for i, config in enumerate(cfgs):
            if (first[0], first[1], i) not in by_task:
                continue
            twin = read_twin(config, cfgs)
            found = {(lemma, policy): by_task.get((lemma, policy, i if BY_NAME[lemma].write_side else twin),
                                                  ("not checked", None)) for lemma, policy in inv.lemmas}
            missing = [f"{lemma} / {policy} ({_not_every_run(verdict)})"
                       for (lemma, policy), (verdict, cex) in found.items() if not proved_for_every_run(verdict, cex)]
            whole, _ = by_task.get((inv.name, "reference", i), (None, None))
            v = verdicts.setdefault((inv.name, "reference"), Verdict(inv.name, "reference", "PROVED"))
            if whole is not None:
                if not missing and whole != "PROVED":
                    _add(v, config.label, "ERROR", {"error": f"composed PROVED, checked whole {whole}"})
                continue
            label = f"{config.label} (composed)"
            v.configs.append(label)
            composed += 1
            verdict, cex = ("UNKNOWN", {"error": f"not PROVED: {', '.join(missing)}"}) if missing else ("PROVED", None)
            _add(v, label, verdict, cex)
            out.append(((inv.name, "reference", i, None), verdict, 0.0, cex, 0))
        if composed:
            v.composed_from = f"{composed} configurations from {', '.join(name for name, _ in inv.lemmas)}"
    return out


def judge(verdicts: list[Verdict]) -> list[str]:
    """Why the run fails (empty if it passes)."""
    problems = []
    seen = {(v.invariant, v.policy): v for v in verdicts}
    for v in verdicts:
        if v.verdict in ("UNKNOWN", "REPLAY-MISMATCH", "ERROR"):
            problems.append(f"{v.invariant} / {v.policy}: {v.verdict} ({v.note})")
            continue
        expected = EXPECTED.get((v.invariant, v.policy), ("REFUTED" if v.policy in KNOWN_BAD else "PROVED",))[0]
        if v.verdict != expected:
            problems.append(f"{v.invariant} / {v.policy}: {v.verdict}, expected {expected} "
                            "(update proofs/expected.py only with a reviewed reason)")
    for inv in INVARIANTS:
        if (ONLY and inv.name not in ONLY) or not any(v.invariant == inv.name for v in verdicts):
            continue  # not run (every configuration of it is --extended)
        if not any(seen.get((inv.name, bad)) and seen[(inv.name, bad)].verdict == "REFUTED"
                   for bad in inv.refuted_by):
            problems.append(f"{inv.name}: no known-bad variant refutes it (vacuity not excluded)")
    return problems


def _summary(cex: dict | None) -> str:
    if not cex or "N" not in cex:
        return ""
    shown = ", ".join(f"{k}={v}" for k, v in cex["replayed"].items())
    where = f"{cex['layout']}{' dcp' + str(cex['dcp']) if cex['dcp'] > 1 else ''} [{cex['speculation']}]"
    if "repeat_hits" in cex:
        repeats = "; ".join(f"{p} {h}" for p, h in cex["repeat_hits"].items())
        return f"{where} R={cex['retention']} N={cex['N']}: {shown}; repeats: {repeats}"
    return f"{where} N={cex['N']}: {shown}; reference hit={cex['reference_hit']}"


def findings(verdicts: list[Verdict]) -> str:
    """The expected divergences, with the reason and the counterexample found."""
    lines = ["Expected divergences (proofs/expected.py):"]
    for v in verdicts:
        entry = EXPECTED.get((v.invariant, v.policy))
        if entry and v.policy not in KNOWN_BAD:
            cex = v.counterexample or {}
            lines.append(f"  {v.invariant} / {v.policy}: {entry[1]}\n      {_summary(cex)}")
            if len(v.refutations) > 1:
                lines.append(f"      refuted on {len(v.refutations)} configurations (each in --json): "
                             + "; ".join(f"{r['config']} N={r['N']}" for r in v.refutations))
            if "repeat_hits" in cex:
                lines.append("      cache: what one request with that prompt left under each policy's write side")
                lines.append(f"      first three repeats replayed through refimpl: {cex['repeat_hits']}")
                continue
            lines.append(f"      cache (runs of cached blocks per spec group and unit): {_cache(cex)}")
            lines.append(f"      hits replayed through refimpl: {cex.get('hits')}")
    return "\n".join(lines)


def _cache(cex: dict) -> str:
    parts = []
    for group, lists in sorted((cex.get("cache") or {}).items()):
        for item in lists:
            spans = " ".join(f"[{s},{e})" for s, e in item["blocks"]) or "-"
            parts.append(f"g{group}/u{item['unit']}: {spans}")
    return "; ".join(parts) or "empty"


def table(verdicts: list[Verdict]) -> str:
    lines = [f"{'invariant':58} {'policy':24} {'verdict':9} {'configs':>7} {'seconds':>8} {'rlimit M':>8}  "
             "counterexample", "-" * 160]
    for v in verdicts:
        count = f"{v.refuted}/{len(v.configs)}" if v.verdict == "REFUTED" else str(len(v.configs))
        composed = f"(composed: {v.composed_from}) " if v.composed_from else ""
        if v.verdict == "PROVED" and v.bounded:  # kvhit.proofs.loop
            composed += f"({len(v.bounded)} for vLLM's loop within its unrolled passes only) "
        lines.append(f"{v.invariant:58} {v.policy:24} {v.verdict:9} {count:>7} {v.seconds:8.2f} "
                     f"{v.rlimit / 1e6:8.1f}  {composed}"
                     f"{_summary(v.counterexample) if v.verdict == 'REFUTED' else v.note if v.verdict != 'PROVED' else ''}")
    return "\n".join(lines)


def write_vectors(verdicts: list[Verdict]) -> int:
    VECTORS.mkdir(parents=True, exist_ok=True)
    n = 0
    for v in verdicts:
        if v.verdict == "REFUTED" and v.counterexample and "N" in v.counterexample:
            name = f"{v.invariant.replace('@', '__')}__{v.policy}.json"
            record = {"invariant": v.invariant.split("@")[0], "invariant_row": v.invariant, "policy": v.policy,
                      **v.counterexample}
            (VECTORS / name).write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")
            n += 1
    return n


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="kvhit prove", description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print the verdicts as JSON")
    parser.add_argument("--jobs", type=int, default=None, help="worker processes (default: CPUs)")
    parser.add_argument("--extended", action="store_true",
                        help="also check vLLM's policies and the write side on the HEAVY layouts (three or more spec "
                             "groups; their reference read side is in the default run), DCP 3..7 and the write side "
                             "beyond the default's (slow: 12,622 checks; a run did not finish in 40 min on 2 cores)")
    parser.add_argument("--write-vectors", action="store_true",
                        help="save each REFUTED counterexample under tests/vectors/hit_tokens/")
    parser.add_argument("--findings", action="store_true",
                        help="attribute every configuration vllm_0_33 fails to a defect: the smallest set of "
                             "repairs (kvhit.spec.policy.REPAIRS) that proves it, with the smallest counterexample "
                             "(with --json: an object of 'verdicts' and 'defects')")
    parser.add_argument("--invariant", action="append", default=[], metavar="NAME",
                        help="check only this invariant (repeatable); the run then judges only those")
    args = parser.parse_args(argv)
    global EXTENDED
    EXTENDED = args.extended
    unknown = [name for name in args.invariant if name not in BY_NAME]
    if unknown:
        parser.error(f"unknown invariant {', '.join(unknown)}; known: {', '.join(sorted(BY_NAME))}")
    ONLY.update(args.invariant)
    start = time.perf_counter()
    verdicts = run(args.jobs)
    problems = judge(verdicts)
    defects = unattributed = None
    if args.findings:
        from . import findings as attribution

        defects, unattributed = attribution.attribute(verdicts, BY_NAME, _configs(), SCENARIOS, args.jobs)
        problems += [f"{inv} / vllm_0_33 on {label} (N={n}): no set of repairs proves it"
                     for inv, label, n in unattributed]
    if args.json:
        rows = [v.as_json() for v in verdicts]
        print(json.dumps(rows if defects is None else {"verdicts": rows, "defects": [d.as_json() for d in defects]},
                         indent=1))
    else:
        print(table(verdicts))
        print("\n" + findings(verdicts))
        if defects is not None:
            print("\n" + attribution.table(defects, unattributed))
        checks = sum(len(v.configs) for v in verdicts)
        print(f"\n{len(_configs())} configurations, {len(verdicts)} verdicts of {checks} checks, "
              f"{time.perf_counter() - start:.1f} s wall, {sum(v.seconds for v in verdicts):.1f} s of checks, "
              f"rlimit {sum(v.rlimit for v in verdicts) / 1e6:.1f} M (largest check "
              f"{max((v.max_rlimit for v in verdicts), default=0) / 1e6:.1f} M)")
    if args.write_vectors:
        print(f"wrote {write_vectors(verdicts)} counterexample vectors to {VECTORS}", file=sys.stderr)
    if problems:
        print("\nFAILED:\n  " + "\n  ".join(problems), file=sys.stderr)
        return 1
    print("OK: every invariant PROVED for reference; every other verdict as expected", file=sys.stderr)
    return 0
