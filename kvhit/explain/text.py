"""The explanation as a person reads it: the text ``kvhit explain`` prints without ``--json``."""

from kvhit.layouts import describe_group


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
        if g["all_from"]:
            text = f"every {g['grid']}-token boundary past {g['all_from']} up to {g['all_up_to']}"
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
        + f"; DCP {layout.dcp}; prefix_match_unit {layout.prefix_match_unit or 'none (GCD rule)'}"
        + (f"; every lookup capped at KV-cache group {layout.aux_cap_group}'s leading whole blocks (auxiliary "
           "outputs)" if layout.aux_cap_group is not None else ""))
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
        if t.get("aux_cap") is not None:
            add(f"  the auxiliary outputs cap it at {t['aux_cap']} (the capped group's leading whole blocks)")
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
