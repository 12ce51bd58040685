"""``--compare``: the invariants of ``make prove`` a policy's hit breaks on the explained request, each decided by
its claim function in ``kvhit.proofs`` (evaluated concretely by ``kvhit.proofs.concrete``); the ``why`` of a
violation renders what the claim showed."""

from kvhit import refimpl

from .text import runs
from .trace import why_not


# The invariants of ``make prove`` that speak of one request's hit, in the order the comparison names them.
# (``dcp_scales_only_sharded_groups`` and ``hit_loop_terminates`` are about the layout and the loop, not about
# one hit; the other write-side claims are about streams of requests explain does not trace.)
READ_SIDE_INVARIANTS = ("hit_is_aligned_and_capped", "lookup_stays_within_hashes", "hit_is_valid_in_every_group",
                        "hit_is_the_longest_valid", "eagle_loses_at_most_one_block_beyond_alignment")
WRITE_SIDE_INVARIANTS = ("scheduler_and_mask_boundaries_agree", "second_repeat_is_stable")


def _invariants():
    """``kvhit.proofs.concrete`` and the invariants by name (imported here: only ``--compare`` evaluates them;
    replaying a claim concretely needs no solver, so z3 stays unimported)."""
    from kvhit.proofs import concrete
    from kvhit.proofs.runner import BY_NAME

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
            + "; ".join(why_not(cache, sizes, k, hit, ext, r, ref) for k in bad))


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
