"""``kvhit diff POLICY_A POLICY_B``: where two policies' hits can differ, decided by Z3.

For every configuration of the default prove domain on a catalogue layout (``kvhit.spec.catalogue``; the
speculative settings of :data:`kvhit.proofs.domains.SPECULATIONS` and, on the write side,
:data:`~kvhit.proofs.domains.WRITE_SPECULATIONS`) one claim is checked:

* read side (:func:`read_hits_agree`): on the arbitrary cache of the read-side invariants, the two hits
  are equal for every prompt length and cache state;
* write side (:func:`first_repeat_hits_agree`, the write-side configurations): after one request on an
  empty cache, each policy under its own write side, the resend hits the same under both.

A refuted claim is a difference, shrunk by :mod:`kvhit.proofs.findings`' minimisation (the least ``N``,
then the fewest cached blocks), and its hits are those replayed through refimpl. Each check is a bounded
query under the proofs' resource limits (:data:`kvhit.proofs.model.PORTFOLIO`): an undecided one is an
error, never "identical".

The two policies' hits are each the spec's ``hit_tokens`` under that policy's own sizes (a view of the
context with the policy's rules, :func:`_under`); the rules the check itself is run with
(:data:`~kvhit.spec.policy.VLLM_0_33`, which the minimisation of :mod:`kvhit.proofs.findings` checks under)
only size the symbolic cache, and the claim never reads them.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import time
from dataclasses import dataclass, replace
from functools import partial

from kvhit.spec.catalogue import CATALOGUE
from kvhit.spec.domain import Mode, Speculation
from kvhit.spec.policy import ALL_POLICIES, VLLM_0_33, Rules
from kvhit.spec.terms import and_, eq

from . import findings
from .domains import HEAVY, SPECULATIONS, read_configs, write_configs
from .model import Config, Invariant, _rlimit_count, accepts, check, isolated_map, runs_needed

READ = "read"
FIRST_REPEAT = "first repeat"


def _under(ctx, rules: Rules, speculation: Speculation | None = None):
    """``ctx`` (the same prompt, cache and symbols) seen under ``rules`` (and ``speculation``, if given,
    instead of the configuration's): its sizes and hits are theirs."""
    view = copy.copy(ctx)
    view.rules = rules
    if speculation is not None:
        view.config = replace(ctx.config, speculation=speculation)
    return view


def _hit(view, rules: Rules, cache, ctx=None):
    """``(hit, converged)`` of ``rules`` on ``cache`` (the spec's ``hit_tokens`` under the sizes of
    ``view``, a context :func:`_under` the policy), showing on ``ctx`` (default: ``view``) the hit and whether
    a lookup read past the request's hashes (IndexError in vLLM: F1)."""
    ctx = view if ctx is None else ctx
    sizes = view.sizes()
    hit, reach, _, converged = view.P.hit_tokens(cache, sizes, ctx.n, rules)
    ctx.show(f"hit {rules.name}", hit)
    ctx.show(f"past hashes {rules.name}", reach > view.P.num_hashes(sizes, ctx.n) * sizes.hash_block)
    return hit, converged


def read_hits_agree(ctx, a: Rules, b: Rules):
    """For every prompt length N >= 1 and cache state: hit_A == hit_B (each policy's hit_tokens on the
    same cache, under its own sizes), wherever both hit computations converge."""
    (hit_a, ok_a), (hit_b, ok_b) = (_hit(_under(ctx, rules), rules, ctx.cache, ctx) for rules in (a, b))
    return and_(ok_a, ok_b), eq(hit_a, hit_b)


def first_repeat_hits_agree(ctx, a: Rules, b: Rules, speculation_b: Speculation | None = None):
    """For every N, after one request with prompt N has run on an empty cache and been cached under each
    policy's own write side (retention interval R), a resend of the N tokens hits the same under A as
    under B (hit_A(written_A(N)) == hit_B(written_B(N))), wherever both hit computations converge; B in
    ``speculation_b``'s mode if given (the same drafter served another way: an upgrade that moves an EAGLE
    drafter from the drop to lookahead hashes)."""
    hits = []
    for rules, speculation in ((a, None), (b, speculation_b)):
        view = _under(ctx, rules, speculation)
        written = view.written(view.P.request_writes(view.sizes(), ctx.n, ctx.config.retention, rules))
        hits.append(_hit(view, rules, written, ctx))
    (hit_a, ok_a), (hit_b, ok_b) = hits
    return and_(ok_a, ok_b), eq(hit_a, hit_b)


def _per_hit(rules: Rules, config: Config) -> int:
    """The cached runs one hit of ``rules`` relies on (:func:`kvhit.proofs.model.runs_needed`'s count)."""
    return runs_needed(Invariant("one hit", read_hits_agree, "diff", witnesses=0), rules, config) - 1


def agreement(a: Rules, b: Rules, config: Config, mode_b: Mode | None = None) -> Invariant:
    """The claim that ``a`` and ``b`` hit alike on ``config`` (``b`` in ``mode_b`` if given: write side
    only), as an invariant checked under :data:`VLLM_0_33`: the symbolic cache gets the runs both hits rely
    on (one per lookup place of each, plus the leading run), counted as witnesses beyond the one hit the
    check's own rules size."""
    if config.write_side:
        speculation_b = None if mode_b is None else speculation_in(config, mode_b)
        return Invariant(f"first_repeat_hits_agree[{a.name},{b.name}]",
                         partial(first_repeat_hits_agree, a=a, b=b, speculation_b=speculation_b), "diff",
                         write_side=True, witnesses=0)
    if mode_b is not None:
        raise ValueError("another mode for B is compared on the write side only: on the read side the two "
                         "modes' block hashes cover different tokens, so one cache state means two things")
    extra = max(0, _per_hit(a, config) + _per_hit(b, config) - _per_hit(VLLM_0_33, config))
    return Invariant(f"read_hits_agree[{a.name},{b.name}]", partial(read_hits_agree, a=a, b=b), "diff",
                     witnesses=extra)


def speculation_in(config: Config, mode: Mode) -> Speculation:
    """The configuration's drafter (its draft tokens and MTP modules) served in ``mode``."""
    return replace(config.speculation, mode=mode, label="")


def mode_of(config: Config) -> str:
    """The speculative mode as ``kvhit prove`` labels it (``none``, ``lookahead Lp=2 mtp2``, ``drop Lp=1``)."""
    return config.speculation.describe()


def side_of(config: Config) -> str:
    if not config.write_side:
        return READ
    return f"{FIRST_REPEAT} R={'dense' if config.retention is None else config.retention}"


def domain(layouts=(), modes=(), mode_b: Mode | None = None) -> list[Config]:
    """The configurations diffed: the default prove domain's on catalogue layouts (at every DCP size it has),
    speculation none, lookahead L = 1 and 2, drop (and, on the write side, drop with two MTP modules),
    restricted to ``layouts`` (catalogue names) and ``modes`` (``none``, ``lookahead``, ``drop``) if given;
    with ``mode_b``, the write-side ones whose drafter A serves in the other EAGLE-family mode."""
    catalogue = set(CATALOGUE) - set(HEAVY)
    read = [c for c in read_configs() if c.speculation in SPECULATIONS]
    out = [c for c in read + write_configs() if c.layout.name in catalogue]
    if mode_b is not None:
        out = [c for c in out if c.write_side and c.speculation.mode not in (Mode.NONE, mode_b)]
    if layouts:
        out = [c for c in out if c.layout.name in layouts]
    if modes:
        out = [c for c in out if c.speculation.mode.value in modes]
    return out


@dataclass
class Row:
    """One configuration's answer: ``identical``, or the least ``N`` (then the fewest cached blocks on the
    read side) where the two policies' hits differ, and both hits there."""

    config: Config
    identical: bool
    policies: tuple
    n: int | None = None
    hits: dict | None = None
    cache: dict | None = None
    cached_blocks: int | None = None
    past_hashes: tuple = ()  # the policies whose lookups read past the hashes there (IndexError in vLLM)
    mode_b: str | None = None  # B's mode, where it is not the configuration's (``kvhit diff --b-mode``)
    seconds: float = 0.0
    rlimit: int = 0

    def as_json(self) -> dict:
        out = {"layout": self.config.layout.name, "dcp": self.config.layout.dcp, "mode": mode_of(self.config),
               "mode_b": self.mode_b or mode_of(self.config),
               "side": READ if not self.config.write_side else FIRST_REPEAT,
               "retention": self.config.retention if self.config.write_side else None,
               "identical": self.identical, "seconds": round(self.seconds, 3), "rlimit": self.rlimit}
        if not self.identical:
            out.update({"N": self.n, "hits": self.hits, "reads_past_hashes": list(self.past_hashes)})
            if not self.config.write_side:
                out.update({"cached_blocks": self.cached_blocks, "cache": self.cache})
        return out


class Undecided(RuntimeError):
    """A configuration left undecided: a check Z3 did not decide within the resource limits, a counterexample
    that did not replay through refimpl, or an error of the spec on it."""


def diff_one(a: Rules, b: Rules, config: Config, mode_b: Mode | None = None) -> Row:
    """Decide whether ``a`` and ``b`` (in ``mode_b`` if given) can hit differently on ``config``; the least
    difference if so."""
    start, units = time.perf_counter(), _rlimit_count()
    invariant = agreement(a, b, config, mode_b)
    verdict, _, cex, _ = check(invariant, VLLM_0_33, config)
    row = Row(config, verdict == "PROVED", (a.name, b.name),
              mode_b=None if mode_b is None else speculation_in(config, mode_b).describe())
    if verdict not in ("PROVED", "REFUTED"):
        raise Undecided(f"{config.label}: {verdict} (within the resource limits of proofs/model.py::PORTFOLIO) "
                        f"{cex or ''}")
    if verdict == "REFUTED":
        try:
            least = findings.smallest_counterexample(invariant, config, cex["N"])
            least = findings.smallest_cache(invariant, config, least)
        except RuntimeError as exc:  # a bounded check of the search was undecided
            raise Undecided(str(exc)) from exc
        shown = least["replayed"]
        row.n = least["N"]
        row.hits = {name: shown[f"hit {name}"] for name in row.policies}
        row.past_hashes = tuple(name for name in row.policies if shown[f"past hashes {name}"])
        if not config.write_side:
            row.cache, row.cached_blocks = least["cache"], findings.cached_blocks(least)
    # every check of this configuration, the search's included (one process per configuration: :func:`diff`)
    row.seconds, row.rlimit = time.perf_counter() - start, _rlimit_count() - units
    return row


_WORK: dict = {}  # what the forked workers read: the two policies and the configurations


def _diff_task(index):
    a, b, configs, mode_b = _WORK["task"]
    try:
        return index, diff_one(a, b, configs[index], mode_b), None
    except Exception as exc:  # reported by the parent, with the configuration
        return index, None, f"{configs[index].label}: {type(exc).__name__}: {exc}"


def diff(a: Rules, b: Rules, configs: list[Config], jobs: int | None = None, mode_b: Mode | None = None) -> list[Row]:
    """Every configuration's :class:`Row` (``b`` in ``mode_b`` if given), each decided in a process of its
    own (so its checks' resource counts do not depend on what else ran:
    :func:`kvhit.proofs.model.isolated_map`)."""
    _WORK["task"] = (a, b, configs, mode_b)
    try:
        done = isolated_map(_diff_task, list(range(len(configs))), jobs or min(os.cpu_count() or 1, 4))
    finally:
        _WORK.clear()
    errors = [error for _, _, error in sorted(done, key=lambda d: d[0]) if error]
    if errors:
        raise Undecided("; ".join(errors))
    return [row for _, row, _ in sorted(done, key=lambda d: d[0])]


def _cache_text(row: Row) -> str:
    if row.config.write_side:  # `kvhit explain LAYOUT N --cache written` shows it
        return "what each policy's own write side left after one request of N tokens"
    runs = [f"g{k}/u{item['unit']} [{s},{e})" for k, lists in sorted(row.cache.items()) for item in lists
            for s, e in item["blocks"]]
    count = row.cached_blocks
    return f"{count} cached block{'s' if count != 1 else ''}{': ' if runs else ''}{' '.join(runs)}"


def table(rows: list[Row]) -> str:
    a, b = rows[0].policies if rows else ("A", "B")
    modes = [mode_of(r.config) + (f" -> {r.mode_b.split()[0]}" if r.mode_b else "") for r in rows]
    width = max([20, *map(len, modes)])
    lines = [f"{'layout':18} {'mode':{width}} {'side':20} {'N':>9} {a:>18} {b:>18}  cache", "-" * 130]
    for r, mode in zip(rows, modes):
        layout = r.config.layout.name + (f" dcp{r.config.layout.dcp}" if r.config.layout.dcp > 1 else "")
        head = f"{layout:18} {mode:{width}} {side_of(r.config):20}"
        if r.identical:
            lines.append(f"{head} {'identical':>9}")
        else:
            hit_a, hit_b = (f"{r.hits[p]}{' (past |H|*h)' if p in r.past_hashes else ''}" for p in (a, b))
            lines.append(f"{head} {r.n:>9} {hit_a:>18} {hit_b:>18}  {_cache_text(r)}")
    if any(r.past_hashes for r in rows):
        lines.append("(past |H|*h): a lookup read a block boundary past the request's hashes, where vLLM raises "
                     "IndexError (F1)")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="kvhit diff", description="Where two policies' hits can differ, "
                                     "per catalogue layout, speculative mode and side (decided by Z3); the "
                                     "least prompt and cache where they do, with both hits")
    parser.add_argument("policy_a", metavar="POLICY_A")
    parser.add_argument("policy_b", metavar="POLICY_B")
    parser.add_argument("--layout", action="append", default=[], metavar="NAME",
                        help="only this catalogue layout, at every DCP size of the domain (repeatable)")
    parser.add_argument("--mode", action="append", default=[], choices=[m.value for m in Mode],
                        help="only this speculative mode (repeatable)")
    parser.add_argument("--b-mode", choices=[Mode.LOOKAHEAD.value, Mode.DROP.value], default=None,
                        help="POLICY_B serves each EAGLE drafter in this mode, POLICY_A in the other one (the "
                        "same draft tokens and MTP modules; first repeats only): e.g. an upgrade from vLLM "
                        "0.32's drop to 0.33's lookahead hashes")
    parser.add_argument("--json", action="store_true", help="print the rows as a JSON list")
    parser.add_argument("--jobs", type=int, default=None, help="worker processes (default: CPUs, at most 4)")
    args = parser.parse_args(argv)
    unknown = [p for p in (args.policy_a, args.policy_b) if p not in ALL_POLICIES]
    if unknown:
        parser.error(f"unknown policy {', '.join(unknown)}; known policies: {', '.join(ALL_POLICIES)}")
    every = {c.layout.name for c in domain()}
    bad = [name for name in args.layout if name not in every]
    if bad:
        parser.error(f"layout {', '.join(bad)} not in the diffed domain (the catalogue layouts of the default "
                     f"prove domain; proofs/domains.py::HEAVY are --extended only): {', '.join(sorted(every))}")
    if args.b_mode is not None and args.policy_a == args.policy_b:
        parser.error("--b-mode needs two different policies: the rows name each hit by its policy")
    mode_b = None if args.b_mode is None else Mode(args.b_mode)
    configs = domain(args.layout, args.mode, mode_b)
    policies = (ALL_POLICIES[args.policy_a], ALL_POLICIES[args.policy_b])

    def settings(c):  # each policy's configuration
        return ((policies[0], c), (policies[1], c if mode_b is None else replace(
            c, speculation=speculation_in(c, mode_b))))

    # a policy without lookahead block hashes (vllm_0_32) has no lookahead mode to compare in
    left = [c for c in configs if not all(accepts(p, pc) for p, pc in settings(c))]
    if left:
        configs = [c for c in configs if c not in left]
        without = sorted({p.name for c in left for p, pc in settings(c) if not accepts(p, pc)})
        hint = "compare --mode drop" if mode_b is None else "serve it the drop: --b-mode " + (
            "drop" if policies[1].name in without else "lookahead")
        print(f"kvhit diff: {len(left)} lookahead configurations left out: {', '.join(without)} has no "
              f"lookahead block hashes (its engine drops; {hint})", file=sys.stderr)
    if not configs:
        parser.error("no configuration of the domain matches --layout, --mode and --b-mode" if mode_b else
                     "no configuration of the domain matches --layout and --mode")
    start = time.perf_counter()
    try:
        rows = diff(*policies, configs, args.jobs, mode_b)
    except Undecided as exc:
        print(f"kvhit diff: error: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps([r.as_json() for r in rows], indent=1))
    else:
        print(table(rows))
    differ = sum(not r.identical for r in rows)
    print(f"{len(rows)} configurations, {differ} differ, {time.perf_counter() - start:.1f} s wall, "
          f"{sum(r.seconds for r in rows):.1f} s of checks, rlimit {sum(r.rlimit for r in rows) / 1e6:.1f} M",
          file=sys.stderr)
    return 0
