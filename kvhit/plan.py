"""``kvhit plan``: rank the settings an operator controls by the cached tokens a workload gets.

A workload is a list of requests ``(N, P)``: ``N`` prompt tokens of which the first ``P`` were the whole
prompt of an earlier request on an empty cache (``P = N`` is the first repeat of that prompt, ``N > P`` a
longer sibling). The cache the request reads is what that earlier request left: the generated refimpl's
``request_writes`` under each policy's write side and the setting's retention interval, read through
``written_cache``; each hit is ``hit_tokens``. (``kvhit.written`` gives the same writes and the same
answers faster; its tests check it against those.) ``cache="dense"`` keeps the read side's assumption instead
(every state of the ``P`` tokens retained; ``kvhit.dense.DenseCache``).

A setting is what an operator can change without changing the model: ``--block-size`` for the groups that
follow it, ``prefix_match_unit``, lookahead versus drop for EAGLE/MTP, and the retention interval (None, 0
or a multiple of the scheduler block). Its memory cost is the retained-state count: ``retained_states``
of what the earlier request left, summed over the sliding-window and Mamba groups (Mamba states plus
sliding-window blocks), per request on average. Each setting costs a write side per distinct ``P`` and a
read per distinct ``(N, P)``, so every setting is first evaluated at vLLM's default retention interval 0
and the other intervals only for the best few (``retention_top``), both under the policy the ranking uses,
and the other two policies only for the settings a table prints (:func:`plan_settings`); on a large
workload the (setting, policy, range of ``P``) tasks run in forked worker processes (``evaluate``'s
``jobs``).
"""

import concurrent.futures
import math
import multiprocessing
import os
import random
from dataclasses import dataclass, field
from pathlib import Path

from kvhit import refimpl
from kvhit.dense import DenseCache
from kvhit.layouts import LayoutError, configure
from kvhit.refimpl import Mode, Speculation
from kvhit.written import WrittenCache, first_writes, replay_boundaries

POLICIES = ("reference", "vllm_0_33", "historical")


# --------------------------------------------------------------------------------------------------
# workloads
# --------------------------------------------------------------------------------------------------

def read_workload(path):
    """Requests from a file: one per line, ``N`` (a repeat: ``P = N``) or ``N P``; ``#`` starts a comment."""
    requests = []
    try:
        text = Path(path).read_text()
    except OSError as e:
        raise ValueError(f"{path}: cannot read: {e.strerror}") from None
    for number, line in enumerate(text.splitlines(), 1):
        fields = line.split("#", 1)[0].split()
        if not fields:
            continue
        where = f"{path}:{number}"
        if len(fields) > 2:
            raise ValueError(f"{where}: expected 'N' or 'N P', got {line.strip()!r}")
        try:
            values = [int(f) for f in fields]
        except ValueError:
            raise ValueError(f"{where}: expected integers, got {line.strip()!r}") from None
        n, p = values[0], values[-1]
        if n < 1:
            raise ValueError(f"{where}: a prompt needs at least one token, got {n}")
        if not 0 <= p <= n:
            raise ValueError(f"{where}: the cached prefix {p} must be between 0 and the prompt length {n}")
        requests.append((n, p))
    if not requests:
        raise ValueError(f"{path}: no requests")
    return requests


def parse_distribution(text, what):
    """A sampler ``rng -> int`` from ``fixed:X``, ``uniform:LO:HI``, ``normal:MEAN:SD``,
    ``lognormal:MEDIAN:SIGMA`` or ``choice:A,B,...``."""
    name, _, rest = text.partition(":")
    args = rest.split(":") if rest else []
    try:
        if name == "fixed" and len(args) == 1:
            x = int(args[0])
            return lambda rng: x
        if name == "uniform" and len(args) == 2:
            lo, hi = int(args[0]), int(args[1])
            if lo > hi:
                raise ValueError
            return lambda rng: rng.randint(lo, hi)
        if name == "normal" and len(args) == 2:
            mean, sd = float(args[0]), float(args[1])
            return lambda rng: round(rng.gauss(mean, sd))
        if name == "lognormal" and len(args) == 2:
            median, sigma = float(args[0]), float(args[1])
            return lambda rng: round(median * math.exp(rng.gauss(0, sigma)))
        if name == "choice" and len(args) == 1:
            values = [int(v) for v in args[0].split(",")]
            return lambda rng: rng.choice(values)
    except ValueError:
        pass
    raise ValueError(f"{what}: cannot read distribution {text!r} (fixed:X, uniform:LO:HI, normal:MEAN:SD, "
                     f"lognormal:MEDIAN:SIGMA, choice:A,B,...)")


def synthetic_workload(prefix, suffix, requests, seed):
    """``requests`` requests whose cached shared prefix ``P ~ prefix`` (at least 1) is followed by
    ``S ~ suffix`` new tokens (at least 0): ``N = P + S``. Seeded, so the same arguments give the same
    workload."""
    if requests < 1:
        raise ValueError(f"--requests must be positive, got {requests}")
    draw_p = parse_distribution(prefix, "--shared-prefix")
    draw_s = parse_distribution(suffix, "--suffix")
    rng = random.Random(seed)
    out = []
    for _ in range(requests):
        p = max(1, draw_p(rng))
        out.append((p + max(0, draw_s(rng)), p))
    return out


# --------------------------------------------------------------------------------------------------
# settings
# --------------------------------------------------------------------------------------------------

@dataclass
class Setting:
    """One combination of operator settings and what it gives.

    Attributes:
        label: the settings as a person writes them.
        layout, speculation, sizes: what the setting makes of the layout (refimpl types).
        retention: the retention interval (None: dense retention; ``"dense"``: the dense cache, not a
            setting).
        same_as: labels of other settings that derive identical sizes (evaluated once).
        mean: per policy, expected cached tokens per request.
        states: per policy, retained states (Mamba states and sliding-window blocks) per request on average.
        past_hashes: per policy, requests whose lookups read past ``|H| * h`` (vLLM raises IndexError).
    """
    label: str
    block_size: int | None
    prefix_match_unit: object
    mode: str
    layout: object
    speculation: object
    sizes: object
    retention: object = 0
    same_as: list = field(default_factory=list)
    mean: dict = field(default_factory=dict)
    states: dict = field(default_factory=dict)
    past_hashes: dict = field(default_factory=dict)


@dataclass
class Candidates:
    settings: list
    rejected: list  # (label, reason)
    intervals: list = field(default_factory=list)  # retention intervals still to try (in scheduler blocks or None)
    replay: dict = field(default_factory=dict)  # (sizes, policy) -> {P: replay boundaries}, for every interval


def _default_units(layout):
    """``none`` (the GCD rule), the layout's own unit, and every multiple of 16 dividing the GCD of the
    effective blocks (a single-group layout has no choice: its unit is its block)."""
    if len(layout.groups) == 1:
        return [layout.prefix_match_unit or "none"]
    blocks = refimpl.derive_sizes(layout, refimpl.NO_SPECULATION).effective_blocks
    g = refimpl.gcd_all(blocks)
    units = ["none"] + ([layout.prefix_match_unit] if layout.prefix_match_unit else [])
    units += [u for u in range(16, g, 16) if g % u == 0 and u not in units]
    return units


DEFAULT_INTERVALS = (None, 0, 1, 2, 4)  # retention intervals: None, 0 and multiples of the scheduler block S


def _interval_label(r):
    return "R none" if r is None else f"R {r}"


def candidates(layout, spec, dcp=None, block_sizes=None, operator_groups=(), prefix_match_units=None,
               cache="written", retention_intervals=None):
    """Every combination of the operator's settings, validated by the domain (an impossible one is kept in
    ``rejected`` with the domain's reason); settings that derive identical sizes are merged.

    With the written cache each setting is made at retention interval 0 (vLLM's default; ``dense`` cache:
    no retention at all); ``retention_intervals`` (``None`` or multiples of ``S`` in scheduler blocks, given
    as ``("S", k)``, or plain token counts) are kept for :func:`with_retention`."""
    if cache not in ("written", "dense"):
        raise ValueError(f"unknown cache {cache!r} (known: written, dense)")
    if block_sizes is not None and not operator_groups:
        configure(layout, block_size=block_sizes[0], operator_groups=())  # raises the clear error
    modes = ["none"] if spec.mode is Mode.NONE else ["lookahead", "drop"]
    settings, rejected, seen = [], [], {}
    for b in block_sizes or [None]:
        try:
            base = configure(layout, dcp=dcp, block_size=b, operator_groups=operator_groups)
            units = prefix_match_units or _default_units(base)
        except ValueError as e:
            rejected.append((f"block {b}", str(e)))
            continue
        for u in units:
            for mode in modes:
                label = ", ".join(([f"block {b}"] if b is not None else []) + [f"pmu {u}", mode]
                                  + (["R 0"] if cache == "written" else []))
                try:
                    lay = configure(base, prefix_match_unit=u)
                    sp = Speculation(mode, spec.num_speculative_tokens, spec.multi_module_mtp)
                    sizes = refimpl.derive_sizes(lay, sp)
                    if cache == "written":
                        refimpl.check_retention(sizes, 0)
                except (ValueError, LayoutError) as e:
                    rejected.append((label, str(e)))
                    continue
                if sizes in seen:
                    seen[sizes].same_as.append(label)
                    continue
                s = Setting(label, b, u, mode, lay, sp, sizes, 0 if cache == "written" else "dense")
                seen[sizes] = s
                settings.append(s)
    if not settings:
        raise ValueError("no valid setting: " + "; ".join(f"{label}: {why}" for label, why in rejected))
    intervals = []
    if cache == "written":
        intervals = list(DEFAULT_INTERVALS if retention_intervals is None else retention_intervals)
    return Candidates(settings, rejected, intervals)


def with_retention(cands, ranked, top, explicit=False):
    """Add the best ``top`` settings of ``ranked`` at each other retention interval of ``cands.intervals``
    (``None``, or a multiple of ``S`` in scheduler blocks), to evaluate next. An interval the spec refuses
    (``refimpl.check_retention``) is listed as rejected when the operator asked for it (``explicit``) and
    skipped when it is one of the defaults (None on a layout without sliding-window or Mamba groups)."""
    added = []
    for base in ranked[:top]:
        for r in cands.intervals:
            interval = None if r is None else r * base.sizes.scheduler_block
            if interval == base.retention:
                continue
            label = base.label.replace("R 0", _interval_label(interval))
            try:
                refimpl.check_retention(base.sizes, interval)
            except ValueError as e:
                if explicit:
                    cands.rejected.append((label, str(e)))
                continue
            s = Setting(label, base.block_size, base.prefix_match_unit, base.mode, base.layout, base.speculation,
                        base.sizes, interval)
            cands.settings.append(s)
            added.append(s)
    return added


# --------------------------------------------------------------------------------------------------
# evaluation
# --------------------------------------------------------------------------------------------------

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


# --------------------------------------------------------------------------------------------------
# output
# --------------------------------------------------------------------------------------------------

def workload_summary(workload):
    ns = sorted(n for n, _ in workload)
    shared = sum(p for _, p in workload) / len(workload)
    return {"requests": len(workload), "mean_prompt": sum(ns) / len(ns), "min_prompt": ns[0],
            "median_prompt": ns[len(ns) // 2], "max_prompt": ns[-1], "mean_cached_prefix": shared}


def render(ranked, workload, by, top):
    settings, rejected = ranked
    w = workload_summary(workload)
    lines = [f"workload: {w['requests']} requests, prompt {w['min_prompt']}..{w['max_prompt']} tokens "
             f"(mean {w['mean_prompt']:.0f}, median {w['median_prompt']}), cached shared prefix "
             f"{w['mean_cached_prefix']:.0f} tokens on average",
             f"expected cached tokens per request (ranked by {by}; % of the mean prompt in brackets); "
             + ("the cache is what the request's shared prefix left as a prompt of its own, under each policy's "
                "write side and the setting's retention interval R; states: retained Mamba states and "
                f"sliding-window blocks per request under {by}" if settings[0].retention != "dense" else
                "the cache is every state of the shared prefix retained (--cache dense)"), ""]
    dense = settings[0].retention == "dense"
    head = (f"{'#':>3}  {'setting':<34} {'S/h/A':<18}" + "".join(f"{p:>18}" for p in POLICIES)
            + ("" if dense else f"{'states':>9}") + "  notes")
    lines += [head, "-" * len(head)]
    for i, s in enumerate(settings[:top], 1):
        sz = s.sizes
        cells = "".join(f"{s.mean[p]:>10.0f} ({100 * s.mean[p] / w['mean_prompt']:>4.1f}%)" for p in POLICIES)
        notes = []
        bad = [f"{p} {s.past_hashes[p]}" for p in POLICIES if s.past_hashes[p]]
        if bad:
            notes.append("reads past |H| (vLLM IndexError): " + ", ".join(bad))
        if s.same_as:
            notes.append("same as " + "; ".join(s.same_as))
        cost = "" if dense else f"{s.states[by]:>9.1f}"
        lines.append(f"{i:>3}  {s.label:<34} {f'{sz.scheduler_block}/{sz.hash_block}/{sz.alignment}':<18}"
                     f"{cells}{cost}  {' | '.join(notes)}".rstrip())
    if len(settings) > top:
        lines.append(f"     ... {len(settings) - top} more (--top)")
    for label, why in rejected:
        lines.append(f"rejected: {label}: {why}")
    if dense and any(g.kind.value in ("swa", "mamba") for g in settings[0].layout.groups):
        lines.append("caution: sliding-window and Mamba state is assumed kept at every boundary; real retention "
                     "keeps it at far fewer, so settings with a small hash unit look better here than they will be")
    return "\n".join(lines)


def to_json(ranked, workload, by):
    settings, rejected = ranked
    return {
        "schema": "kvhit.plan/1", "rank_by": by, "workload": workload_summary(workload),
        "settings": [{"rank": i, "label": s.label, "block_size": s.block_size,
                      "prefix_match_unit": None if s.prefix_match_unit == "none" else s.prefix_match_unit,
                      "speculative": s.mode, "scheduler_block": s.sizes.scheduler_block,
                      "hash_block": s.sizes.hash_block, "alignment": s.sizes.alignment, "same_as": s.same_as,
                      "retention_interval": s.retention, "mean_cached_tokens": dict(s.mean),
                      "mean_retained_states": dict(s.states),
                      "requests_reading_past_hashes": dict(s.past_hashes)}
                     for i, s in enumerate(settings, 1)],
        "rejected": [{"label": label, "reason": why} for label, why in rejected],
    }


def curve_points(settings, max_n, budget=1500):
    """Prompt lengths to draw: an even grid, plus both sides of every alignment step of the settings (the
    sawtooth's teeth) while there are few enough of them to see."""
    xs = set(range(1, max_n + 1, max(1, max_n // budget))) | {max_n}
    for s in settings:
        a = s.sizes.alignment
        for unit in {a, s.sizes.hash_block, s.sizes.eagle_unit or a}:
            if max_n // unit <= budget:
                for k in range(1, max_n // unit + 2):
                    xs |= {x for x in (k * unit - 1, k * unit, k * unit + 1) if 1 <= x <= max_n}
    return sorted(xs)


def plot(settings, workload, path, by):
    """A PNG of hit length versus prompt length (the first repeat of an N-token prompt, or the whole prompt
    cached with the dense cache) for ``settings`` under policy ``by``,
    and below it the tokens each setting recomputes (``N - hit``: the sawtooth that alignment and the eagle
    drop make), with the workload's prompt lengths marked and its requests' hits as dots."""
    try:
        import matplotlib
    except ImportError as exc:
        raise SystemExit("kvhit plan --plot needs matplotlib: pip install 'kvhit[tools]'") from exc

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    max_n = max(n for n, _ in workload)
    xs = curve_points(settings, max_n)
    sample = workload[:: max(1, len(workload) // 400)]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(10, 8), dpi=110, sharex=True,
                                      gridspec_kw={"height_ratios": [3, 2]})
    top.plot([0, max_n], [0, max_n - 1], color="0.75", lw=1, ls="--", label="N - 1 (whole prompt)")
    for s in settings:
        ys = [hit_of(s, n, n, by)[0] for n in xs]
        line, = top.step(xs, ys, where="post", lw=1.4, label=f"{s.label} (mean {s.mean[by]:.0f})")
        bottom.step(xs, [n - y for n, y in zip(xs, ys)], where="post", lw=1.2, color=line.get_color())
        top.scatter([n for n, _ in sample], [hit_of(s, n, p, by)[0] for n, p in sample], s=6,
                    color=line.get_color(), alpha=0.5)
    for ax in (top, bottom):
        lo, hi = ax.get_ylim()
        ax.plot([n for n, _ in sample], [lo] * len(sample), "|", color="k", alpha=0.3, ms=12)
        ax.grid(alpha=0.3)
    top.plot([], [], "|", color="k", alpha=0.5, ms=12, label="workload prompt lengths")
    top.set_ylabel(f"cached tokens (hit), policy {by}")
    bottom.set_ylabel("recomputed tokens N - hit")
    bottom.set_xlabel("prompt length N (tokens)")
    top.set_title(f"{settings[0].layout.name or 'layout'}: best {len(settings)} settings by {by} "
                  f"(lines: {'whole prompt cached' if settings[0].retention == 'dense' else 'first repeat of N tokens'}; "
                  f"dots: the workload's requests)", fontsize=10)
    top.legend(loc="upper left", fontsize=8)
    bottom.set_xlim(0, max_n * 1.02)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
