"""``kvhit explain``: how the hit of one request is derived, step by step, by the generated refimpl.

Every number in a trace comes from ``kvhit.refimpl``; nothing here re-implements the policy:

* the derived sizes are ``refimpl.derive_sizes`` / ``num_hashes`` / ``max_cache_hit_length``;
* vLLM's Hybrid loop is run by ``refimpl.hybrid_hit_tokens`` itself, with ``hybrid_pass`` wrapped to record
  each pass's inputs and outputs; each pass is then replayed one spec group at a time by calling the
  refimpl's ``hybrid_pass`` on the first ``k + 1`` spec groups (the pass visits groups in order, so that
  prefix reproduces the candidate after group ``k``), with ``lookup`` wrapped to record the bound each group
  was looked up at and whether it dropped;
* the reference policy is ``refimpl.reference_hit_tokens``; its explanation is ``group_extents``,
  ``reference_pass`` and ``group_serves`` at the hit and at the next aligned length;
* ``--compare`` evaluates the claim functions of ``make prove`` (``kvhit.proofs``) on these concrete values
  through ``kvhit.proofs.concrete``, as ``tests/properties/test_invariants_concrete.py`` does, and names the
  ones a policy's hit violates (only ``--compare`` imports ``kvhit.proofs``, and so z3).

The cache is, by default, what the first request left: ``refimpl.request_writes`` (the write side of the
spec) under each policy's own rules and the chosen retention interval (vLLM's default 0), read through
``refimpl.written_cache``; the policy traces are then the first repeat. The ``write_side`` section adds the
replay boundaries, the boundaries each group retained, ``refimpl.cacheable_tokens``, the hit with every
state retained (``refimpl.dense_groups``), the second repeat (``refimpl.repeat``: on the cache after the
first repeat's write, with the junction it recorded) and a longer sibling, each with its own trace.
``cache="dense"`` keeps the read side's old assumption (every boundary up to an extent held).
"""

from contextlib import contextmanager
from dataclasses import replace

import kvhit.refimpl.policy as _policy
from kvhit import refimpl
from kvhit.dense import DenseCache
from kvhit.layouts import describe_group, to_json
from kvhit.refimpl import Kind, Speculation

SCHEMA_ID = "kvhit.explain/1"
POLICIES = ("reference", "vllm_0_33", "historical")


@contextmanager
def _tapped(name, record):
    """Wrap ``refimpl.policy.<name>`` so every call's arguments and result go to ``record``; the wrapped
    function still computes the result. Yields the original function."""
    original = getattr(_policy, name)

    def wrapper(*args):
        out = original(*args)
        record(args, out)
        return out

    setattr(_policy, name, wrapper)
    try:
        yield original
    finally:
        setattr(_policy, name, original)


def speculation(mode="none", num_speculative_tokens=None, multi_module_mtp=False):
    """A refimpl ``Speculation`` from CLI values (``num_speculative_tokens`` defaults to 1 when speculating)."""
    if mode == "none":
        return Speculation("none", num_speculative_tokens or 0, multi_module_mtp)
    return Speculation(mode, 1 if num_speculative_tokens is None else num_speculative_tokens, multi_module_mtp)


def cache_extents(cached, n_tokens, num_groups):
    """Per spec group, the extent of the dense cache: ``cached`` is None (the whole prompt), one int for
    every group, or one int per spec group."""
    if cached is None:
        return (n_tokens,) * num_groups
    if isinstance(cached, int):
        cached = (cached,)
    cached = tuple(cached)
    for c in cached:
        if isinstance(c, bool) or not isinstance(c, int) or c < 0:
            raise ValueError(f"a cached length must be a non-negative integer, got {c!r}")
    if len(cached) == 1:
        return cached * num_groups
    if len(cached) != num_groups:
        raise ValueError(f"--cached gives {len(cached)} lengths; the layout has {num_groups} spec groups "
                         f"(give one length for all, or one per spec group)")
    return cached


# --------------------------------------------------------------------------------------------------
# derived sizes
# --------------------------------------------------------------------------------------------------

def sizes_section(layout, sizes, n_tokens):
    hashes = refimpl.num_hashes(sizes, n_tokens)
    if sizes.unitary:
        h_rule = "the block of the single group"
    elif layout.prefix_match_unit is not None:
        h_rule = "prefix_match_unit"
    else:
        h_rule = "gcd of the effective blocks"
    m = refimpl.max_cache_hit_length(n_tokens, refimpl.policy_rules("reference"))
    return {
        "effective_blocks": list(sizes.effective_blocks),
        "scheduler_block": sizes.scheduler_block,
        "hash_block": sizes.hash_block,
        "hash_block_rule": h_rule,
        "partial_hits": sizes.partial_hits,
        "alignment": sizes.alignment,
        "alignment_rule": ("the block of the single group" if sizes.unitary else
                           "hash unit h (partial hash hits on)" if sizes.partial_hits else "scheduler block S"),
        "hash_lookahead": sizes.hash_lookahead,
        "prefill_lookahead": sizes.prefill_lookahead,
        "drop": sizes.drop,
        "num_hashes": hashes,
        "hash_reach": hashes * sizes.hash_block,
        "max_cache_hit_length": m,
        "cap": min(m, hashes * sizes.hash_block),
        "eagle_unit": sizes.eagle_unit,
        "spec_groups": [
            {"index": k, "kind": sg.kind.value, "block": sg.block, "window": sg.window, "chunk": sg.chunk,
             "members": list(sg.members), "drops": sg.drops, "margin": sg.margin, "fine": sg.fine}
            for k, sg in enumerate(sizes.groups)],
    }


# --------------------------------------------------------------------------------------------------
# the three coordinators
# --------------------------------------------------------------------------------------------------

_SERVES = {
    Kind.FULL: "its leading run of cached {b}-token blocks up to the bound, aligned to A = {a}",
    Kind.SWA: "the highest window of cached {b}-token blocks ending on a multiple of A = {a}",
    Kind.MAMBA: "the highest cached state at a multiple of A = {a}",
    Kind.CHUNKED: "the cached blocks of the bound's chunk",
}


def _lookup_step(k, sg, sizes, rules, cache, hashes, before, call, after, original_lookup):
    """One recorded lookup as a step of the trace."""
    (_, _, _, _, bound, drop), (result, reach) = call
    found = original_lookup(cache, sizes, k, hashes, bound, False)[0] if drop else result
    covered = hashes * sizes.hash_block
    peek = bound != before
    where = f"looked up at {bound}"
    if peek and bound == before + sg.margin:
        where += f" = candidate {before} + its margin {sg.margin} (EAGLE peek)"
    elif peek and bound == covered:
        where += f" = |H|*h (the EAGLE peek {before} + {sg.margin}, capped at the hashes)"
    elif sg.drops and sg.kind is Kind.MAMBA:
        where += " (Mamba does not peek)"
    elif drop and not rules.eagle_margin:
        where += " (the candidate itself: this policy has no eagle margin)"
    elif sg.drops and not drop:
        where += " (already dropped once in this lookup, verified: no peek, no drop)"
    serves = f"serves {found}"
    if found < bound:
        serves += f" ({_SERVES[sg.kind].format(b=sg.block, a=sizes.alignment)})"
    if drop and result != found:
        serves += (f"; with the drop (recompute one unit past the hit, then align to A = {sizes.alignment}) "
                   f"-> {result}")
    if after < before:
        moved = f"candidate {before} -> {after}"
    elif after == before:
        moved = f"candidate stays {after}"
    else:
        moved = f"candidate {before} -> {after} (rises)"
    return {"group": k, "kind": sg.kind.value, "action": "lookup", "candidate_before": before,
            "bound": bound, "peek": peek, "drop": drop, "found": found, "result": result,
            "candidate_after": after, "reach": reach, "why": f"{where}; {serves}; {moved}"}


def _expand_pass(cache, sizes, args, original_pass, original_lookup):
    """The steps of one Hybrid pass: the refimpl's ``hybrid_pass`` run on each prefix of the spec groups.

    The prefix run gets the pass's full ``verified`` and ``lengths``, so what it returns is the state of the
    whole pass right after group ``k`` (a clearing also clears the flags of groups not yet visited)."""
    _, _, hashes, hit_length, verified, lengths, first, rules = args
    steps = []
    before = hit_length
    prev_verified = tuple(verified)
    for k, sg in enumerate(sizes.groups):
        calls = []
        prefix = replace(sizes, groups=sizes.groups[:k + 1])
        with _tapped("lookup", lambda a, o: calls.append((a, o))):
            c, ver, lens, _, _ = original_pass(cache, prefix, hashes, hit_length, verified, lengths,
                                               first, rules)
        mine = [call for call in calls if call[0][2] == k]
        if mine:
            step = _lookup_step(k, sg, sizes, rules, cache, hashes, before, mine[-1], c, original_lookup)
        else:
            step = {"group": k, "kind": sg.kind.value, "action": "trim", "candidate_before": before,
                    "bound": None, "peek": False, "drop": False, "found": None, "result": lens[k],
                    "candidate_after": c, "reach": None,
                    "why": (f"full attention is looked up on the first pass only: the candidate is trimmed "
                            f"to its pass-1 length {lens[k]}; "
                            + (f"candidate {before} -> {c}" if c < before else f"candidate stays {c}"))}
        cleared = [j for j in range(len(ver)) if prev_verified[j] and not ver[j]]
        if ver[k] and not prev_verified[k]:
            step["why"] += "; marked verified (vLLM eagle_verified)"
        if cleared:
            step["why"] += (f"; it shrank the candidate without dropping, so the verification of group(s) "
                            f"{', '.join(map(str, cleared))} is cleared: they peek and drop again next pass")
        step["verified_after"] = list(ver)
        steps.append(step)
        before = c
        prev_verified = tuple(ver)
    return steps


def hybrid_trace(cache, sizes, n_tokens, rules):
    """vLLM's Hybrid coordinator, run by ``refimpl.hybrid_hit_tokens`` with each pass recorded."""
    passes = []
    with _tapped("hybrid_pass", lambda a, o: passes.append((a, o))) as original_pass:
        hit, reach, longest, _ = _policy.hybrid_hit_tokens(cache, sizes, n_tokens, rules)
    original_lookup = _policy.lookup
    simple = refimpl.is_simple(sizes)
    out = []
    for index, (args, result) in enumerate(passes):
        steps = _expand_pass(cache, sizes, args, original_pass, original_lookup)
        start, end = args[3], result[0]
        assert steps[-1]["candidate_after"] == end, "a prefix replay disagrees with the recorded pass"
        if simple:
            stop = "two spec groups led by full attention: vLLM stops after one pass (its simple case)"
        elif end >= start:
            stop = f"the pass did not lower the candidate ({start}): fixed point"
        else:
            stop = f"the pass lowered the candidate {start} -> {end}: another pass"
        out.append({"index": index + 1, "start": start, "first": args[6], "steps": steps, "end": end,
                    "stop": stop})
    return {"coordinator": "hybrid", "max_length": refimpl.max_cache_hit_length(n_tokens, rules),
            "passes": out, "hit": hit, "reach": reach, "longest": longest}


def unitary_trace(cache, sizes, n_tokens, rules):
    """vLLM's Unitary coordinator: one lookup at ``N - 1`` (``refimpl.unitary_hit_tokens``, recorded)."""
    calls = []
    with _tapped("lookup", lambda a, o: calls.append((a, o))) as original_lookup:
        hit, reach, longest, _ = _policy.unitary_hit_tokens(cache, sizes, n_tokens, rules)
    m = refimpl.max_cache_hit_length(n_tokens, rules)
    hashes = refimpl.num_hashes(sizes, n_tokens)
    step = _lookup_step(0, sizes.groups[0], sizes, rules, cache, hashes, m, calls[-1], hit, original_lookup)
    step["verified_after"] = [step["drop"]]
    step["why"] += ("; one KV-cache group: no eagle margin and no cap by the hashes"
                    if sizes.groups[0].drops else "; one KV-cache group")
    return {"coordinator": "unitary", "max_length": m,
            "passes": [{"index": 1, "start": m, "first": True, "steps": [step], "end": hit,
                        "stop": "one lookup"}],
            "hit": hit, "reach": reach, "longest": longest}


def _why_not(cache, sizes, k, x, extents, reach, ref):
    """Why spec group ``k`` cannot serve ``x`` (a multiple of ``A``), in words."""
    sg = sizes.groups[k]
    unit = sg.margin if sg.drops and sg.kind is not Kind.MAMBA else 0
    if unit and x + unit > reach:
        return f"its drop unit [{x}, {x + unit}) passes the hashes (|H|*h = {reach})"
    if sg.kind is Kind.SWA and x > reach:
        return f"{x} is past the hashes (|H|*h = {reach})"
    if sg.kind is Kind.FULL:
        return (f"its cached prefix ({extents[k]}) does not reach {x}" + (f" + its drop unit {unit}" if unit else ""))
    if sg.kind is Kind.SWA:
        need = -(-(sg.window - 1) // sg.block)
        return (f"the {need} block(s) of {sg.block} before {x}" + (" and the peek block after it" if unit else "")
                + " are not all cached")
    if sg.kind is Kind.MAMBA:
        return f"no state is cached at {x}"
    return f"the blocks from {x}'s chunk start to {x} are not all cached"


def reference_trace(cache, sizes, n_tokens, rules):
    """kvhit's reference: the longest aligned length every group serves (``refimpl.reference_hit_tokens``),
    explained by the refimpl's ``group_extents``, ``reference_pass`` and ``group_serves``."""
    hit, reach, longest, _ = _policy.reference_hit_tokens(cache, sizes, n_tokens, rules)
    m = refimpl.max_cache_hit_length(n_tokens, rules)
    cap = min(m, reach)
    extents = refimpl.group_extents(cache, sizes, reach)
    again = refimpl.reference_pass(cache, sizes, cap, extents, reach, rules)
    assert again == hit, "reference_pass disagrees with reference_hit_tokens"
    limits = [("cap", cap)] + [(f"group {k} (full attention) cached prefix", extents[k])
                               for k, sg in enumerate(sizes.groups) if sg.kind is Kind.FULL]
    top_name, top = min(limits, key=lambda t: t[1])
    a = sizes.alignment

    def check(x):
        groups = []
        for k in range(len(sizes.groups)):
            ok = refimpl.group_serves(cache, sizes, k, x, extents[k], reach, rules)
            groups.append({"group": k, "serves": ok,
                           "why": "serves it" if ok else _why_not(cache, sizes, k, x, extents, reach, rules)})
        return {"x": x, "serves": all(g["serves"] for g in groups), "groups": groups}

    checked = []
    if hit > 0:
        checked.append(check(hit))
    if hit + a <= top:
        checked.append(check(hit + a))
    if hit + a <= top:
        why = f"{hit + a}, the next multiple of A, is not served by every group: the scan settles on {hit}"
    elif hit == 0 and top < a:
        why = f"{top_name} {top} is below one alignment unit A = {a}"
    else:
        why = f"the longest multiple of A = {a} within {top_name} {top}"
    return {"coordinator": "reference", "max_length": m, "cap": cap, "extents": list(extents), "top": top,
            "top_is": top_name, "checked": checked, "why": why, "hit": hit, "reach": reach,
            "longest": longest}


def policy_trace(layout, spec, n_tokens, make_cache, policy):
    """One policy's trace of a request of ``n_tokens`` on the cache ``make_cache()`` builds (a fresh
    ``CacheState`` per call: a cache records the highest boundary it was asked about)."""
    rules = refimpl.policy_rules(policy)
    sizes = refimpl.derive_sizes(layout, spec, rules.scale_replicated)
    cache = make_cache()
    if rules.declarative:
        trace = reference_trace(cache, sizes, n_tokens, rules)
    elif sizes.unitary:
        trace = unitary_trace(cache, sizes, n_tokens, rules)
    else:
        trace = hybrid_trace(cache, sizes, n_tokens, rules)
    final = refimpl.hit_tokens(make_cache(), sizes, n_tokens, rules)
    assert trace["hit"] == final[0], f"{policy}: the traced hit {trace['hit']} is not hit_tokens' {final[0]}"
    trace["policy"] = policy
    return trace


# --------------------------------------------------------------------------------------------------
# invariants, on concrete values
# --------------------------------------------------------------------------------------------------

# The invariants of ``make prove`` that speak of one request's hit, in the order the comparison names them.
# (``dcp_scales_only_sharded_groups`` and ``hit_loop_terminates`` are about the layout and the loop, not about
# one hit; the other write-side claims are about streams of requests explain does not trace.)
READ_SIDE_INVARIANTS = ("hit_is_aligned_and_capped", "lookup_stays_within_hashes", "hit_is_valid_in_every_group",
                        "hit_is_the_longest_valid", "eagle_loses_at_most_one_block_beyond_alignment")
WRITE_SIDE_INVARIANTS = ("scheduler_and_mask_boundaries_agree", "second_repeat_is_stable")


def _invariants():
    """``kvhit.proofs.concrete`` and the invariants by name (imported here: only ``--compare`` needs z3)."""
    try:
        from kvhit.proofs import concrete
        from kvhit.proofs.runner import BY_NAME
    except ModuleNotFoundError as e:
        if e.name != "z3":
            raise
        raise ValueError("--compare evaluates the invariants of kvhit.proofs, which need z3: "
                         "pip install 'kvhit[prove]'") from None
    return concrete, BY_NAME


def violations(layout, spec, n_tokens, make_cache, policy):
    """The invariants of ``make prove`` that this policy's hit breaks on this request and cache.

    Each verdict is the invariant's claim function in ``kvhit.proofs``, evaluated on these concrete values
    (``kvhit.proofs.concrete``); the ``why`` only renders what the claim showed. The witness tried for
    ``hit_is_the_longest_valid``'s longer ``y`` is the reference's hit on the same cache (the module
    docstring of ``kvhit.proofs.concrete`` says why that is exact). ``make_cache`` builds the cache the
    request reads.
    """
    concrete, by_name = _invariants()
    ref = refimpl.policy_rules("reference")
    rules = refimpl.policy_rules(policy)
    sizes = refimpl.derive_sizes(layout, spec, rules.scale_replicated)
    config = concrete.config_of(layout, spec)
    witnesses = {"y": [refimpl.hit_tokens(make_cache(), sizes, n_tokens, ref)[0]]}
    out = []
    for name in READ_SIDE_INVARIANTS:
        invariant = by_name[name]
        if not invariant.applies(config):
            continue
        found = concrete.violation(invariant.claim, config, rules, n_tokens, make_cache(), witnesses)
        if found is None:
            continue
        if name == "eagle_loses_at_most_one_block_beyond_alignment":
            # part (a) is the claim with its whole-cache premise taken as false; otherwise part (b) failed
            part_a = concrete.violation(invariant.claim, config, rules, n_tokens, make_cache(), witnesses,
                                        dense_premises=False) is not None
            why = _why_eagle(found, sizes, n_tokens, part_a)
        else:
            why = _WHY[name](found, sizes, n_tokens, make_cache())
        out.append({"invariant": name, "why": why})
    return out


def _why_aligned(found, sizes, n_tokens, cache):
    return (f"hit {found.shown['hit']} with A = {sizes.alignment}, N - 1 = {n_tokens - 1} and |H|*h = "
            f"{refimpl.hash_reach(sizes, n_tokens)}, the tokens the request's hashes cover")


def _why_within_hashes(found, sizes, n_tokens, cache):
    return (f"a lookup reads boundary {found.shown['reach']}, past |H|*h = {found.shown['hash_reach']}: "
            f"vLLM raises IndexError")


def _why_valid(found, sizes, n_tokens, cache):
    ref = refimpl.policy_rules("reference")
    hit, r = found.shown["hit"], refimpl.hash_reach(sizes, n_tokens)
    ext = refimpl.group_extents(cache, sizes, r)
    bad = [k for k in range(len(sizes.groups)) if not refimpl.group_serves(cache, sizes, k, hit, ext[k], r, ref)]
    return (f"group(s) {', '.join(map(str, bad))} cannot serve {hit}: "
            + "; ".join(_why_not(cache, sizes, k, hit, ext, r, ref) for k in bad))


def _why_longest(found, sizes, n_tokens, cache):
    return (f"{found.values['y']} > {found.shown['hit']} is a multiple of A = {sizes.alignment}, within "
            f"min(N - 1, |H|*h) and every group serves it (the reference hit)")


def _why_eagle(found, sizes, n_tokens, part_a):
    h0, hit = found.shown["hit_without_speculation"], found.shown["hit"]
    if part_a:
        return (f"without speculation the hit is {h0}, and every group (each dropping EAGLE group with its drop "
                f"unit past it) serves {h0} with speculation too, yet the hit is {hit}")
    return (f"with the whole prompt cached the hit {hit} must be at least floor_A(min(N - 1, |H|*h - D)), with "
            f"A = {sizes.alignment}, N - 1 = {n_tokens - 1}, |H|*h = {refimpl.hash_reach(sizes, n_tokens)} and "
            f"D = {sizes.eagle_unit}")


_WHY = {"hit_is_aligned_and_capped": _why_aligned, "lookup_stays_within_hashes": _why_within_hashes,
        "hit_is_valid_in_every_group": _why_valid, "hit_is_the_longest_valid": _why_longest}


# --------------------------------------------------------------------------------------------------
# the write side
# --------------------------------------------------------------------------------------------------

REPEATS = 3  # repeats of the prompt after the first request: second_repeat_is_stable compares the 2nd and 3rd


def retained(groups, k):
    """What spec group ``k`` of the written cache ``groups`` (``refimpl.Held`` per spec group) holds, read
    from the refimpl's ``written_cache``: every boundary up to ``all_up_to`` at the group's grid when it
    keeps every one, and the single boundaries (positions > 0) it holds besides."""
    g = groups[k]
    cache = refimpl.written_cache(groups)
    grid = g.block if g.kind in (Kind.FULL, Kind.SWA) else g.unit
    singles = {p for p in g.points if p > 0}
    if not g.every:
        singles |= set(range(grid, g.extent + 1, grid))
    kept = sorted(x for x in singles if (not g.every or x > g.extent or x % grid) and cache.has(k, x))
    out = {"group": k, "kind": g.kind.value, "extent": g.extent, "all_up_to": g.extent if g.every else None,
           "grid": grid, "boundaries": kept, "retained_states": refimpl.retained_states(g)}
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


def write_violations(layout, spec, n_tokens, interval, policy, side):
    """The write-side invariants of ``make prove`` that a policy breaks on this prompt (``side``: its
    ``write_side`` section, for the masks the ``why`` names).

    Each verdict is the claim function in ``kvhit.proofs``, evaluated concretely; the sibling tried for
    ``scheduler_and_mask_boundaries_agree``'s longer prompt ``N2`` is the one the section shows."""
    concrete, by_name = _invariants()
    rules = refimpl.policy_rules(policy)
    config = concrete.config_of(layout, spec, interval, write_side=True)
    out = []
    for name in WRITE_SIDE_INVARIANTS:
        found = concrete.violation(by_name[name].claim, config, rules, n_tokens, None,
                                   {"N2": [side["sibling"]["n_tokens"]]})
        if found is not None:
            out.append({"invariant": name, "why": _WHY_WRITTEN[name](found, side)})
    return out


def _why_boundaries(found, side):
    shown = found.shown
    sparse = "; ".join(f"g{g['group']} {g['kind']} keeps " + (runs(g["boundaries"], g["grid"]) or "nothing")
                       for g in side["groups"] if g["all_up_to"] is None)
    why = []
    if shown["first_repeat_hit"] != shown["resume_point"]:
        why.append(f"the first repeat hits {shown['first_repeat_hit']} where every state retained gives "
                   f"{shown['resume_point']}")
    if shown["sibling_hit"] != shown["sibling_hit_dense"]:
        why.append(f"the sibling of {found.values['N2']} tokens hits {shown['sibling_hit']} where every state "
                   f"retained gives {shown['sibling_hit_dense']}")
    return "; ".join(why) + (f" (the masks: {sparse})" if sparse else "")


def _why_stable(found, side):
    hits = found.shown["repeat_hits"]
    return f"repeats 2..{len(hits)} hit {', '.join(map(str, hits[1:]))}"


_WHY_WRITTEN = {"scheduler_and_mask_boundaries_agree": _why_boundaries, "second_repeat_is_stable": _why_stable}


# --------------------------------------------------------------------------------------------------
# the whole explanation
# --------------------------------------------------------------------------------------------------

CACHES = ("written", "dense")


def explain(layout, spec, n_tokens, policies=("reference",), cached=None, retention_interval=0,
            compare=False, cache=None, sibling=None):
    """The explanation of one request as a JSON-ready dict (schema ``docs/explain.schema.json``).

    Args:
        cache: ``"written"`` (default unless ``cached`` is given): what the first request with this prompt
            left on an empty cache, per policy; ``"dense"``: every spec group holds every boundary up to
            ``cached`` (default: the whole prompt).
        retention_interval: vLLM's ``prefix_cache_retention_interval`` (None, 0 or a multiple of ``S``).
        sibling: the longer prompt sharing the ``N`` tokens (default ``N + S``; written cache only).
    """
    if isinstance(n_tokens, bool) or not isinstance(n_tokens, int) or n_tokens < 1:
        raise ValueError(f"a request needs at least one prompt token, got {n_tokens!r}")
    for p in policies:
        refimpl.policy_rules(p)
    if cache is None:
        cache = "dense" if cached is not None else "written"
    if cache not in CACHES:
        raise ValueError(f"unknown cache {cache!r} (known: {', '.join(CACHES)})")
    if cache == "written" and cached is not None:
        raise ValueError("--cached gives a dense cache's extents; use it with --cache dense")
    sizes = refimpl.derive_sizes(layout, spec)
    if cache == "written":
        refimpl.check_retention(sizes, retention_interval)
        if sibling is None:
            sibling = n_tokens + sizes.scheduler_block
        if isinstance(sibling, bool) or not isinstance(sibling, int) or sibling <= n_tokens:
            raise ValueError(f"the sibling must be longer than the prompt ({n_tokens} tokens), got {sibling!r}")
        sides = [write_side(layout, spec, n_tokens, retention_interval, p, sibling) for p in policies]
        writes = {p: refimpl.request_writes(refimpl.derive_sizes(layout, spec, refimpl.policy_rules(p)
                                                                  .scale_replicated),
                                            n_tokens, retention_interval, refimpl.policy_rules(p))
                  for p in policies}
        extents = [g.extent for g in next(iter(writes.values()))]
        makers = {p: (lambda w=writes[p]: refimpl.written_cache(w)) for p in policies}
        assumption = ("what the first request with this prompt, run on an empty cache, left under each "
                      "policy's write side (refimpl.request_writes) with this retention interval; the traces "
                      "are the first repeat")
    else:
        if sibling is not None:
            raise ValueError("--sibling needs the written cache (the write side); drop --cache dense")
        if retention_interval != 0:
            raise ValueError(f"--retention-interval {retention_interval} needs the written cache (a dense cache "
                             f"retains every state); drop --cache dense")
        extents = cache_extents(cached, n_tokens, len(sizes.groups))
        makers = dict.fromkeys(policies, lambda: DenseCache(extents))
        assumption = ("every spec group holds every block boundary up to its extent: what a previous request "
                      "sharing that prefix leaves when every state is retained")
        retention_interval = None
    traces = [policy_trace(layout, spec, n_tokens, makers[p], p) for p in policies]
    out = {
        "schema": SCHEMA_ID,
        "input": {
            "layout": to_json(layout),
            "n_tokens": n_tokens,
            "speculation": {"mode": spec.mode.value, "num_speculative_tokens": spec.num_speculative_tokens,
                            "multi_module_mtp": spec.multi_module_mtp},
            "retention_interval": retention_interval,
            "cache": {"kind": cache, "extents": list(extents), "assumption": assumption},
        },
        "sizes": sizes_section(layout, sizes, n_tokens),
        "policies": traces,
    }
    if cache == "written":
        for side, t in zip(sides, traces):
            assert side["first_repeat"]["hit"] == t["hit"], "the first repeat's trace disagrees with repeat"
        out["write_side"] = {"retention_interval": retention_interval, "sibling_tokens": sibling,
                             "repeats": REPEATS, "policies": sides}
    if compare:
        out["comparison"] = []
        for i, t in enumerate(traces):
            found = violations(layout, spec, n_tokens, makers[t["policy"]], t["policy"])
            entry = {"policy": t["policy"], "hit": t["hit"], "violations": found}
            if cache == "written":
                found += write_violations(layout, spec, n_tokens, retention_interval, t["policy"], sides[i])
                entry.update(second_repeat=sides[i]["second_repeat"]["hit"], sibling=sides[i]["sibling"]["hit"])
            out["comparison"].append(entry)
    return out


# --------------------------------------------------------------------------------------------------
# text
# --------------------------------------------------------------------------------------------------

def runs(xs, step):
    """Sorted positions as text, a run of three or more ``step`` apart written ``first..last``."""
    out, i = [], 0
    while i < len(xs):
        j = i
        while j + 1 < len(xs) and xs[j + 1] - xs[j] == step:
            j += 1
        out += [f"{xs[i]}..{xs[j]}"] if j - i >= 2 else [str(x) for x in xs[i:j + 1]]
        i = j + 1
    return ", ".join(out)


def _compact(t):
    """A trace in one line per pass: each group's candidate."""
    if t["coordinator"] == "reference":
        return [f"{t['why']}"]
    out = []
    for p in t["passes"]:
        out.append(f"pass {p['index']} from {p['start']}: " + ", ".join(
            f"g{s['group']} {s['kind']} {'trim' if s['action'] == 'trim' else 'at ' + str(s['bound'])}"
            f"{' drop' if s['drop'] and s['result'] != s['found'] else ''} -> {s['candidate_after']}" for s in p["steps"]) + f" => {p['end']}")
    return out


def _held(g):
    if g["all_up_to"] is not None:
        text = f"every {g['grid']}-token boundary up to {g['all_up_to']}"
        if g["boundaries"]:
            text += " and " + runs(g["boundaries"], g["grid"])
        return text
    text = runs(g["boundaries"], g["grid"]) or "nothing"
    if "tails" in g and g["tails"]["ends"]:
        text += f" (tails of {g['tails']['need']} blocks ending at {', '.join(map(str, g['tails']['ends']))}"
        text += f"; every {g['tails']['period']} tokens)" if g["tails"]["period"] else ")"
    count = g["retained_states"]
    return text + f": {count} " + ("block" if g["kind"] == "swa" else "state") + ("" if count == 1 else "s")


def _render_write_side(ws, sz, add):
    r = ws["retention_interval"]
    add("")
    add(f"write side (retention interval {'none (dense)' if r is None else r}; the first request ran on an empty "
        f"cache; a junction of -1 is none)")
    for side in ws["policies"]:
        add(f"  policy {side['policy']}")
        add(f"    replay boundaries     {', '.join(map(str, side['replay_boundaries']))}")
        add(f"    cacheable tokens      " + ", ".join(f"g{k} {c}" for k, c in enumerate(side["cacheable_tokens"])))
        add(f"    retained after the first request (boundaries > 0)")
        for g in side["groups"]:
            kind = sz["spec_groups"][g["group"]]["kind"]
            add(f"      g{g['group']} {kind:<6} {_held(g)}")
        if side["retained_states"]:
            add(f"    retained states       {side['retained_states']} (sliding-window blocks and Mamba states)")
        first, second, near = side["first_repeat"], side["second_repeat"], side["sibling"]
        add(f"    every state retained  the prompt would hit {side['dense_hit']} (the read side's resume point); "
            f"the sibling {near['dense_hit']}")
        add(f"    first repeat          {first['hit']} (the trace above); it records junction {first['junction']}")
        add(f"    second repeat         {second['hit']} (on the cache after the first repeat's write, junction "
            f"{second['after_junction']}); records junction {second['junction']}")
        for line in _compact(second["trace"]):
            add(f"                          {line}")
        add(f"    sibling N2 = {near['n_tokens']:<8} {near['hit']} (on the first request's cache)")
        for line in _compact(near["trace"]):
            add(f"                          {line}")
        add(f"    repeats 1..{len(side['repeat_hits'])}          {', '.join(map(str, side['repeat_hits']))}")


def render(report, layout):
    """The explanation as a person reads it."""
    inp, sz = report["input"], report["sizes"]
    spec = inp["speculation"]
    n = inp["n_tokens"]
    lines = []
    add = lines.append
    add(f"layout {layout.name or '(file)'}: " + " + ".join(describe_group(g) for g in layout.groups)
        + f"; DCP {layout.dcp}; prefix_match_unit {layout.prefix_match_unit or 'none (GCD rule)'}")
    sp = spec["mode"]
    if sp != "none":
        sp += (f", num_speculative_tokens {spec['num_speculative_tokens']}"
               + (", multi-module MTP" if spec["multi_module_mtp"] else ""))
    add(f"request: N = {n} prompt tokens; speculation {sp}")
    ext = inp["cache"]["extents"]
    if inp["cache"]["kind"] == "dense":
        add("cache: " + (f"every spec group holds every boundary up to {ext[0]}" if len(set(ext)) == 1 else
                         "spec group k holds every boundary up to " + ", ".join(map(str, ext)))
            + " (--cache dense: every state retained)")
    else:
        r = inp["retention_interval"]
        add(f"cache: what the first request of these {n} tokens left on an empty cache under each policy's write "
            f"side, retention interval {'none (dense)' if r is None else r}; each policy's trace below is the "
            f"first repeat")
    add("")
    add("derived sizes")
    add(f"  effective blocks    {', '.join(map(str, sz['effective_blocks']))}"
        + (f" (DCP {layout.dcp} scales sharded groups)" if layout.dcp > 1 else ""))
    add(f"  scheduler block S   {sz['scheduler_block']} (lcm of the effective blocks)")
    add(f"  hash unit h         {sz['hash_block']} ({sz['hash_block_rule']})")
    add(f"  alignment A         {sz['alignment']} ({sz['alignment_rule']})")
    if spec["mode"] != "none":
        add(f"  lookahead           L = {sz['hash_lookahead']} hash, Lp = {sz['prefill_lookahead']} prefill")
    add(f"  hashes |H|          {sz['num_hashes']} = (N - L) // h = ({n} - {sz['hash_lookahead']}) // "
        f"{sz['hash_block']}; they cover |H|*h = {sz['hash_reach']}")
    add(f"  max hit             N - 1 = {sz['max_cache_hit_length']}; cap min(N - 1, |H|*h) = {sz['cap']}")
    add("  spec groups (lookup order)")
    for g in sz["spec_groups"]:
        extra = [f"window {g['window']}"] if g["window"] else []
        extra += [f"chunk {g['chunk']}"] if g["chunk"] else []
        if g["drops"]:
            extra.append(f"EAGLE drop, margin {g['margin']}")
        if g["fine"]:
            extra.append("looked up at hash granularity")
        add(f"    {g['index']}: {g['kind']} {g['block']} <- KV-cache group(s) "
            f"{', '.join(map(str, g['members']))}" + (f"; {'; '.join(extra)}" if extra else ""))
    if spec["mode"] == "drop":
        add(f"  eagle unit D        {sz['eagle_unit']} (largest margin of a dropping group)")
    for t in report["policies"]:
        add("")
        add(f"policy {t['policy']} ({t['coordinator']}): hit {t['hit']}"
            + (" on the first repeat" if "write_side" in report else ""))
        if t["coordinator"] == "reference":
            add(f"  cap {t['cap']}; full-attention cached prefixes "
                + (", ".join(f"g{k} {e}" for k, e in enumerate(t['extents'])
                             if sz['spec_groups'][k]['kind'] == 'full') or "none")
                + f"; the scan starts at {t['top_is']} {t['top']}")
            for c in t["checked"]:
                add(f"  at {c['x']}: " + ("every group serves it" if c["serves"] else "; ".join(
                    f"g{g['group']} {g['why']}" for g in c["groups"] if not g["serves"])))
            add(f"  -> {t['hit']}: {t['why']}")
            continue
        add(f"  M = N - 1 = {t['max_length']}")
        for p in t["passes"]:
            add(f"  pass {p['index']} from {p['start']}:")
            for s in p["steps"]:
                add(f"    g{s['group']} {s['kind']:<6} {s['why']}")
            add(f"    => {p['end']}: {p['stop']}")
        add(f"  -> {t['hit']}" + (f" (reads up to boundary {t['reach']}, past |H|*h = {sz['hash_reach']})"
                                  if t["reach"] > sz["hash_reach"] else ""))
    if "write_side" in report:
        _render_write_side(report["write_side"], sz, add)
    if "comparison" in report:
        add("")
        add("comparison" + (" (first repeat, second repeat, sibling)" if "write_side" in report else ""))
        width = max(len(c["policy"]) for c in report["comparison"])
        for c in report["comparison"]:
            verdict = "; ".join(v["invariant"] for v in c["violations"]) or "no invariant violated"
            hits = f"{c['hit']:>8}"
            if "second_repeat" in c:
                hits += f" {c['second_repeat']:>8} {c['sibling']:>8}"
            add(f"  {c['policy']:<{width}}  {hits}  {verdict}")
            for v in c["violations"]:
                add(f"  {'':<{width}}  {'':>{len(hits)}}    {v['invariant']}: {v['why']}")
    return "\n".join(lines)
