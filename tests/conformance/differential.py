"""Differential comparison of a vLLM release's policy with that release's own classes: ``vllm_0_33``
against vLLM 0.33.0, ``vllm_0_32`` against 0.32.0 (whichever the venv has: :data:`.vllm_harness.SEAMS`).

A *scenario* is a layout, a speculative setting, a retention interval, a block-pool size and a stream of
operations (serve a prompt, probe a prompt, evict cached blocks) run through :class:`VllmHarness`. Before
every lookup vLLM makes (a serve's admission, a probe) the cache state is read out of vLLM's ``BlockPool``
for the looked-up request's own block hashes, exactly as the lookup reads it (``get_cached_block`` over the
KV-cache groups of each spec group), and the generated refimpl computes the policy's hit on that state.
The comparison is explicit:

* **hit**: vLLM's ``num_computed_tokens`` equals the model's hit, and vLLM's ``shared_prefix_boundary``
  equals the model's ``longest`` when it is past the hit (0 otherwise);
* **crash**: vLLM raises ``IndexError`` during the lookup exactly when the model's lookups read a block
  boundary past the request's hashes (``reach > |H| * h``, finding F1); any other exception is a mismatch;
* **sizes**: vLLM's resolved ``S``, ``h``, ``A``, partial-hit flag, effective blocks and spec groups equal
  :func:`derive_sizes`;
* **acceptance**: a configuration the spec accepts, vLLM accepts, and the other way round.

A mismatch raises :class:`Mismatch` with the layout, the request stream, the cache state and both outputs.
Known divergences would live in :data:`KNOWN_MODEL_GAPS` (a typed table, each tied to a finding or spec
variant); it is empty: every scenario generated so far agrees.
"""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass, field

from kvhit.convert import to_refimpl  # noqa: F401 (the suites import it from here)
from kvhit.refimpl import CacheState, Layout, Speculation, derive_sizes, hit_tokens, policy_rules
from kvhit.refimpl.policy import NO_JUNCTION, Kind, chunk_stops, num_hashes

from .vllm_harness import SEAMS, VLLM_VERSION, SchedulingStalled, VllmHarness, drop_eagle_group_ids

VLLM_0_33 = policy_rules("vllm_0_33")
POLICY = policy_rules(SEAMS.policy)
"""The policy the installed vLLM's classes are compared with (``vllm_0_33`` on 0.33.0, ``vllm_0_32`` on
0.32.0)."""
REFERENCE = policy_rules("reference")
DECODE_STEPS = 2


@dataclass(frozen=True)
class KnownModelGap:
    """A scenario class where vLLM and ``vllm_0_33`` are known to differ, with the reason.

    Attributes:
        name: a short name used in reports.
        finding: the finding (``proofs/expected.py``) or spec variant that explains it.
        applies: ``applies(scenario, lookup)`` is True for the lookups it covers.
    """

    name: str
    finding: str
    applies: object


KNOWN_MODEL_GAPS: tuple[KnownModelGap, ...] = ()
"""Named model gaps kept out of the passing set. Empty: no scenario disagrees."""


class Mismatch(AssertionError):
    """vLLM and the policy compared with it disagree on a scenario."""


# ----------------------------------------------------------------------------------------------------
# Layouts in both worlds
# ----------------------------------------------------------------------------------------------------


def to_harness(layout: Layout) -> dict:
    """The harness's layout dict for a refimpl or spec layout (the same fields). DeepSeek-V4 layouts use
    vLLM's MLA specs (``MLAAttentionSpec`` / ``SlidingWindowMLASpec``), as the model builds them."""
    mla = layout.name.startswith("dsv4")
    groups = []
    for g in layout.groups:
        d = {"kind": g.kind.value, "block_size": g.block_size, "dcp_sharded": bool(g.dcp_sharded),
             "eagle": g.eagle}
        if g.window is not None:
            d["window"] = g.window
        if g.chunk is not None:
            d["chunk"] = g.chunk
        if g.tokens_per_state != 1:
            d["tokens_per_state"] = g.tokens_per_state
        if mla and g.kind.value in ("full", "swa"):
            d["mla"] = True
        groups.append(d)
    out = {"name": layout.name or "random", "dcp": layout.dcp, "prefix_match_unit": layout.prefix_match_unit,
           "groups": groups}
    if layout.aux_cap_group is not None:
        out["aux_cap_group"] = layout.aux_cap_group
    return out


def describe_layout(layout: Layout) -> str:
    parts = []
    for g in layout.groups:
        s = f"{g.kind.value}{g.block_size}"
        if g.window is not None:
            s += f"w{g.window}"
        if g.chunk is not None:
            s += f"c{g.chunk}"
        if g.tokens_per_state != 1:
            s += f"t{g.tokens_per_state}"
        if g.kind.value != "mamba" and not g.dcp_sharded:
            s += "r"
        if g.eagle:
            s += "e"
        parts.append(s)
    extra = f" dcp{layout.dcp}" if layout.dcp > 1 else ""
    extra += f" pmu{layout.prefix_match_unit}" if layout.prefix_match_unit else ""
    return f"{layout.name or 'random'}[{'+'.join(parts)}]{extra}"


# ----------------------------------------------------------------------------------------------------
# Scenarios
# ----------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Op:
    """One step of a request stream.

    ``kind`` is ``serve`` or ``probe`` (a prompt built by ``source``) or ``evict`` (``n`` cached blocks).
    ``source`` is ``new`` (fresh tokens), ``repeat`` (prompt ``of``), ``extend`` (prompt ``of`` plus ``n``
    fresh tokens), ``diverge`` (the first ``cut`` tokens of prompt ``of`` plus ``n`` fresh ones),
    ``truncate`` (the first ``cut`` tokens of prompt ``of``) or ``continue`` (prompt ``of`` with the tokens
    its serve sampled, plus ``n`` fresh ones: the next turn of a chat).
    """

    kind: str
    source: str = "new"
    of: int = 0
    n: int = 0
    cut: int = 0

    def describe(self) -> str:
        if self.kind == "evict":
            return f"evict({self.n})"
        if self.source == "new":
            return f"{self.kind}(new {self.n})"
        if self.source == "repeat":
            return f"{self.kind}(repeat #{self.of})"
        if self.source in ("diverge", "truncate"):
            return f"{self.kind}({self.source} #{self.of}[:{self.cut}] + {self.n})"
        return f"{self.kind}({self.source} #{self.of} + {self.n})"


@dataclass(frozen=True)
class Scenario:
    layout: Layout
    speculation: Speculation
    retention: int | None
    small_pool: bool
    ops: tuple
    seed: int = 0

    def describe(self) -> str:
        pool = "small pool" if self.small_pool else "pool for two requests"
        return (f"{describe_layout(self.layout)} {self.speculation.describe()} "
                f"(k={self.speculation.num_speculative_tokens}) retention={self.retention} {pool}\n"
                f"  stream: {'; '.join(op.describe() for op in self.ops)}")


def harness_mode(speculation: Speculation) -> tuple[str, int, bool]:
    k = speculation.num_speculative_tokens or 1
    return speculation.mode.value, k, speculation.multi_module_mtp


def prompt_lengths(scenario: Scenario) -> list[int]:
    """Prompt lengths of the stream, without running it (to size the manager)."""
    lengths = []
    for op in scenario.ops:
        if op.kind == "evict":
            continue
        prev = lengths[op.of] if lengths else 0
        n = {"new": op.n, "repeat": prev, "extend": prev + op.n, "diverge": min(op.cut, prev) + op.n,
             "truncate": max(1, min(op.cut, prev)), "continue": prev + DECODE_STEPS + 1 + op.n}[op.source]
        lengths.append(max(1, n))
    return lengths


# ----------------------------------------------------------------------------------------------------
# Running a scenario
# ----------------------------------------------------------------------------------------------------


@dataclass
class Coverage:
    """Scenarios counted by layout, speculative mode, retention interval and DCP size (both suites)."""

    by_layout: Counter = field(default_factory=Counter)
    by_mode: Counter = field(default_factory=Counter)
    by_retention: Counter = field(default_factory=Counter)
    by_dcp: Counter = field(default_factory=Counter)

    def count(self, layout, speculation, retention) -> None:
        self.by_layout[layout.name or "random"] += 1
        self.by_mode[speculation.describe()] += 1
        self.by_retention["None" if retention is None else "0" if retention == 0 else "positive"] += 1
        self.by_dcp[layout.dcp] += 1

    def lines(self) -> list[str]:
        return [f"by layout: {dict(sorted(self.by_layout.items()))}",
                f"by speculation: {dict(sorted(self.by_mode.items()))}",
                f"by retention: {dict(sorted(self.by_retention.items()))}; by DCP: {dict(sorted(self.by_dcp.items()))}"]


@dataclass
class Stats(Coverage):
    """What the runs covered, for the session summary."""

    scenarios: int = 0
    lookups: int = 0
    crashes_predicted: int = 0
    rejected_by_both: int = 0
    positive_hits: int = 0
    stalls: int = 0
    below_reference: int = 0
    seconds: float = 0.0


STATS = Stats()


def runs(boundaries, unit) -> str:
    """``16..480, 512`` for a sorted list of multiples of ``unit``."""
    out = []
    for x in sorted(boundaries):
        if out and x == out[-1][1] + unit:
            out[-1][1] = x
        else:
            out.append([x, x])
    return ", ".join(f"{a}..{b}" if a != b else f"{a}" for a, b in out) or "-"


def _fresh(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(1, 50_000) for _ in range(n)]


def build_harness(scenario: Scenario, sizes) -> VllmHarness:
    lengths = prompt_lengths(scenario)
    longest = max(lengths) + DECODE_STEPS + 4 + scenario.speculation.num_speculative_tokens
    S = sizes.scheduler_block
    max_model_len = (longest // S + 2) * S
    blocks_per_request = sum(-(-max_model_len // b) for b in sizes.effective_blocks)
    # Small: room for one request (plus Mamba's speculative blocks), so the next one evicts LRU blocks.
    num_blocks = (blocks_per_request + 8 * len(sizes.effective_blocks) + 1 if scenario.small_pool
                  else 2 * blocks_per_request + 64)
    mode, k, multi = harness_mode(scenario.speculation)
    return VllmHarness(to_harness(scenario.layout), mode, num_speculative_tokens=k, multi_module_mtp=multi,
                       retention_interval=scenario.retention, num_gpu_blocks=num_blocks,
                       max_model_len=max_model_len)


def check_sizes(scenario: Scenario, sizes, harness: VllmHarness) -> None:
    got = harness.sizes
    want = {"S": sizes.scheduler_block, "h": sizes.hash_block, "A": sizes.alignment,
            "fine": sizes.partial_hits, "effective_blocks": list(sizes.effective_blocks)}
    have = {key: got[key] for key in want}
    if have != want:
        raise Mismatch(f"derived sizes differ\n{scenario.describe()}\n  vLLM:  {have}\n  model: {want}")
    coordinator = harness.manager.coordinator
    if hasattr(coordinator, "attention_groups"):
        vllm_groups = [list(g.group_ids) for g in coordinator.attention_groups]
        model_groups = [list(g.members) for g in sizes.groups]
        if vllm_groups != model_groups:
            raise Mismatch(f"spec groups differ\n{scenario.describe()}\n  vLLM:      {vllm_groups}\n"
                           f"  model:     {model_groups}")
        # A spec group drops when any member is a dropping EAGLE group (vLLM ``SpecGroup.use_eagle``).
        vllm_drops = [bool(g.use_eagle) for g in coordinator.attention_groups]
        model_drops = [g.drops for g in sizes.groups]
        if vllm_drops != model_drops:
            raise Mismatch(f"dropping EAGLE spec groups differ\n{scenario.describe()}\n  vLLM: {vllm_drops}\n"
                           f"  model: {model_drops}")
    else:
        vllm_drops = [0 in drop_eagle_group_ids(coordinator)]
        if vllm_drops != [sizes.groups[0].drops]:
            raise Mismatch(f"dropping EAGLE group differs\n{scenario.describe()}\n  vLLM: {vllm_drops}\n"
                           f"  model: {[sizes.groups[0].drops]}")


def stall_predicted(sizes, n, start, junction, rules) -> bool:
    """Whether the scheduler's own chunk clipping leaves this prefill stuck at 0 tokens: a Mamba chunk
    must end at a stop ``e`` (the model's ``chunk_stops``) with ``0 < N - e < Lp``, and
    ``_reserve_prefill_lookahead`` keeps ``Lp`` tokens from the end, so the chunk to ``e`` is cut short and
    the one after it is cut to 0 (docs/findings.md, S1). ``start``: the request's hit; ``junction``: the
    shared-prefix junction it records (NO_JUNCTION for none)."""
    lp = sizes.prefill_lookahead
    if lp < 2 or not any(sg.kind is Kind.MAMBA for sg in sizes.groups):
        return False
    stops = chunk_stops(sizes, n, start, junction, rules).all()
    return any(start < e < n and n - e < lp for e in stops)


def cache_state(harness: VllmHarness, sizes, tokens) -> list[set[int]]:
    """Per spec group, the boundaries whose block hash (of this request) is cached in every member
    KV-cache group: what ``BlockPool.get_cached_block(hash, group_ids)`` answers during the lookup."""
    per_group = harness.retained(tokens)
    out = []
    for sg in sizes.groups:
        members = [set(per_group[m]) for m in sg.members]
        out.append(set.intersection(*members))
    return out


def compare_lookup(scenario, sizes, index, tokens, boundaries, outcome, history, rules=POLICY) -> str:
    """Compare one lookup; returns ``hit``, ``crash`` or raises :class:`Mismatch`."""
    n = len(tokens)
    hit, reach, longest, _ = hit_tokens(CacheState.from_sets(boundaries), sizes, n, rules)
    covered = num_hashes(sizes, n) * sizes.hash_block
    model_crash = reach > covered
    expected_spb = longest if longest != hit else 0

    def fail(what):
        state = "\n".join(f"    spec group {k} ({sg.kind.value} {sg.block}, members {list(sg.members)}): "
                          f"{runs(b, sizes.hash_block)}" for k, (sg, b) in enumerate(zip(sizes.groups,
                                                                                         boundaries)))
        vllm = (f"raised {outcome!r}" if isinstance(outcome, BaseException)
                else f"hit {outcome['hit']}, shared_prefix_boundary {outcome['spb']}")
        model = (f"[{rules.name}] hit {hit}, longest {longest} (expected shared_prefix_boundary {expected_spb}), "
                 f"reach {reach} vs |H|*h {covered}" + (" -> predicts IndexError (F1)" if model_crash else ""))
        raise Mismatch(f"{what} at lookup #{index} (N={n})\n{scenario.describe()}\n"
                       f"  lookups so far: {history}\n"
                       f"  S/h/A = {sizes.scheduler_block}/{sizes.hash_block}/{sizes.alignment}\n"
                       f"  cache state (cached boundaries per spec group):\n{state}\n"
                       f"  vLLM {VLLM_VERSION}: {vllm}\n  model:       {model}")

    for gap in KNOWN_MODEL_GAPS:
        if gap.applies(scenario, (tokens, boundaries, outcome)):
            return "gap:" + gap.name
    if isinstance(outcome, IndexError):
        if not model_crash:
            fail("vLLM raised IndexError but the model reads within the hashes")
        return "crash"
    if isinstance(outcome, BaseException):
        fail("vLLM raised during the lookup")
    if model_crash:
        fail("the model reads past the hashes (F1) but vLLM did not raise")
    if (outcome["hit"], outcome["spb"]) != (hit, expected_spb):
        fail("hit mismatch")
    return "hit"


def run_scenario(scenario: Scenario, stats: Stats = STATS, rules=POLICY) -> list:
    """Run a scenario on vLLM, comparing every lookup. Returns ``[(N, vllm_outcome), ...]``."""
    try:
        sizes = derive_sizes(scenario.layout, scenario.speculation)
        spec_error = None
    except ValueError as e:
        sizes, spec_error = None, e
    if sizes is None:
        # The spec rejects the configuration: vLLM must reject it too (construction with a token layout).
        probe = Scenario(scenario.layout, scenario.speculation, scenario.retention, False,
                         (Op("serve", "new", n=1),))
        # vLLM rejects some configurations when it builds the manager (ValueError, or an assert the
        # harness turns into one) and others on the first lookup (an assert in the finder).
        try:
            mode, k, multi = harness_mode(scenario.speculation)
            harness = VllmHarness(to_harness(scenario.layout), mode, num_speculative_tokens=k,
                                  multi_module_mtp=multi, retention_interval=scenario.retention,
                                  max_model_len=1 << 14, num_gpu_blocks=64)
            harness.probe([1] * (2 * max(g.block_size for g in scenario.layout.groups) + 1))
        except (ValueError, AssertionError):
            stats.rejected_by_both += 1
            return []
        raise Mismatch(f"the spec rejects the configuration ({spec_error}) but vLLM accepts it\n"
                       f"{probe.describe()}")
    try:
        harness = build_harness(scenario, sizes)
    except ValueError as e:
        if scenario.retention not in (None, 0) and "retention" in str(e):
            # Retention is write-side (not yet in the spec); vLLM's validation is the only judge here.
            raise Mismatch(f"vLLM rejects a retention interval the scenario generator thought valid: {e}\n"
                           f"{scenario.describe()}") from e
        raise Mismatch(f"vLLM rejects a configuration the spec accepts: {e}\n{scenario.describe()}") from e
    check_sizes(scenario, sizes, harness)

    rng = random.Random(scenario.seed)
    prompts: list[list[int]] = []
    served: dict[int, list[int]] = {}
    history: list = []
    for op in scenario.ops:
        if op.kind == "evict":
            harness.evict(op.n)
            continue
        if op.source == "new" or not prompts:
            tokens = _fresh(rng, max(1, op.n))
        else:
            base = prompts[op.of]
            if op.source == "repeat":
                tokens = list(base)
            elif op.source == "extend":
                tokens = base + _fresh(rng, op.n)
            elif op.source == "diverge":
                tokens = base[:op.cut] + _fresh(rng, op.n)
            elif op.source == "truncate":
                tokens = base[:max(1, op.cut)]
            else:  # continue: the served request's prompt and sampled tokens
                tokens = served.get(op.of, base) + _fresh(rng, op.n)
            if not tokens:
                tokens = _fresh(rng, 1)
        boundaries = cache_state(harness, sizes, tokens)
        try:
            if op.kind == "serve":
                outcome = harness.serve(tokens, decode_steps=DECODE_STEPS)
                served[len(prompts)] = list(harness._last_served.all_token_ids)
            else:
                outcome = harness.probe(tokens)
        except IndexError as e:
            outcome = e
        except SchedulingStalled as e:
            # Not a lookup result: the admission lookup completed and is compared; the stall itself is a
            # scheduler lead (docs/findings.md, S1), allowed only where the model predicts it.
            hit, _, longest, _ = hit_tokens(CacheState.from_sets(boundaries), sizes, len(tokens), rules)
            if not stall_predicted(sizes, len(tokens), hit, longest if longest > hit else NO_JUNCTION, rules):
                raise Mismatch(f"the scheduler stalled where the model predicts no stall: {e}\n"
                               f"{scenario.describe()}") from e
            stats.stalls += 1
            outcome = {"hit": e.hit, "spb": e.spb}
        except RuntimeError as e:
            # The harness could not schedule a step (a pool sized too small): a bug of the test, not vLLM's.
            raise RuntimeError(f"{e}\n{scenario.describe()}") from e
        except Exception as e:  # noqa: BLE001 - any other exception is reported as a mismatch
            outcome = e
        verdict = compare_lookup(scenario, sizes, len(history), tokens, boundaries, outcome, history, rules)
        history.append((len(tokens), "IndexError" if isinstance(outcome, IndexError)
                        else outcome["hit"] if isinstance(outcome, dict) else repr(outcome)))
        stats.lookups += 1
        if verdict == "crash":
            stats.crashes_predicted += 1
        elif isinstance(outcome, dict):
            stats.positive_hits += outcome["hit"] > 0
            reference = hit_tokens(CacheState.from_sets(boundaries), sizes, len(tokens), REFERENCE)[0]
            stats.below_reference += outcome["hit"] < reference
        prompts.append(tokens)
    stats.scenarios += 1
    stats.count(scenario.layout, scenario.speculation, scenario.retention)
    return history


def seed_cache(harness: VllmHarness, sizes, tokens, has) -> None:
    """Make vLLM's pool hold exactly a given cache state for ``tokens``' block hashes: for every spec
    group ``k`` and boundary ``x`` within the hashes with ``has(k, x)``, the hash ending at ``x`` is
    inserted for every member KV-cache group, each on its own free block (a lookup only reads the hash
    map; the blocks stay in the free queue). For replaying a counterexample's cache state."""
    from vllm.v1.core.kv_cache_utils import make_block_hash_with_group_id

    pool = harness.manager.block_pool
    hashes = harness._new_request(tokens).block_hashes
    h = sizes.hash_block
    next_block = 1  # pool.blocks[0] is the null block
    for k, sg in enumerate(sizes.groups):
        for j, block_hash in enumerate(hashes):
            if has(k, (j + 1) * h):
                for g in sg.members:
                    pool.cached_block_hash_to_block.insert(make_block_hash_with_group_id(block_hash, g),
                                                           pool.blocks[next_block])
                    next_block += 1


@dataclass
class Seeded:
    """A harness whose pool holds a recorded cache state for a prompt (:func:`seeded_harness`)."""

    harness: VllmHarness
    sizes: object
    tokens: list
    seeded: list  # the boundaries the pool holds per spec group (:func:`cache_state`)
    cache: CacheState  # the recorded state


def seeded_harness(config, n: int, record_cache: dict) -> Seeded:
    """vLLM's classes for ``config`` (a :class:`kvhit.proofs.model.Config`) holding ``record_cache`` (a
    counterexample's or a ``kvhit diff`` row's ``"cache"``: per spec group, runs of cached blocks per unit)
    for the block hashes of a prompt of ``n`` tokens."""
    from kvhit.proofs.model import cache_from_runs

    layout, speculation = to_refimpl(config.layout), to_refimpl(config.speculation)
    sizes = derive_sizes(layout, speculation)
    runs = {(int(k), item["unit"]): [tuple(span) for span in item["blocks"]]
            for k, items in record_cache.items() for item in items}
    cache, _ = cache_from_runs(runs)
    S = sizes.scheduler_block
    mode, k, multi = harness_mode(speculation)
    harness = VllmHarness(to_harness(layout), mode, num_speculative_tokens=k, multi_module_mtp=multi,
                          max_model_len=(n // S + 2) * S, num_gpu_blocks=2 * n + 64)
    tokens = list(range(1, n + 1))
    seed_cache(harness, sizes, tokens, cache.has)
    return Seeded(harness, sizes, tokens, cache_state(harness, sizes, tokens), cache)
