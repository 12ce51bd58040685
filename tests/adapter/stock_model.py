"""Stock vLLM under serving conditions, compared with the ``vllm_0_33`` policy of the spec (issue 17).

The write-side differential (``tests/conformance/test_write_side_matches_vllm.py``) serves one request at a
time through vLLM's ``KVCacheManager``; the budgeted one (``tests/conformance/budget_side.py``) adds token
budgets that cut prefill chunks. A stock run of ``tests/adapter/serving.py`` goes further: vLLM's real
``Scheduler`` with a sibling arriving while the first prompt is in prefill, a pool small enough to preempt,
async scheduling, and several decode steps. Its record (every lookup with the pool it saw and the junction it
recorded, every step's chunks) is compared here with what ``refimpl`` says of ``vllm_0_33``:

* **every lookup** (the scheduler's, through its coordinator, including a request's lookups while it waits
  for blocks and after a preemption): the hit and the ``shared_prefix_boundary`` are ``vllm_0_33``'s read
  side on the boundaries the pool held for that request at that moment;
* **what the requests left**, at every lookup made when no other request is in flight and nothing has been
  preempted or evicted: every multiple of ``A`` a spec group serves on the model's cache (each finished
  request's ``request_writes`` for its prompt, its hit and its junction, clipped to what it shares with the
  looking-up prompt) it serves on the pool, and every boundary the pool holds beyond the model lies within a
  chunk end's tail (the budget's extra states, as ``budget_side`` allows them).

So the write side is a function of each request's prompt, hit and junction alone: which requests run beside
it, and when their outputs arrive, change it only through the hit and the junction they leave it, and the
read side answers every lookup as on one request at a time. Lookups after a preemption or an eviction are
compared on the read side only (the write model assumes nothing is evicted, and a preempted prefill is cut
short where the scheduler preempts it).
"""

from __future__ import annotations

import dataclasses

from kvhit.refimpl import CacheState, derive_sizes, hit_tokens, policy_rules, request_writes, written_cache
from kvhit.refimpl.policy import NO_JUNCTION, Kind, cacheable_tokens, clip

from tests.adapter import scheduler_run, serving
from tests.conformance.budget_side import retained_differences, tail_span

RULES = policy_rules("vllm_0_33")


@dataclasses.dataclass
class StockComparison:
    """What one run's comparison covered."""

    lookups: int = 0
    """Lookups whose hit and junction were compared with the read side."""
    junctions: int = 0
    """Of those, lookups that recorded a junction (``shared_prefix_boundary > 0``)."""
    write_checks: int = 0
    """Lookups at which the pool was compared with the model's write side."""
    with_concurrent_writer: int = 0
    """Of those, lookups after a request that was admitted while another was in prefill had finished."""
    bounded_checks: int = 0
    """Lookups after a preemption or an eviction, or with another request in flight, at which only the
    boundaries the pool held beyond the model's were checked (each within a chunk end's tail)."""
    extra_boundaries: int = 0
    """Boundaries the pool held beyond the model, each within a chunk end's tail."""


def common_prefix(a, b) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def chunk_ends(trace: list) -> dict[str, list[int]]:
    """Per request, where each step's scheduled tokens ended (prefill chunks, then decode steps)."""
    ends: dict[str, list[int]] = {}
    for step in trace:
        computed = {r["req_id"]: r["num_computed_tokens"] for r in step["new_reqs"]}
        computed.update(zip(step["cached_reqs"]["req_ids"], step["cached_reqs"]["num_computed_tokens"]))
        for rid, scheduled in step["num_scheduled_tokens"].items():
            ends.setdefault(rid, []).append(computed[rid] + scheduled)
    return ends


def chunk_end_explains(sizes, k, x, ends) -> bool:
    """Whether a step ending at one of ``ends`` can have left spec group ``k`` holding boundary ``x`` beyond
    the write model: within the tail the step's end leaves (:func:`~tests.conformance.budget_side.tail_span`,
    a budget's chunk end), or, for full attention, within the tokens that step's caching call covers (vLLM
    ``get_num_cacheable_tokens``, ``refimpl``'s ``cacheable_tokens``: a decode step that crosses an
    alignment boundary caches the blocks below it, where the model's request sampled one token and ended;
    DeepSeek-V4's report layout, whose prompts of the preempting stream decode past 32768)."""
    sg = sizes.groups[k]
    span = tail_span(sg)
    return any(e - span < x <= e or (sg.kind is Kind.FULL and x <= cacheable_tokens(sizes, k, e)) for e in ends)


def pool_cache(sizes, lookup) -> list[set[int]]:
    """Per spec group, the boundaries the pool held in every member KV-cache group at ``lookup``."""
    return [set.intersection(*(set(lookup["pool"][m]) for m in sg.members)) for sg in sizes.groups]


def compare(run: dict, case_name: str, condition: str, rules=RULES, write_side: bool = True,
            write_rules=None) -> StockComparison:
    """Compare one stock run of ``serving.run_condition`` with ``rules`` (module docstring): its read side,
    and its write side (under ``write_rules``, by default ``rules``) unless ``write_side`` is False. Raises
    AssertionError with the run, the request and both sides on a difference."""
    case = serving.CASES[case_name]
    layout = serving.planned_layout(run)
    speculation = serving.speculation_of(case)
    sizes = derive_sizes(layout, speculation, rules.scale_replicated)
    interval = run["scheduler"]["retention"]
    stream = serving.CONDITIONS[condition][0](case, f"{case_name}/{condition.removesuffix('-async')}")
    tokens = {a.request_id: a.tokens for a in stream}
    served = {s["request_id"]: s for s in run["served"]}
    ends = chunk_ends(run["trace"])
    stats = StockComparison()
    where = f"{case_name}/{condition}/{run['scheduler']['max_num_batched_tokens']}"

    first_seq = {rid: s["lookups"][0]["seq"] for rid, s in served.items()}
    # a request looked up while another, looked up before it, had not finished
    concurrent = {rid for rid in served if any(first_seq[q] < first_seq[rid] <= served[q]["lookups_at_finish"]
                                               for q in served if q != rid)}
    for rid, s in served.items():
        n = s["prompt_len"]
        for lookup in s["lookups"]:
            cache = CacheState.from_sets(pool_cache(sizes, lookup))
            size = lookup["max_cache_hit_length"] + 1  # the tokens looked up: the prompt, or more on resuming
            hit, _, longest, _ = hit_tokens(cache, sizes, size, rules)
            junction = longest if longest > hit else 0
            got = (lookup["hit"], lookup["shared_prefix_boundary"])
            assert got == (hit, junction), (
                f"{where}: {rid}'s lookup #{lookup['seq']} of {size} tokens: vLLM (hit, junction) {got}, "
                f"{rules.name}'s read side on the pool {(hit, junction)}; pool {pool_cache(sizes, lookup)}")
            stats.lookups += 1
            stats.junctions += junction > 0
        if not write_side:
            continue
        # the lookup that admitted the request (a waiting request is looked up again each step; a preempted
        # one again when it resumes, on a pool holding what it computed)
        lookup = s["lookups"][-1 if not s["preemptions"] else 0]
        seq = lookup["seq"]
        before = [q for q in served if q != rid and first_seq[q] < seq]
        # whole only where every request before has finished, none was preempted and nothing was evicted
        whole = not lookup["evictions"] and not any(served[q]["lookups_at_finish"] >= seq
                                                    or served[q]["preemptions"] for q in before)
        # each admission of a request before: its last lookup before this one, or every one of a preempted
        # or unfinished request (a lookup that admitted nothing wrote nothing: only a looser upper bound)
        attempts = [(q, done) for q in before for done in served[q]["lookups"] if done["seq"] < seq
                    and (not whole or done is served[q]["lookups"][-1])]
        _compare_writes(sizes, interval, where, rid, tokens, attempts, ends, lookup, n, stats, write_rules or rules,
                        whole)
        stats.with_concurrent_writer += whole and bool(concurrent.intersection(before))
    return stats


def _compare_writes(sizes, interval, where, rid, tokens, attempts, ends, lookup, n, stats, rules,
                    whole: bool) -> None:
    """The pool at ``lookup`` (``rid``'s) against the writes of ``attempts``, ``(request, the lookup that
    admitted it)`` in order: every boundary held beyond them lies in a chunk end's tail, and, if ``whole``,
    every multiple of ``A`` they serve the pool serves."""
    layers = [[] for _ in sizes.groups]
    seen: set = set()
    for q, done in sorted(attempts, key=lambda a: a[1]["seq"]):
        size = done["max_cache_hit_length"] + 1  # more than the prompt when it resumed after decoding
        looked_up = tuple(tokens[q]) + (scheduler_run.SAMPLED_TOKEN_ID,) * (size - len(tokens[q]))
        junction = done["shared_prefix_boundary"] or NO_JUNCTION
        writes = request_writes(sizes, size, interval, rules, done["hit"], junction, looked_up in seen)
        seen.add(looked_up)
        shared = common_prefix(looked_up, tokens[rid])
        for k, g in enumerate(writes):
            layers[k].append(clip(sizes, g, shared))
    model = written_cache(tuple(tuple(layer) for layer in layers))
    tails = [e for q in {q for q, _ in attempts} for e in ends.get(q, ())]
    held = pool_cache(sizes, lookup)
    differences = retained_differences(sizes, model, held, n, lambda k, x: chunk_end_explains(sizes, k, x, tails),
                                       rules, lost=whole)
    for k, (want, have, lost, unexplained) in enumerate(differences):
        sg = sizes.groups[k]
        assert not lost, (f"{where}: at {rid}'s lookup, spec group {k} ({sg.kind.value} {sg.block}) no longer "
                          f"serves {lost}, which the model's write side serves (attempts before: "
                          f"{[(q, a['hit']) for q, a in attempts]})")
        assert not unexplained, (
            f"{where}: at {rid}'s lookup, spec group {k} ({sg.kind.value} {sg.block}) holds {unexplained}, which "
            f"neither the model's write side nor a chunk end explains; pool {have}, model {want}, chunk ends "
            f"{sorted(tails)}")
        stats.extra_boundaries += len(set(have) - set(want))
    stats.write_checks += whole
    stats.bounded_checks += not whole
