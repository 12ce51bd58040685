"""The ranking as a person reads it (the table) and as JSON (schema ``kvhit.plan/1``)."""

from .evaluation import POLICIES


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
