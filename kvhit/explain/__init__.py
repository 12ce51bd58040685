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

By concern: :mod:`.arguments` (the command line's values), :mod:`.trace` (the derived sizes and each
policy's trace), :mod:`.write_side` (what the first request left and the repeats on it), :mod:`.compare`
(the invariants, from ``kvhit.proofs``), :mod:`.text` (the text it prints); :func:`explain` here puts them
together.
"""

from kvhit import refimpl
from kvhit.dense import DenseCache
from kvhit.layouts import to_json

from .arguments import CACHES, POLICIES, cache_extents, speculation
from .compare import violations, write_violations
from .text import render
from .trace import policy_trace, sizes_section
from .write_side import REPEATS, write_side

__all__ = ["CACHES", "POLICIES", "SCHEMA_ID", "explain", "render", "speculation"]

SCHEMA_ID = "kvhit.explain/1"


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
