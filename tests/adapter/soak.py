"""Soundness under load: random multi-request streams through vLLM 0.33's real ``Scheduler`` with
``KVHIT_MODE=enforce``, every lookup checked.

    python -m tests.adapter.soak [--lookups N] [--seed S] [--json OUT] [--table]     (make soak)

Each stream runs on one of the modelled catalogue layouts of ``tests.adapter.serving.CASES`` (in turn), with a
token budget of 2048 or 8192, a KV pool that is either vLLM's default here (room for four requests of the
model length) or 1.05 to 2 times what one request needs (but never in the window where a partial Mamba hit
waits forever, docs/findings.md S2: :func:`s2_floor`), so that the pool evicts and the scheduler preempts, and
vLLM's ``Scheduler`` or, for about half the configurations, its ``AsyncScheduler`` with one step in flight
(async scheduling, ``serving.serve_stream``). Several streams run through one scheduler, as through a server
(``Case.soak_streams``). A stream has two system prompts and 6 to 14 requests (``Case.soak_requests``): new
prompts (a system prompt and a suffix), resends of earlier prompts, longer siblings (an earlier prompt and up
to ``serving.LONGER_SIBLING`` tokens more) and divergent siblings (an earlier prompt cut and continued
differently); each decodes 1 to ``serving.MAX_DECODE`` tokens, and arrives 0 to 3 steps after the one before,
some only once an earlier one finished, so that several are in flight at once.

Every lookup the scheduler makes (``find_longest_cache_hit`` as kvhit's seam answers it) is checked
(``serving.lookup_problems``): every block returned carries the request's hash at its position, every
sliding-window block and Mamba state the hit relies on is a cached block (not a null block), and the hit
is at most ``N - 1``; and the hit is ``refimpl``'s reference hit on the cache the pool held at that lookup
(the generic ``refimpl.hit``, asking the pool only the boundaries it reads: :class:`ReferenceCheck`; with
``KVHIT_MODE=off``, stock vLLM, ``vllm_0_33``'s hit: ``make soak-stock``). A
run fails outright if it checked fewer lookups than kvhit enforced (the observer would have been bypassed).
Counted besides: ``kvhit_enforce_fallbacks_total``, and first-repeat misses: a prompt served three times,
each after the one before finished, whose first repeat hits less than its second; those with a block of
the prompt evicted between the first serve and the first repeat are counted apart, and so are those whose
first repeat decoded more tokens than the first serve (:func:`first_repeat_misses`).

Prints the seed, one summary line and, with ``--table``, a row per layout and condition. Exit status 1 on
an unsound hit, a reference mismatch or a fallback. Deterministic for a seed (vLLM's scheduler is).
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import os
import random
import sys
import tempfile
import time
from collections.abc import Callable

from tests.adapter import serving
from tests.adapter.serving import LONGER_SIBLING, MAX_DECODE, Arrival

DEFAULT_LOOKUPS = 100_000
SOAKED = [name for name, case in serving.CASES.items() if case.soak_streams]
DEFAULT_SEED = 17


@dataclasses.dataclass
class Row:
    """Counts for one layout and condition (token budget, pool, scheduling)."""

    streams: int = 0
    requests: int = 0
    lookups: int = 0
    unsound: int = 0
    reference_mismatches: int = 0
    fallbacks: int = 0
    preemptions: int = 0
    evictions: int = 0
    first_repeats: int = 0
    misses_evicted: int = 0
    # first-repeat misses with no block of the prompt evicted, where the first repeat decoded more tokens than
    # the first serve (the second repeat resumes on what the longer decode cached)
    misses_decoded: int = 0
    misses: int = 0  # the other first-repeat misses
    # lookups whose hit the reference would have changed (checked against another policy: 0 under enforce)
    unlike_reference: int = 0


TOKEN_IDS = range(3, 512)  # the ids serving.tokens draws (the stand-in model runner samples 0 and drafts 1)


def tokens(rng: random.Random, n: int) -> list[int]:
    """``n`` prompt tokens from :data:`TOKEN_IDS`: ``serving.tokens``' ids, drawn by ``random.choices``,
    several times faster than its ``randrange`` per token, which was a fifth of a soak's time."""
    return rng.choices(TOKEN_IDS, k=n)


def _sizes(case: serving.Case):
    """The refimpl sizes of the case's catalogue layout and speculative setting."""
    import kvhit.refimpl as R
    from kvhit.convert import to_refimpl
    from kvhit.spec.catalogue import CATALOGUE

    return R.derive_sizes(to_refimpl(CATALOGUE[case.catalogue]), serving.speculation_of(case))


def s1_unit(case: serving.Case) -> tuple[int, int] | None:
    """``(h, Lp)`` when the case has partial hash hits, a Mamba group and a prefill lookahead ``Lp >= 2``, else
    None. vLLM 0.33 never finishes a prefill there whose prompt ends 1 to ``Lp - 1`` tokens past a multiple of
    the hash unit ``h`` (docs/findings.md, S1: the scheduler must stop a chunk at a hash-unit stop within
    ``Lp`` of the prompt end, and keeps ``Lp`` tokens back), stock and enforce alike, so the soak's prompts
    end elsewhere (one such stream, ``qwen3next_pmu160`` with a 9601-token prompt, once stopped the soak in
    every mode). The scheduler's stops are all multiples of the hash unit there."""
    import kvhit.refimpl as R

    sizes = _sizes(case)
    if sizes.partial_hits and sizes.prefill_lookahead >= 2 and any(g.kind is R.Kind.MAMBA for g in sizes.groups):
        return sizes.hash_block, sizes.prefill_lookahead
    return None


def fine_mamba_groups(case: serving.Case) -> int:
    """How many Mamba groups the case reads at hash granularity (the spec's ``fine`` groups, as
    ``refimpl.mamba_at_hash_granularity`` asks)."""
    import kvhit.refimpl as R

    return sum(sg.kind is R.Kind.MAMBA and sg.fine for sg in _sizes(case).groups)


_S2_FLOOR: dict = {}


def s2_floor(name: str, models_dir: str, budget: int) -> int:
    """The fewest pool blocks the soak gives the case ``name``: vLLM's own minimum (``serving.minimum_pool``),
    and on a layout with Mamba read at hash granularity
    two more per such Mamba group. A resend with a partial Mamba hit needs more blocks than vLLM's
    ``max_memory_usage_bytes`` says one request needs, and on a pool between the two it waits forever, stock
    and enforce alike (docs/findings.md, S2: ``qwen3next_pmu160`` MTP 1 drop on 13 blocks, where the minimum is
    12, once stopped the soak in every mode); the soak's tight pools stay clear of that window."""
    key = (name, budget)
    if key not in _S2_FLOOR:
        case = serving.CASES[name]
        scheduler, _ = serving.build(case, models_dir, budget)
        _S2_FLOOR[key] = serving.minimum_pool(scheduler) + 2 * fine_mamba_groups(case)
    return _S2_FLOOR[key]


def random_stream(rng: random.Random, case: serving.Case, tag: str) -> list[Arrival]:
    """One random stream of requests (see the module docstring)."""
    s1 = s1_unit(case)
    systems = [tokens(rng, max(1, case.system + rng.randrange(-case.system // 4, case.system // 4)))
               for _ in range(2)]
    prompts: list[tuple[str, tuple]] = []  # (key, tokens), in order of first use
    last_of: dict[str, str] = {}  # prompt key -> its latest request id
    arrivals = []
    for i in range(rng.randint(*case.soak_requests)):
        what = rng.choices(("new", "resend", "longer", "diverge"), (35, 35, 15, 15))[0] if prompts else "new"
        after: tuple = ()
        if what == "new":
            toks = tuple(rng.choice(systems) + tokens(rng, rng.randint(*case.suffix)))
        else:
            key, base = rng.choice(prompts)
            if what == "resend":
                toks = base
                if rng.random() < 0.6:
                    after = (last_of[key],)
            elif what == "longer":
                toks = base + tuple(tokens(rng, rng.randint(1, LONGER_SIBLING)))
            else:
                cut = rng.randint(len(base) // 3, len(base) - 1)
                toks = base[:cut] + tuple(tokens(rng, rng.randint(1, len(base) - cut + 500)))
        toks = toks[:case.max_prompt]
        if s1 is not None and 0 < len(toks) % s1[0] < s1[1]:  # S1's lengths (s1_unit)
            toks = toks[:len(toks) - len(toks) % s1[0]]
        key = next((k for k, t in prompts if t == toks), None)
        if key is None:
            key = f"{tag}/p{len(prompts)}"
            prompts.append((key, toks))
        rid = f"{tag}/r{i}"
        if not after and rng.random() < 0.2 and arrivals:
            after = (arrivals[-1].request_id,)
        arrivals.append(Arrival(rid, key, toks, rng.randint(1, MAX_DECODE), after, rng.choice((0, 0, 1, 2, 3))))
        last_of[key] = rid
    return arrivals


def first_repeat_misses(served: list[dict], hashes: dict, observer: serving.Observer) -> tuple[int, int, int, int]:
    """``(first repeats checked, misses after an eviction of the prompt's blocks, misses after a first repeat
    that decoded more tokens than the first serve, other misses)``: prompts served at least three times, each
    serve added after the one before finished.

    A request's decode steps cache more of the prompt's full-attention blocks (and the reference keeps the
    states a resend resumes at on them), so a first repeat that decodes longer than the first serve can
    leave the second repeat more than the first found; the first repeat hits what the second does when
    both follow serves that decoded alike (the spec's write side models one sampled token)."""
    by_prompt = collections.defaultdict(list)
    for s in served:
        by_prompt[s["prompt"]].append(s)
    checked = evicted = decoded = other = 0
    for serves in by_prompt.values():
        if len(serves) < 3:
            continue
        first, repeat, steady = serves[:3]
        if not (repeat["added"] > first["finished"] and steady["added"] > repeat["finished"]):
            continue
        checked += 1
        if repeat["num_cached_tokens"] < steady["num_cached_tokens"]:
            lo = first["lookups"][0]["evictions"] if first["lookups"] else 0
            hi = repeat["lookups"][-1]["evictions"] if repeat["lookups"] else observer.evictions
            if observer.evicted_between(hashes[repeat["request_id"]], lo, hi):
                evicted += 1
            elif repeat["max_tokens"] > first["max_tokens"]:
                decoded += 1
            else:
                other += 1
    return checked, evicted, decoded, other


class ReferenceCheck:
    """Compares every lookup's hit with ``refimpl``'s hit under ``policy`` on the cache the pool held: the
    reference's under enforce, ``vllm_0_33``'s under off (byte-identical to stock vLLM)."""

    def __init__(self, scheduler, case: serving.Case, policy: str = "reference") -> None:
        import kvhit.refimpl as R

        run = {"kv_cache_groups": serving.describe_groups(scheduler), "scheduler": {
            "dcp": scheduler.vllm_config.parallel_config.decode_context_parallel_size,
            "prefix_match_unit": scheduler.vllm_config.cache_config.prefix_match_unit}}
        self.R = R
        self.layout = serving.planned_layout(run)
        self.speculation = serving.speculation_of(case)
        self.policy = policy
        self.sizes = R.derive_sizes(self.layout, self.speculation, R.policy_rules(policy).scale_replicated)
        self.scheduler = scheduler
        self.mismatches: list[str] = []
        self.unlike_reference = 0

    def __call__(self, block_hashes, max_cache_hit_length: int, hit: int) -> None:
        pool = self.R.CacheState(self.pool_oracle(block_hashes))  # one oracle: each boundary asked once
        want = self.R.hit(self.layout, self.speculation, max_cache_hit_length + 1, pool, self.policy)
        if self.policy != "reference":  # the comparison is not the reference's under another name
            self.unlike_reference += hit != self.R.hit(self.layout, self.speculation, max_cache_hit_length + 1,
                                                       pool, "reference")
        if want != hit:
            retained = serving.pool_boundaries(self.scheduler, block_hashes)
            self.mismatches.append(f"N={max_cache_hit_length + 1} hit={hit} {self.policy}={want} pool={retained}")

    def pool_oracle(self, block_hashes) -> Callable[[int, int], bool]:
        """``has(k, x)``: whether the pool holds the request's block hash ending at ``x`` for every KV-cache
        group of spec group ``k``. The same cache as the boundary sets of :func:`serving.pool_boundaries`
        intersected over the spec group's members, asked only for the boundaries the reference reads (the
        pool does not change during a lookup; answers are memoised)."""
        get_cached_block = self.scheduler.kv_cache_manager.block_pool.get_cached_block
        h = self.scheduler.hash_block_size
        members = [sg.members for sg in self.sizes.groups]
        asked: dict[tuple[int, int], bool] = {}

        def has(k: int, x: int) -> bool:
            found = asked.get((k, x))
            if found is None:
                j, rest = divmod(x, h)
                found = asked[k, x] = (not rest and 0 < j <= len(block_hashes) and all(
                    get_cached_block(block_hashes[j - 1], [m]) is not None for m in members[k]))
            return found

        return has


# The policy every lookup is compared with, per KVHIT_MODE: enforce answers with the reference; off and shadow
# are stock vLLM (byte-identical: tests/adapter/test_serving_conditions.py), whose policy is vllm_0_33
# (`make soak-stock`).
POLICY_OF_MODE = {"enforce": "reference", "shadow": "vllm_0_33", "off": "vllm_0_33"}


def fallbacks() -> float:
    return serving.kvhit_counters().get("kvhit_enforce_fallbacks", 0.0)


def soak(lookups: int, seed: int, models_dir: str, cases=None, log=print) -> dict:
    """Streams until ``lookups`` lookups were checked; returns the rows and the totals."""
    rng = random.Random(seed)
    policy = POLICY_OF_MODE[os.environ.get("KVHIT_MODE", "enforce")]
    cases = list(cases or SOAKED)
    rows: dict[tuple, Row] = collections.defaultdict(Row)
    unsound_examples: list[str] = []
    started = time.monotonic()
    total = 0
    config = 0
    while total < lookups:
        name = cases[config % len(cases)]
        budget = serving.BUDGETS[(config // len(cases)) % len(serving.BUDGETS)]
        case = serving.CASES[name]
        pool = None if config % 3 == 0 else round(rng.uniform(1.05, 2.0), 2)
        async_scheduling = rng.random() < 0.5
        config += 1
        condition = (name, budget, "default" if pool is None else "tight", "async" if async_scheduling else "sync")
        row = rows[condition]
        # Sized before the observer wraps the lookups: pool_blocks sizes a pool on stock vLLM (it uninstalls
        # and reinstalls kvhit), and kvhit's uninstall puts vLLM's originals back over any wrapper, so an
        # observer entered earlier would stop seeing lookups and the soak would check none.
        num_gpu_blocks = serving.pool_blocks(case, models_dir, budget, pool, async_scheduling=async_scheduling)
        if num_gpu_blocks is not None:
            num_gpu_blocks = max(num_gpu_blocks, s2_floor(name, models_dir, budget))
        with serving.Observer() as observer:
            scheduler, block_hasher = serving.build(case, models_dir, budget, num_gpu_blocks, async_scheduling)
            observer.attach(scheduler)
            reference = ReferenceCheck(scheduler, case, policy)
            observer.on_lookup = reference
            before = serving.kvhit_counters()
            requests = 0
            for k in range(case.soak_streams):
                tag = f"c{config}s{k}"
                hashes: dict = {}
                stream = random_stream(rng, case, tag)
                try:
                    served = serving.serve_stream(scheduler, block_hasher, stream, observer, keep_hashes=hashes)
                except RuntimeError as e:  # a stream vLLM never finishes: say which, with its prompt lengths
                    raise RuntimeError(f"{e}: stream {tag} of {name} at budget {budget}, {condition[2]} pool, "
                                       f"{condition[3]} scheduling, prompts {[len(a.tokens) for a in stream]}") from e
                requests += len(served)
                row.streams += 1
                row.preemptions += sum(s["preemptions"] for s in served)
                checked, evicted, decoded, other = first_repeat_misses(served, hashes, observer)
                row.first_repeats += checked
                row.misses_evicted += evicted
                row.misses_decoded += decoded
                row.misses += other
                if observer.lookups + total >= lookups:
                    break
        # Every request is looked up when it is first scheduled, and every lookup kvhit enforced went through
        # the observer: fewer checked means its wrapper was replaced and the figures would be vacuous.
        enforced = serving.kvhit_counters().get("vllm:kvhit_lookups", 0.0) - before.get("vllm:kvhit_lookups", 0.0)
        if observer.lookups < max(requests, enforced):
            raise RuntimeError(f"{condition}: {observer.lookups} lookups checked for {requests} requests and "
                               f"{enforced:.0f} enforced lookups: the observer's wrapper was replaced")
        row.requests += requests
        row.lookups += observer.lookups
        row.unsound += len(observer.unsound)
        row.evictions += observer.evictions
        row.fallbacks += int(fallbacks() - before.get("kvhit_enforce_fallbacks", 0.0))
        row.reference_mismatches += len(reference.mismatches)
        row.unlike_reference += reference.unlike_reference
        unsound_examples += observer.unsound[:3] + reference.mismatches[:3]
        total += observer.lookups
    seconds = time.monotonic() - started
    totals = Row()
    for row in rows.values():
        for field in dataclasses.fields(Row):
            setattr(totals, field.name, getattr(totals, field.name) + getattr(row, field.name))
    return {"seed": seed, "seconds": seconds, "policy": policy, "totals": dataclasses.asdict(totals),
            "rows": [{"layout": k[0], "budget": k[1], "pool": k[2], "scheduling": k[3], **dataclasses.asdict(v)}
                     for k, v in sorted(rows.items())],
            "examples": unsound_examples[:20]}


def self_check(models_dir: str) -> dict:
    """Shows that :func:`serving.lookup_problems` can fail: on a resend's lookup (full16, and qwen3next with
    its Mamba state), the blocks as returned, and the same with one block replaced by another prompt's,
    the hit raised to ``N``, full attention one block short, and (qwen3next) the Mamba state replaced by the
    null block; and that :class:`ReferenceCheck` can: the hit as returned, and one alignment unit less.
    ``{layout: {"hit": hit, "variants": {variant: problems}, "reference": {variant: mismatches}}}``."""
    from tests.adapter import scheduler_run

    out = {}
    for name in ("full16", "qwen3next-mtp2-drop"):
        case = serving.CASES[name]
        scheduler, block_hasher = serving.build(case, models_dir, 8192)
        rng = random.Random(name)
        p, q = (tuple(serving.tokens(rng, case.system + case.suffix[1])) for _ in range(2))
        serving.serve_stream(scheduler, block_hasher, [Arrival("p", "p", p), Arrival("q", "q", q, after=("p",))])
        coordinator = scheduler.kv_cache_manager.coordinator

        def lookup(toks):
            request = scheduler_run.new_request(f"probe-{len(toks)}", list(toks), block_hasher)
            blocks, hit = coordinator.find_longest_cache_hit(request.block_hashes, len(toks) - 1)[:2]
            return request.block_hashes, [list(g) for g in blocks], hit

        hashes, blocks, hit = lookup(p)
        other = lookup(q)[1]
        against_reference = ReferenceCheck(scheduler, case)

        def check(variant_blocks, variant_hit):
            return serving.lookup_problems(coordinator, scheduler.hash_block_size, hashes, len(p) - 1,
                                           variant_blocks, variant_hit)

        swapped = [list(g) for g in blocks]
        swapped[0][0] = other[0][0]
        short = [list(g) for g in blocks]
        short[0] = short[0][:-1]
        variants = {"as returned": check(blocks, hit), "another prompt's block": check(swapped, hit),
                    "hit N": check(blocks, len(p)), "full attention one block short": check(short, hit)}
        if len(blocks) > 1:
            nulled = [list(g) for g in blocks]
            nulled[1][-1] = scheduler.kv_cache_manager.block_pool.null_block
            variants["null Mamba state"] = check(nulled, hit)
        reference = {}
        unit = against_reference.sizes.alignment
        for variant, claimed in (("as returned", hit), ("one alignment unit less", hit - unit)):
            against_reference.mismatches = []
            against_reference(hashes, len(p) - 1, claimed)
            reference[variant] = against_reference.mismatches
        out[name] = {"hit": hit, "variants": variants, "reference": reference}
    return out


def summary(result: dict) -> str:
    t = result["totals"]
    return (f"soak: seed {result['seed']}: {t['lookups']} lookups checked in {result['seconds']:.1f} s "
            f"({t['streams']} streams, {t['requests']} requests, {t['preemptions']} preemptions, "
            f"{t['evictions']} evictions): {t['unsound']} unsound, {t['reference_mismatches']} "
            f"{result.get('policy', 'reference')} mismatches, {t['fallbacks']} fallbacks; {t['first_repeats']} first repeats, "
            f"{t['misses']} first-repeat misses ({t['misses_evicted']} more after an eviction of the prompt's "
            f"blocks, {t['misses_decoded']} after a first repeat that decoded longer than the first serve)")


def table(result: dict) -> str:
    head = (f"{'layout':32} {'budget':>6} {'pool':>7} {'sched':>5} {'streams':>7} {'lookups':>8} {'unsound':>7} "
            f"{'ref':>4} {'fallb':>5} {'preempt':>7} {'evict':>7} {'repeats':>7} {'miss':>4} {'miss/ev':>7} "
            f"{'miss/dec':>8}")
    lines = [head, "-" * len(head)]
    for r in result["rows"]:
        lines.append(f"{r['layout']:32} {r['budget']:>6} {r['pool']:>7} {r['scheduling']:>5} {r['streams']:>7} "
                     f"{r['lookups']:>8} "
                     f"{r['unsound']:>7} {r['reference_mismatches']:>4} {r['fallbacks']:>5} "
                     f"{r['preemptions']:>7} {r['evictions']:>7} {r['first_repeats']:>7} {r['misses']:>4} "
                     f"{r['misses_evicted']:>7} {r['misses_decoded']:>8}")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lookups", type=int,
                        default=int(os.environ.get("KVHIT_SOAK_LOOKUPS", DEFAULT_LOOKUPS)))
    parser.add_argument("--seed", type=int, default=int(os.environ.get("KVHIT_SOAK_SEED", DEFAULT_SEED)))
    parser.add_argument("--case", action="append", help="only these layouts (serving.CASES)")
    parser.add_argument("--json", help="write the result here")
    parser.add_argument("--table", action="store_true", help="print a row per layout and condition")
    parser.add_argument("--self-check", metavar="OUT", help="first write self_check()'s result here")
    args = parser.parse_args(argv)
    os.environ.setdefault("KVHIT_MODE", "enforce")
    os.environ.setdefault("VLLM_PLUGINS", "kvhit")
    print(f"soak: seed {args.seed}, {args.lookups} lookups, KVHIT_MODE={os.environ['KVHIT_MODE']}", flush=True)
    serving.setup_environment()
    with tempfile.TemporaryDirectory() as models_dir:
        from tests.adapter import scheduler_run

        scheduler_run.write_models(models_dir)
        if args.self_check:
            with open(args.self_check, "w") as f:
                json.dump(self_check(models_dir), f, indent=1)
        result = soak(args.lookups, args.seed, models_dir, args.case)
    result["kvhit_counters"] = serving.kvhit_counters()
    if args.table:
        print(table(result))
    for example in result["examples"]:
        print("  unsound:", example)
    print(summary(result), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    t = result["totals"]
    return 1 if t["unsound"] or t["reference_mismatches"] or t["fallbacks"] else 0


if __name__ == "__main__":
    sys.exit(main())
