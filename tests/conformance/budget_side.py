"""The write side under a token budget that cuts prefill chunks, compared with vLLM's own classes.

The write-side model (``spec/retention.py``) assumes a budget that never cuts a chunk: only the scheduler's
mandatory Mamba stops end one. A served engine runs with ``--max-num-batched-tokens`` (8192 in both reports
behind kvhit), so a long prefill is cut into chunks at budget boundaries as well. What the model's verdicts
need of such a run, compared here on the installed vLLM (:class:`.vllm_harness.VllmHarness` with the budget,
vLLM's ``KVCacheManager`` and the scheduler's own chunk clipping), for a write scenario of
:mod:`.write_side`:

* **nothing a hit could use is lost**: after the first request, every multiple ``x`` of ``A`` below ``N`` that
  a spec group serves (``refimpl.group_serves``: its prefix, window, state and drop unit) on the model's cache
  (``refimpl.request_writes`` without a budget) it serves on the cache vLLM's ``BlockPool`` holds. Not every
  boundary: a sliding-window block that leaves the window before a later chunk caches it is freed (as the
  model's ``sliding_window_gaps`` says of chunks it knows), and a cut chunk makes more of those, below any
  aligned window (DeepSeek-V4's report layout, block 128 at window 128: the first block);
* **every extra boundary is a chunk end's**: a boundary vLLM keeps beyond the model lies below a chunk end of
  the run, within the sliding-window tail or the Mamba block that chunk left (:func:`tail_span`);
* **every lookup as the read side says on the cache vLLM holds**: each later request's hit and
  ``shared_prefix_boundary`` equal ``vllm_0_33``'s read side on the boundaries vLLM's pool holds at its
  admission (or vLLM raises ``IndexError`` where that read side reads past the hashes, F1);
* **never a shorter first repeat**: the first resend hits at least what the model predicts without a budget.

A mismatch raises :class:`~.differential.Mismatch`.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass

from kvhit.refimpl import CacheState, derive_sizes, hit_tokens, repeat_hits, request_writes, written_cache
from kvhit.refimpl.policy import NO_JUNCTION, group_extents, group_serves, num_hashes

from .differential import (POLICY, Coverage, Mismatch, cache_state, check_sizes, compare_lookup, runs,
                           stall_predicted)
from .vllm_harness import VLLM_VERSION, SchedulingStalled
from .write_side import WriteScenario, build_write_harness, model_retained

BUDGETS = (2048, 8192)
"""Token budgets every catalogue case runs with (the reports' 8192, and a quarter of it)."""


def cutting_budget(sizes) -> int:
    """A budget that cuts this layout's generated prompts into several chunks: three scheduler blocks."""
    return 3 * sizes.scheduler_block


@dataclass
class BudgetStats(Coverage):
    """What the budgeted runs covered, for the session summary."""

    scenarios: int = 0
    cut: int = 0
    """First requests whose prefill is longer than the budget, so that the budget cut it."""
    extra_boundaries: int = 0
    """Boundaries vLLM kept beyond the model's, each at a chunk end."""
    lost_boundaries: int = 0
    """Boundaries the model keeps and vLLM does not, none of which serves an aligned hit: sliding-window blocks
    that left the window before a later chunk cached them (``sliding_window_gaps``)."""
    lookups: int = 0
    crashes: int = 0
    stalls: int = 0
    resends_above_model: int = 0
    """First resends that hit more than the model's unbudgeted first repeat."""
    seconds: float = 0.0


BUDGET_STATS = BudgetStats()


def _chunk_ends(start: int, chunks: list[int], n: int) -> list[int]:
    """The token positions where the prefill's chunks ended (decode steps excluded)."""
    ends, at = [], start
    for c in chunks:
        at += c
        ends.append(min(at, n))
        if at >= n:
            break
    return ends


def tail_span(sg) -> int:
    """How far below a chunk end a boundary the chunk left can lie: a sliding-window group keeps the blocks
    its window reaches back over and the block it ends in, a Mamba group the state of the block it ends in."""
    if sg.window:
        return sg.block * (-(-sg.window // sg.block) + 1)
    return sg.block


def retained_differences(sizes, model, held, n: int, explains, rules, lost: bool = True) -> list[tuple]:
    """Per spec group ``k``, for a prompt of ``n`` tokens, the model's cache ``model`` against the boundary
    sets ``held`` vLLM's pool holds (per spec group, in every member): ``(want, have, lost, unexplained)``,
    the boundaries ``x <= N - L`` each holds (sorted lists), the multiples of ``A`` below ``N`` the group
    serves on the model's cache and not on vLLM's (none unless ``lost``), and the boundaries vLLM holds beyond
    the model that ``explains(k, x)`` does not account for."""
    vllm = CacheState.from_sets(held)
    covered = num_hashes(sizes, n) * sizes.hash_block
    model_extents, vllm_extents = group_extents(model, sizes, covered), group_extents(vllm, sizes, covered)
    out = []
    for k in range(len(sizes.groups)):
        want = model_retained(sizes, model, k, n)
        missing = [x for x in range(sizes.alignment, n, sizes.alignment) if lost
                   and group_serves(model, sizes, k, x, model_extents[k], covered, rules)
                   and not group_serves(vllm, sizes, k, x, vllm_extents[k], covered, rules)]
        have = [x for x in sorted(held[k]) if x <= n - sizes.hash_lookahead]
        unexplained = [x for x in sorted(set(have) - set(want)) if not explains(k, x)]
        out.append((want, have, missing, unexplained))
    return out


def run_budgeted_scenario(scenario: WriteScenario, budget: int, stats: BudgetStats = BUDGET_STATS,
                          rules=POLICY) -> list:
    """Serve ``scenario`` on vLLM with ``max_num_batched_tokens = budget`` and compare (module docstring).
    Returns ``[(what, N, vllm_outcome), ...]``."""
    start = time.perf_counter()
    try:
        return _run(scenario, budget, stats, rules)
    finally:
        stats.seconds += time.perf_counter() - start


def _run(scenario: WriteScenario, budget: int, stats: BudgetStats, rules) -> list:
    sizes = derive_sizes(scenario.layout, scenario.speculation)
    harness = build_write_harness(scenario, sizes, max_num_batched_tokens=budget)
    check_sizes(scenario, sizes, harness)
    n, R, L, h = scenario.n, scenario.retention, sizes.hash_lookahead, sizes.hash_block
    stats.scenarios += 1
    stats.count(scenario.layout, scenario.speculation, R)
    rng = random.Random(scenario.seed)
    tokens = [rng.randrange(1, 50_000) for _ in range(n)]
    history: list = []

    def fail(what, vllm, model):
        raise Mismatch(f"{what} (budget {budget})\n{scenario.describe()}\n  S/h/A/L = {sizes.scheduler_block}/"
                       f"{h}/{sizes.alignment}/{L}\n  requests so far: {history}\n"
                       f"  vLLM {VLLM_VERSION}: {vllm}\n  model [{rules.name}]: {model}")

    def lookup(label, prompt, serve):
        """Serve or probe ``prompt``; its hit compared with the read side on the cache vLLM holds. Returns
        vLLM's outcome, or None when the scenario ends (a crash the read side predicts, or a stall)."""
        boundaries = cache_state(harness, sizes, prompt)
        try:
            outcome = harness.serve(prompt, decode_steps=0) if serve else harness.probe(prompt)
        except IndexError as e:
            outcome = e
        except (SchedulingStalled, RuntimeError) as e:
            if "0 tokens" not in str(e):
                raise
            # S1 (docs/findings.md): the scheduler's own clipping leaves the prefill 0 tokens, where the model
            # predicts it from the hit (a budget must not add stalls); the request never completes, so
            # nothing more is written, and the scenario ends.
            hit, _, longest, _ = hit_tokens(CacheState.from_sets(boundaries), sizes, len(prompt), rules)
            if not stall_predicted(sizes, len(prompt), hit, longest if longest > hit else NO_JUNCTION, rules):
                fail(f"{label}: the scheduler stalled where the model predicts no stall", repr(e), f"hit {hit}")
            stats.stalls += 1
            history.append((label, len(prompt), "stall"))
            return None
        what = compare_lookup(scenario, sizes, len(history), prompt, boundaries, outcome, history, rules)
        stats.lookups += 1
        if what == "crash":
            stats.crashes += 1
            history.append((label, len(prompt), "IndexError"))
            return None
        history.append((label, len(prompt), outcome["hit"]))
        return outcome

    first = lookup("first", tokens, serve=True)
    if first is None or scenario.held_before:
        return history  # a held prefix is the unbudgeted suite's (its model starts from the held cache)
    ends = _chunk_ends(first["hit"], first["chunks"], n)
    model = written_cache(request_writes(sizes, n, R, rules))
    held = cache_state(harness, sizes, tokens)  # per spec group, in every member

    def explains(k, x):
        span = tail_span(sizes.groups[k])
        return any(e - span < x <= e for e in ends)

    for k, (want, have, lost, unexplained) in enumerate(retained_differences(sizes, model, held, n, explains,
                                                                              rules)):
        sg = sizes.groups[k]
        if lost:
            fail(f"spec group {k} ({sg.kind.value} {sg.block}) no longer serves {lost}, which the model's cache "
                 f"serves; chunk ends {ends}", runs(sorted(held[k]), h), runs(want, h))
        if unexplained:
            fail(f"spec group {k} ({sg.kind.value} {sg.block}) keeps boundaries no chunk end explains: "
                 f"{unexplained}; chunk ends {ends}", runs(have, h), runs(want, h))
        stats.extra_boundaries += len(set(have) - set(want))
        stats.lost_boundaries += len(set(want) - set(have))
    stats.cut += n - first["hit"] > budget

    resends = 0
    for op in scenario.ops:
        if op[0] == "diverge":
            cut, extra, _ = op[1:]
            cut = max(1, min(cut, n))
            lookup(f"diverge [:{cut}] + {extra}", tokens[:cut] + [rng.randrange(1, 50_000) for _ in range(extra)],
                   serve=True)
            return history
        if op[0] == "resend":
            resends += 1
            out = lookup(f"resend {resends}", tokens, serve=True)
            if out is None:
                return history
            if resends == 1:
                expected = repeat_hits(sizes, n, R, rules, 1)[-1]
                if out["hit"] < expected:
                    fail(f"the first resend hits less than the model's unbudgeted first repeat (N={n}); "
                         f"chunk ends {ends}", f"hit {out['hit']}", f"repeat_hits {expected}")
                stats.resends_above_model += out["hit"] > expected
        else:
            prompt = tokens + [rng.randrange(1, 50_000) for _ in range(op[1])]
            if lookup(f"sibling +{op[1]}", prompt, serve=False) is None:
                return history
    return history
