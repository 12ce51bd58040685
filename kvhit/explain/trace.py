"""How each policy derives the hit of one request: the derived sizes and the traces of vLLM's Hybrid and
Unitary coordinators and of the reference, every number the generated refimpl's own (its ``hybrid_pass`` and
``lookup`` recorded while ``hybrid_hit_tokens`` runs; see :mod:`kvhit.explain`)."""

from contextlib import contextmanager
from dataclasses import replace

import kvhit.refimpl.policy as _policy
from kvhit import refimpl
from kvhit.refimpl import Kind


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
    (_, _, _, _, bound, drop, _), (result, reach) = call
    found = original_lookup(cache, sizes, k, hashes, bound, False, rules)[0] if drop else result
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
    return {"coordinator": "hybrid", "max_length": refimpl.max_length_within_hashes(sizes, n_tokens, rules),
            "aux_cap": _aux_cap(cache, sizes, n_tokens), "passes": out, "hit": hit, "reach": reach,
            "longest": longest}


def _aux_cap(cache, sizes, n_tokens):
    """The auxiliary outputs' cap on the lookup (``refimpl.lookup_cap``), or None on a layout without one."""
    if sizes.cap_group is None:
        return None
    return refimpl.lookup_cap(cache, sizes, refimpl.hash_reach(sizes, n_tokens))


def unitary_trace(cache, sizes, n_tokens, rules):
    """vLLM's Unitary coordinator: one lookup at ``N - 1`` (``refimpl.unitary_hit_tokens``, recorded)."""
    calls = []
    with _tapped("lookup", lambda a, o: calls.append((a, o))) as original_lookup:
        hit, reach, longest, _ = _policy.unitary_hit_tokens(cache, sizes, n_tokens, rules)
    m = refimpl.capped_length(cache, sizes, n_tokens, rules)
    hashes = refimpl.num_hashes(sizes, n_tokens)
    step = _lookup_step(0, sizes.groups[0], sizes, rules, cache, hashes, m, calls[-1], hit, original_lookup)
    step["verified_after"] = [step["drop"]]
    missing = [what for what, on in (("no eagle margin", rules.unitary_margin), ("no cap by the hashes",
                                                                                rules.cap_at_hashes)) if not on]
    step["why"] += ("; one KV-cache group: " + " and ".join(missing)
                    if sizes.groups[0].drops and missing else "; one KV-cache group")
    return {"coordinator": "unitary", "max_length": refimpl.max_length_within_hashes(sizes, n_tokens, rules),
            "aux_cap": _aux_cap(cache, sizes, n_tokens),
            "passes": [{"index": 1, "start": m, "first": True, "steps": [step], "end": hit,
                        "stop": "one lookup"}],
            "hit": hit, "reach": reach, "longest": longest}


def why_not(cache, sizes, k, x, extents, reach, ref):
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
    if sizes.cap_group is not None:
        limits.append(("the auxiliary outputs' cap", refimpl.lookup_cap(cache, sizes, reach)))
    top_name, top = min(limits, key=lambda t: t[1])
    a = sizes.alignment

    def check(x):
        groups = []
        for k in range(len(sizes.groups)):
            ok = refimpl.group_serves(cache, sizes, k, x, extents[k], reach, rules)
            groups.append({"group": k, "serves": ok,
                           "why": "serves it" if ok else why_not(cache, sizes, k, x, extents, reach, rules)})
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
