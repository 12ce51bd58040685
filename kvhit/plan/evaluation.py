"""Each setting's cached tokens, retained states and reads past the hashes over a workload, every hit the
refimpl's; the staged evaluation ``kvhit plan`` runs and the ranking."""

import concurrent.futures
import multiprocessing
import os

from kvhit import refimpl
from kvhit.dense import DenseCache
from kvhit.written import WrittenCache, first_writes, replay_boundaries

from .settings import with_retention

POLICIES = ("reference", "vllm_0_33", "historical")


def _writes(setting, p, rules, boundaries=None):
    """``refimpl.request_writes`` of the earlier ``P``-token request (``kvhit.written.first_writes``)."""
    return first_writes(setting.sizes, p, setting.retention, rules, boundaries)


def hit_of(setting, n, p, policy, writes=None):
    """The refimpl's hit and reach for one request under one setting and policy: on what the earlier
    ``P``-token request left (``writes``, computed when not given), or on the dense cache."""
    rules = refimpl.policy_rules(policy)
    if p == 0:
        cache = DenseCache((0,) * len(setting.sizes.groups))
    elif setting.retention == "dense":
        cache = DenseCache((p,) * len(setting.sizes.groups))
    else:
        cache = WrittenCache(_writes(setting, p, rules) if writes is None else writes)
    hit, reach, _, _ = refimpl.hit_tokens(cache, setting.sizes, n, rules)
    return hit, reach


def retained_of(writes):
    """Retained states of a written cache: ``refimpl.retained_states`` over its sliding-window and Mamba
    groups."""
    return sum(refimpl.retained_states(g) for g in writes if g.kind.value in ("swa", "mamba"))


def by_prefix(workload):
    """The workload's distinct requests grouped by ``P``: ``[(P, ((N, count), ...)), ...]``, ``P``
    ascending, each ``N`` once with how often it occurs."""
    counts = {}
    for n, p in workload:
        counts.setdefault(p, {})
        counts[p][n] = counts[p].get(n, 0) + 1
    return [(p, tuple(sorted(counts[p].items()))) for p in sorted(counts)]


def _evaluate_part(s, policy, part, replay, count_states=True):
    """``(cached tokens, requests reading past |H|, retained states)`` summed over the requests of ``part``
    (a slice of :func:`by_prefix`) under one setting and policy (retained states 0 unless
    ``count_states``); ``replay`` (``{P: replay boundaries}`` of the setting's sizes and policy) is used and
    filled."""
    rules = refimpl.policy_rules(policy)
    total = past = states = 0
    for p, ns in part:
        writes, kept = None, 0
        if s.retention != "dense" and p > 0:
            if p not in replay:
                replay[p] = replay_boundaries(s.sizes, p, rules)
            writes = _writes(s, p, rules, replay[p])
            kept = retained_of(writes) if count_states else 0
        for n, count in ns:
            hit, reach = hit_of(s, n, p, policy, writes)
            total += count * hit
            past += count * (reach > refimpl.hash_reach(s.sizes, n))
            states += count * kept
    return total, past, states


_shared = {}  # what forked workers read: the settings and the grouped workload (inherited, not pickled)


def _evaluate_task(i, policy, lo, hi, replay, count_states):
    part = _shared["groups"][lo:hi]
    return _evaluate_part(_shared["settings"][i], policy, part, replay, count_states), replay


PARALLEL_MIN_WORK = 20_000
"""Settings x policies x distinct requests below which ``evaluate`` stays in one process (forking costs
more than it saves)."""


def default_jobs():
    """Worker processes ``evaluate`` uses by default: the CPUs this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def evaluate(cands, workload, settings=None, jobs=None, policies=POLICIES, count_states=True):
    """Fill in each setting's expected cached tokens and retained states per request, per policy
    (``settings``: only these, default all; ``policies``: only these, default all three; retained states
    only with ``count_states``). Work is done once per distinct ``P`` (what the earlier request left, and
    its retained states) and once per distinct ``(N, P)`` (the hit).

    Each (setting, policy) is independent, and so is each range of ``P``: with ``jobs`` > 1 (default:
    :func:`default_jobs`, when the work is large enough) the (setting, policy, range of ``P``) tasks run in
    that many forked worker processes, enough tasks per worker that none waits long for the last one.
    Results are the same numbers either way (integer sums of pure functions of the setting and the
    workload, divided at the end)."""
    settings = cands.settings if settings is None else settings
    groups = by_prefix(workload)
    unknown = [p for p in policies if p not in POLICIES]
    if unknown:
        raise ValueError(f"unknown policy {unknown[0]!r} (known: {', '.join(POLICIES)})")
    pairs = [(i, policy) for i in range(len(settings)) for policy in policies]
    jobs = default_jobs() if jobs is None else jobs
    if jobs < 1:
        raise ValueError(f"jobs must be at least 1, got {jobs}")
    distinct = sum(len(ns) for _, ns in groups)
    sums = {pair: [0, 0, 0] for pair in pairs}
    if jobs == 1 or len(pairs) * distinct < PARALLEL_MIN_WORK or "fork" not in multiprocessing.get_all_start_methods():
        for i, policy in pairs:
            replay = cands.replay.setdefault((settings[i].sizes, policy), {})
            sums[i, policy] = list(_evaluate_part(settings[i], policy, groups, replay, count_states))
    else:
        pieces = -(-8 * jobs // len(pairs))  # ranges of P per (setting, policy): 8 tasks per worker or more
        bounds = [len(groups) * j // pieces for j in range(pieces + 1)]
        tasks = [(i, policy, lo, hi) for i, policy in pairs for lo, hi in zip(bounds, bounds[1:]) if lo < hi]
        _shared.update(settings=settings, groups=groups)
        try:
            context = multiprocessing.get_context("fork")
            with concurrent.futures.ProcessPoolExecutor(min(jobs, len(tasks)), mp_context=context) as pool:
                futures = []
                for i, policy, lo, hi in tasks:
                    known = cands.replay.get((settings[i].sizes, policy), {})
                    futures.append(pool.submit(_evaluate_task, i, policy, lo, hi,
                                               {p: known[p] for p, _ in groups[lo:hi] if p in known},
                                               count_states))
                for (i, policy, _, _), future in zip(tasks, futures):
                    numbers, replay = future.result()
                    sums[i, policy] = [a + b for a, b in zip(sums[i, policy], numbers)]
                    cands.replay.setdefault((settings[i].sizes, policy), {}).update(replay)
        finally:
            _shared.clear()
    for (i, policy), (total, past, states) in sums.items():
        s = settings[i]
        s.mean[policy], s.past_hashes[policy] = total / len(workload), past
        if count_states:
            s.states[policy] = states / len(workload)
    return cands


def plan_settings(cands, workload, by, retention_top, explicit=False, shown=None, jobs=None):
    """What ``kvhit plan`` evaluates, in stages: every setting under policy ``by``; the best
    ``retention_top`` of them at the other retention intervals (:func:`with_retention`), under ``by``; then
    the other two policies for the ``shown`` best settings only (None: every setting), the ones a table
    prints, and their retained states only when every setting is wanted (a table shows states under
    ``by``). Returns :func:`rank` by ``by``; a setting past ``shown`` has numbers for ``by`` only. The
    ranking and every number printed are those of evaluating everything (the stages skip only numbers
    nobody reads)."""
    if shown is not None and shown < 1:
        raise ValueError(f"--top must be positive, got {shown}")
    if retention_top < 0:
        raise ValueError(f"--retention-top must be 0 or more, got {retention_top}")
    evaluate(cands, workload, jobs=jobs, policies=(by,))
    if cands.intervals:
        added = with_retention(cands, rank(cands, by)[0], retention_top, explicit=explicit)
        evaluate(cands, workload, added, jobs=jobs, policies=(by,))
    ranked = rank(cands, by)
    rest = tuple(p for p in POLICIES if p != by)
    evaluate(cands, workload, ranked[0] if shown is None else ranked[0][:shown], jobs=jobs, policies=rest,
             count_states=shown is None)
    return ranked


def rank(cands, by):
    """Settings, best first under policy ``by``; ties go to fewer retained states (memory), then to the
    larger hash unit (fewer hashes to compute), then to the order they were listed in."""
    order = sorted(range(len(cands.settings)),
                   key=lambda i: (-cands.settings[i].mean[by], cands.settings[i].states.get(by, 0),
                                  -cands.settings[i].sizes.hash_block, i))
    return [cands.settings[i] for i in order], cands.rejected
