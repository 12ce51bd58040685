"""What the first request left on the written cache under a policy, and what the next requests hit on it."""

from kvhit import refimpl
from kvhit.refimpl import Kind

from .trace import policy_trace


REPEATS = 3  # repeats of the prompt after the first request: second_repeat_is_stable compares the 2nd and 3rd


def retained(groups, k):
    """What spec group ``k`` of the written cache ``groups`` (``refimpl.Held`` per spec group) holds, read
    from the refimpl's ``written_cache``: every boundary past ``all_from`` up to ``all_up_to`` at the group's
    grid when it keeps every one (``all_from``: the blocks a chunked-local lookup skipped, else 0), and the
    single boundaries (positions > 0) it holds besides."""
    g = groups[k]
    cache = refimpl.written_cache(groups)
    grid = g.block if g.kind in (Kind.FULL, Kind.SWA, Kind.CHUNKED) else g.unit
    singles = {p for p in g.points if p > 0}
    if not g.every:
        singles |= set(range(grid, g.extent + 1, grid))
    kept = sorted(x for x in singles if (not g.every or x > g.extent or x % grid) and cache.has(k, x))
    out = {"group": k, "kind": g.kind.value, "extent": g.extent,
           "all_from": refimpl.held_from(g) if g.kind is Kind.CHUNKED and g.every else 0,
           "all_up_to": g.extent if g.every else None, "grid": grid, "boundaries": kept,
           "retained_states": refimpl.retained_states(g)}
    if g.kind is Kind.SWA:
        out["tails"] = {"need": g.need, "shift": g.shift, "period": g.period,
                        "ends": sorted({e for e in g.ends if e > 0})}
    return out


def write_side(layout, spec, n_tokens, interval, policy, sibling):
    """What the first request left under ``policy`` and what the next requests hit on it."""
    rules = refimpl.policy_rules(policy)
    sizes = refimpl.derive_sizes(layout, spec, rules.scale_replicated)
    first = refimpl.request_writes(sizes, n_tokens, interval, rules)
    dense = refimpl.dense_groups(sizes, n_tokens)
    hit1, junction1, after1 = refimpl.repeat(sizes, n_tokens, interval, rules, first)
    hit2, junction2, _ = refimpl.repeat(sizes, n_tokens, interval, rules, after1)
    hits = refimpl.repeat_hits(sizes, n_tokens, interval, rules, REPEATS)
    assert hits[:2] == (hit1, hit2), "repeat_hits disagrees with two calls of repeat"
    dense_hit = refimpl.hit_tokens(refimpl.written_cache(dense), sizes, n_tokens, rules)[0]
    dense_sibling = refimpl.hit_tokens(refimpl.written_cache(dense), sizes, sibling, rules)[0]
    second = policy_trace(layout, spec, n_tokens, lambda: refimpl.written_cache(after1), policy)
    near = policy_trace(layout, spec, sibling, lambda: refimpl.written_cache(first), policy)
    return {
        "policy": policy,
        "replay_boundaries": sorted({b for b in refimpl.replay_boundaries(sizes, n_tokens, rules)}),
        "cacheable_tokens": [refimpl.cacheable_tokens(sizes, k, n_tokens) for k in range(len(sizes.groups))],
        "groups": [retained(first, k) for k in range(len(first))],
        "retained_states": sum(refimpl.retained_states(g) for g in first if g.kind in (Kind.SWA, Kind.MAMBA)),
        "dense_hit": dense_hit,
        "first_repeat": {"hit": hit1, "junction": junction1},
        "second_repeat": {"hit": hit2, "junction": junction2, "after_junction": junction1, "trace": second},
        "sibling": {"n_tokens": sibling, "hit": near["hit"], "dense_hit": dense_sibling, "trace": near},
        "repeat_hits": list(hits),
    }
