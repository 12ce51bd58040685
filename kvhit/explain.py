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
* ``--compare`` checks each policy's hit against the invariants of ``make prove`` on these concrete values
  (the same checks as ``tests/properties/test_invariants_concrete.py``) and names the ones it violates.

The cache is a read-side assumption: by default every spec group holds every boundary of the prompt, what a
previous identical request leaves when every state is retained. Which states the write side really retains
(retention interval, replay boundaries, the first and second repeat) is not in the spec yet, so it is not in
the trace.
"""

from contextlib import contextmanager
from dataclasses import replace

import kvhit.refimpl.policy as _policy
from kvhit import refimpl
from kvhit.dense import DenseCache
from kvhit.layouts import describe_group, to_json
from kvhit.refimpl import Kind, Mode, Speculation

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


def check_retention_interval(value, layout, sizes):
    """Validate a retention interval as vLLM 0.33 does (``_validate_prefix_cache_retention_interval``):
    ``None`` (dense) or ``0`` always; a positive value only on a layout with a sliding-window or Mamba group,
    and only a multiple of the scheduler block ``S``."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"retention interval must be 'none' or a non-negative integer, got {value!r}")
    if value > 0 and not any(g.kind in (Kind.SWA, Kind.MAMBA) for g in layout.groups):
        raise ValueError(f"retention interval {value} has no effect: the layout has no sliding-window or Mamba "
                         f"group (vLLM raises the same; use 0 or none)")
    if value % sizes.scheduler_block:
        raise ValueError(f"retention interval {value} is not a multiple of the scheduler block "
                         f"{sizes.scheduler_block} (vLLM raises the same)")
    return value


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


def policy_trace(layout, spec, n_tokens, extents, policy):
    rules = refimpl.policy_rules(policy)
    sizes = refimpl.derive_sizes(layout, spec, rules.scale_replicated)
    cache = DenseCache(extents)
    if rules.declarative:
        trace = reference_trace(cache, sizes, n_tokens, rules)
    elif sizes.unitary:
        trace = unitary_trace(cache, sizes, n_tokens, rules)
    else:
        trace = hybrid_trace(cache, sizes, n_tokens, rules)
    final = refimpl.hit_tokens(DenseCache(extents), sizes, n_tokens, rules)
    assert trace["hit"] == final[0], f"{policy}: the traced hit {trace['hit']} is not hit_tokens' {final[0]}"
    trace["policy"] = policy
    return trace


# --------------------------------------------------------------------------------------------------
# invariants, on concrete values
# --------------------------------------------------------------------------------------------------

def violations(layout, spec, n_tokens, extents, policy):
    """The invariants of ``make prove`` that this policy's hit breaks on this request and cache.

    Checked per request: ``hit_is_aligned_and_capped``, ``lookup_stays_within_hashes``,
    ``hit_is_valid_in_every_group``, ``hit_is_the_longest_valid`` and, with speculation on,
    ``eagle_loses_at_most_one_block_beyond_alignment``. (``dcp_scales_only_sharded_groups`` and
    ``hit_loop_terminates`` are about the layout and the loop, not about one hit.)
    """
    ref = refimpl.policy_rules("reference")
    rules = refimpl.policy_rules(policy)
    sizes = refimpl.derive_sizes(layout, spec, rules.scale_replicated)
    hit, reach, _, _ = refimpl.hit_tokens(DenseCache(extents), sizes, n_tokens, rules)
    r = refimpl.hash_reach(sizes, n_tokens)
    a = sizes.alignment
    cache = DenseCache(extents)
    ext = refimpl.group_extents(cache, sizes, r)

    def serves(s, x):
        c = DenseCache(extents)
        return refimpl.serves_all(c, s, x, refimpl.group_extents(c, s, refimpl.hash_reach(s, n_tokens)),
                                  refimpl.hash_reach(s, n_tokens), ref)

    out = []
    broken = ([f"not a multiple of A = {a}"] if hit % a else []) + (["negative"] if hit < 0 else []) \
        + ([f"above N - 1 = {n_tokens - 1}"] if hit > max(n_tokens - 1, 0) else []) \
        + ([f"above |H|*h = {r}, the tokens the request's hashes cover"] if hit > r else [])
    if broken:
        out.append({"invariant": "hit_is_aligned_and_capped", "why": f"hit {hit} is " + " and ".join(broken)})
    if reach > r:
        out.append({"invariant": "lookup_stays_within_hashes",
                    "why": f"a lookup reads boundary {reach}, past |H|*h = {r}: vLLM raises IndexError"})
    if hit and not serves(sizes, hit):
        bad = [k for k in range(len(sizes.groups))
               if not refimpl.group_serves(cache, sizes, k, hit, ext[k], r, ref)]
        out.append({"invariant": "hit_is_valid_in_every_group",
                    "why": f"group(s) {', '.join(map(str, bad))} cannot serve {hit}: "
                           + "; ".join(_why_not(cache, sizes, k, hit, ext, r, ref) for k in bad)})
    ref_hit = refimpl.hit_tokens(DenseCache(extents), sizes, n_tokens, ref)[0]
    if ref_hit > hit and serves(sizes, ref_hit):
        out.append({"invariant": "hit_is_the_longest_valid",
                    "why": f"{ref_hit} > {hit} is a multiple of A = {a}, within min(N - 1, |H|*h) and "
                           f"every group serves it (the reference hit)"})
    if spec.mode is not Mode.NONE:
        sizes0 = refimpl.derive_sizes(layout, refimpl.NO_SPECULATION, rules.scale_replicated)
        h0 = refimpl.hit_tokens(DenseCache(extents), sizes0, n_tokens, rules)[0]
        r0 = refimpl.hash_reach(sizes0, n_tokens)
        bound = max(0, min(n_tokens - 1, r - sizes.eagle_unit)) // a * a
        if h0 <= r and serves(sizes, h0) and hit < h0:
            out.append({"invariant": "eagle_loses_at_most_one_block_beyond_alignment",
                        "why": f"without speculation the hit is {h0}, and every group (each dropping EAGLE "
                               f"group with its drop unit past it) serves {h0} with speculation too, yet the "
                               f"hit is {hit}"})
        elif all(e >= r0 for e in extents) and hit < bound:
            out.append({"invariant": "eagle_loses_at_most_one_block_beyond_alignment",
                        "why": f"with the whole prompt cached the hit must be at least "
                               f"floor_A(min(N - 1, |H|*h - D)) = {bound} (D = {sizes.eagle_unit})"})
    return out


# --------------------------------------------------------------------------------------------------
# the whole explanation
# --------------------------------------------------------------------------------------------------

def explain(layout, spec, n_tokens, policies=("reference",), cached=None, retention_interval=None,
            compare=False):
    """The explanation of one request as a JSON-ready dict (schema ``docs/explain.schema.json``)."""
    if isinstance(n_tokens, bool) or not isinstance(n_tokens, int) or n_tokens < 1:
        raise ValueError(f"a request needs at least one prompt token, got {n_tokens!r}")
    for p in policies:
        refimpl.policy_rules(p)
    sizes = refimpl.derive_sizes(layout, spec)
    retention_interval = check_retention_interval(retention_interval, layout, sizes)
    extents = cache_extents(cached, n_tokens, len(sizes.groups))
    traces = [policy_trace(layout, spec, n_tokens, extents, p) for p in policies]
    out = {
        "schema": SCHEMA_ID,
        "input": {
            "layout": to_json(layout),
            "n_tokens": n_tokens,
            "speculation": {"mode": spec.mode.value, "num_speculative_tokens": spec.num_speculative_tokens,
                            "multi_module_mtp": spec.multi_module_mtp},
            "retention_interval": retention_interval,
            "cache": {"kind": "dense", "extents": list(extents),
                      "assumption": ("every spec group holds every block boundary up to its extent: what a "
                                     "previous request sharing that prefix leaves when every state is "
                                     "retained (the write side is not modelled yet)")},
        },
        "sizes": sizes_section(layout, sizes, n_tokens),
        "policies": traces,
    }
    if compare:
        out["comparison"] = [{"policy": t["policy"], "hit": t["hit"],
                              "violations": violations(layout, spec, n_tokens, extents, t["policy"])}
                             for t in traces]
    return out


# --------------------------------------------------------------------------------------------------
# text
# --------------------------------------------------------------------------------------------------

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
    add("cache: " + (f"every spec group holds every boundary up to {ext[0]}" if len(set(ext)) == 1 else
                     "spec group k holds every boundary up to " + ", ".join(map(str, ext)))
        + " (every state retained; the write side is not modelled yet)")
    if inp["retention_interval"] is not None:
        add(f"retention interval {inp['retention_interval']}: valid; what it retains (and the first/second "
            f"repeat it leads to) needs the write side of the spec, not modelled yet")
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
        add(f"policy {t['policy']} ({t['coordinator']}): hit {t['hit']}")
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
    if "comparison" in report:
        add("")
        add("comparison")
        width = max(len(c["policy"]) for c in report["comparison"])
        for c in report["comparison"]:
            verdict = "; ".join(v["invariant"] for v in c["violations"]) or "no invariant violated"
            add(f"  {c['policy']:<{width}}  {c['hit']:>8}  {verdict}")
            for v in c["violations"]:
                add(f"  {'':<{width}}  {'':>8}    {v['invariant']}: {v['why']}")
    return "\n".join(lines)
