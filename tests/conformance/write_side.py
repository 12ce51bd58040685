"""Differential comparison of a vLLM release's write side (``vllm_0_33`` on vLLM 0.33.0, ``vllm_0_32`` on
0.32.0: :data:`.differential.POLICY`) with that release's own classes.

A *write scenario* is a layout, a speculative setting, a retention interval, a prompt of ``N`` tokens served
once on an empty cache, then a stream of resends of the same prompt (served) and longer siblings (looked up
only). It runs in the setting the write side models (``spec/retention.py``): one request at a time, a token
budget that never cuts a chunk (``max_num_batched_tokens`` 10**6), each request samples one token and ends
(``decode_steps=0``), and a pool large enough that nothing is evicted.

Compared, explicitly:

* **retained** (after the first request): per KV-cache group, the block boundaries ``x <= N - L`` whose hash
  vLLM's ``BlockPool`` holds (:meth:`VllmHarness.retained`) equal those the member's spec group holds in
  ``refimpl.written_cache(refimpl.request_writes(sizes, N, R, rules))``. Later boundaries are not compared:
  their hashes cover tokens past the prompt.
* **resend hits**: the i-th resend's hit equals ``refimpl.repeat_hits(sizes, N, R, rules, i)[-1]``, and its
  ``shared_prefix_boundary`` equals the junction the model records (``junction_of``);
* **sibling hits**: a longer prompt extending the ``N`` tokens, looked up on the cache the requests so far
  left (the model's: ``request_writes`` merged with each resend's writes, as ``repeat`` does), hits what
  ``hit_tokens`` says on that cache, with the same ``shared_prefix_boundary``;
* **diverging prompts** (a stream's last op): a prompt sharing the first ``cut`` tokens and then diverging is
  served on that cache (what the prompt left, clipped to the ``cut`` tokens it shares: ``clip``); its hit and
  ``shared_prefix_boundary`` equal the model's, and a third prompt sharing exactly the junction ``J`` it
  recorded is looked up on the union of both prompts' writes clipped to ``J`` (D3 of
  docs/notes/vllm-0.32-policy.md: 0.33 keeps a dropping group's state at ``J`` and ``J - b``, 0.32 at ``J``);
* **crashes**: vLLM raises ``IndexError`` in a lookup exactly where the model reads past the hashes (F1).

A scenario may admit its first request on a cache that already holds a prefix of the prompt
(``held_before``): a hit inside the prompt's last block, which no stream of served prompts reaches on some
layouts, as other prompts' partial tails could leave it. Then the first request's hit and
``shared_prefix_boundary`` are compared too, and the retained boundaries are the held ones together with
what the model says the request writes from its hit (``request_writes(sizes, N, R, rules, hit, J)``).

A mismatch raises :class:`~.differential.Mismatch` with the layout, the stream and both outputs.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from kvhit.refimpl import (
    Layout,
    Speculation,
    dense_groups,
    derive_sizes,
    hit_tokens,
    repeat_hits,
    request_writes,
    written_cache,
)
from kvhit.refimpl.policy import NO_JUNCTION, CacheState, check_retention, clip, junction_of, num_hashes, repeat

# stall_predicted: the write side assumes every request completes, so a scenario ends at a predicted stall
from .differential import (POLICY, Coverage, Mismatch, cache_state, check_sizes, describe_layout, harness_mode,
                           runs, stall_predicted, to_harness)
from .vllm_harness import VLLM_VERSION, SchedulingStalled, VllmHarness

NO_BUDGET = 10**6
"""``max_num_batched_tokens``: the write side assumes the token budget never cuts a chunk."""


@dataclass(frozen=True)
class WriteScenario:
    """A first request of ``n`` tokens on an empty cache, then ``ops``: ``("resend",)`` serves the same
    prompt again; ``("sibling", extra)`` looks up the prompt extended by ``extra`` fresh tokens;
    ``("diverge", cut, extra, tail)`` (last) serves the first ``cut`` tokens plus ``extra`` fresh ones, then
    looks up the first ``J`` tokens of that prompt plus ``tail`` fresh ones, ``J`` the junction it recorded.

    ``held_before``: per spec group, the cache holds every hash boundary of the prompt up to this many tokens
    before the first request (:func:`hold_prefix`); ``()`` for an empty cache. Only ``("sibling", extra)``
    ops may follow it (a resend's and a diverging prompt's model starts from the first request's writes on an
    empty cache: ``repeat``, ``clip``)."""

    layout: Layout
    speculation: Speculation
    retention: int | None
    n: int
    ops: tuple
    seed: int = 0
    held_before: tuple = ()

    def __post_init__(self):
        if self.held_before and any(op[0] != "sibling" for op in self.ops):
            raise ValueError(f"a scenario starting on a held prefix takes only sibling ops, not {self.ops}")

    def describe(self) -> str:
        def step(op):
            if op[0] == "resend":
                return "serve(resend)"
            if op[0] == "sibling":
                return f"probe(sibling +{op[1]})"
            return f"serve(diverge [:{op[1]}] + {op[2]}); probe(that [:J] + {op[3]})"

        first = "serve(new %d)" % self.n
        if self.held_before:
            first = "serve(%d on a cache holding [:%s])" % (self.n, ", :".join(map(str, self.held_before)))
        stream = "; ".join([first] + [step(op) for op in self.ops])
        return (f"{describe_layout(self.layout)} {self.speculation.describe()} "
                f"(k={self.speculation.num_speculative_tokens}) retention={self.retention}\n"
                f"  stream: {stream}")


@dataclass
class WriteStats(Coverage):
    """What the write-side runs covered, for the session summary."""

    scenarios: int = 0
    retained_groups: int = 0
    resends: int = 0
    siblings: int = 0
    positive: int = 0
    crashes_predicted: int = 0
    stalls: int = 0
    below_dense: int = 0
    """Resends whose hit is below what the same prompt would hit with every state retained (dense)."""
    diverging: int = 0
    """Diverging prompts served (a ``("diverge", ...)`` op)."""
    at_junction: int = 0
    """Prompts sharing exactly the junction a diverging prompt recorded, looked up (hit > 0: the next)."""
    at_junction_positive: int = 0
    seconds: float = 0.0


WRITE_STATS = WriteStats()


def in_scope(layout: Layout, speculation: Speculation, retention) -> bool:
    """The spec accepts the layout and models its write side with this retention interval
    (``check_retention``)."""
    try:
        check_retention(derive_sizes(layout, speculation), retention)
    except ValueError:
        return False
    return True


def build_write_harness(scenario: WriteScenario, sizes, max_num_batched_tokens: int = NO_BUDGET) -> VllmHarness:
    """vLLM's manager and the scheduler's chunk clipping for ``scenario``, with a pool that evicts nothing and
    the given token budget (by default one that never cuts a chunk, as the write side assumes)."""
    longest = scenario.n + max([op[1] for op in scenario.ops if op[0] == "sibling"], default=0)
    longest = max([longest] + [op[1] + max(op[2], op[3]) for op in scenario.ops if op[0] == "diverge"])
    longest += 4 + scenario.speculation.num_speculative_tokens
    S = sizes.scheduler_block
    max_model_len = (longest // S + 2) * S
    # Room for every request of the stream without evicting a block (the model assumes no eviction).
    per_request = sum(-(-max_model_len // b) for b in sizes.effective_blocks)
    # and for the held prefix's entries, one block each (hold_prefix)
    held = sum(len(sg.members) * (top // sizes.hash_block) for sg, top in zip(sizes.groups, scenario.held_before))
    mode, k, multi = harness_mode(scenario.speculation)
    try:
        return VllmHarness(to_harness(scenario.layout), mode, num_speculative_tokens=k, multi_module_mtp=multi,
                           retention_interval=scenario.retention, num_gpu_blocks=2 * per_request + 64 + held,
                           max_model_len=max_model_len, max_num_batched_tokens=max_num_batched_tokens)
    except ValueError as e:
        raise Mismatch(f"vLLM rejects a configuration whose write side the spec models: {e}\n"
                       f"{scenario.describe()}") from e


def hold_prefix(harness: VllmHarness, sizes, tokens, held_before) -> None:
    """Cache, for ``tokens``' block hashes, every boundary ``x <= held_before[k]`` of spec group ``k`` in each
    member KV-cache group, as requests that computed it and ended would leave it: each entry on its own block
    taken from the free queue, keyed at ``x`` by ``BlockPool.cache_partial_block`` and freed again, so a
    served request can touch it (:func:`.differential.seed_cache`'s entries carry no block hash: they serve
    lookups only)."""
    pool = harness.manager.block_pool
    request = harness._new_request(tokens)
    managers = harness.manager.coordinator.single_type_managers
    h = sizes.hash_block
    blocks = []
    for k, sg in enumerate(sizes.groups):
        for x in range(h, min(held_before[k], len(request.block_hashes) * h) + 1, h):
            for m in sg.members:
                block = pool.get_new_blocks(1)[0]
                pool.cache_partial_block(request=request, block=block, num_tokens=x, kv_cache_group_id=m,
                                         block_size=managers[m].block_size)
                blocks.append(block)
    pool.free_blocks(blocks)


def model_retained(sizes, cache: CacheState, k: int, n: int) -> list[int]:
    """The boundaries ``x <= N - L`` (multiples of ``h``) spec group ``k`` holds in the model's cache."""
    h = sizes.hash_block
    return [x for x in range(h, n - sizes.hash_lookahead + 1, h) if cache.has(k, x)]


def run_write_scenario(scenario: WriteScenario, stats: WriteStats = WRITE_STATS, rules=POLICY) -> list:
    """Run a write scenario on vLLM and compare. Returns ``[(what, N, vllm_outcome), ...]``."""
    sizes = derive_sizes(scenario.layout, scenario.speculation)
    harness = build_write_harness(scenario, sizes)
    check_sizes(scenario, sizes, harness)
    n, R, L, h = scenario.n, scenario.retention, sizes.hash_lookahead, sizes.hash_block
    stats.scenarios += 1
    stats.count(scenario.layout, scenario.speculation, R)
    dense = hit_tokens(written_cache(dense_groups(sizes, n)), sizes, n, rules)[0]
    rng = random.Random(scenario.seed)
    tokens = [rng.randrange(1, 50_000) for _ in range(n)]
    history: list = []

    def fail(what, vllm, model, extra=""):
        raise Mismatch(f"{what}\n{scenario.describe()}\n  S/h/A/L = {sizes.scheduler_block}/{h}/"
                       f"{sizes.alignment}/{L}\n  requests so far: {history}\n{extra}"
                       f"  vLLM {VLLM_VERSION}: {vllm}\n  model [{rules.name}]: {model}")

    def lookup(label, prompt, cache, serve):
        """One lookup of ``prompt`` (served or probed) against the model's ``cache``; returns the vLLM
        outcome dict, or None when the scenario ends (a predicted crash or a predicted stall)."""
        hit, reach, longest, _ = hit_tokens(cache, sizes, len(prompt), rules)
        crash = reach > num_hashes(sizes, len(prompt)) * h
        junction = longest if longest > hit else NO_JUNCTION
        stall = serve and stall_predicted(sizes, len(prompt), hit, junction, rules)
        try:
            out = harness.serve(prompt, decode_steps=0) if serve else harness.probe(prompt)
        except IndexError as e:
            if not crash:
                fail(f"{label}: vLLM raised IndexError but the model reads within the hashes", repr(e),
                     f"hit {hit}, reach {reach}")
            stats.crashes_predicted += 1
            history.append((label, len(prompt), "IndexError"))
            return None
        except (SchedulingStalled, RuntimeError) as e:
            # A prefill clipped to 0 tokens by the scheduler's own Mamba split and lookahead reservation
            # (docs/findings.md, S1): the request never completes, so nothing is written to compare.
            if not stall or "0 tokens" not in str(e):
                fail(f"{label}: the scheduler stalled where the model predicts no stall", repr(e),
                     f"hit {hit}, junction {junction}")
            stats.stalls += 1
            history.append((label, len(prompt), "stall"))
            return None
        if stall:
            fail(f"{label}: the model predicts a scheduler stall but vLLM completed the request", out,
                 f"hit {hit}, junction {junction}")
        if crash:
            fail(f"{label}: the model reads past the hashes (F1) but vLLM did not raise", out,
                 f"reach {reach} > |H|*h {num_hashes(sizes, len(prompt)) * h}")
        history.append((label, len(prompt), out["hit"]))
        return out | {"model_hit": hit, "model_longest": longest}

    def agree(out, what):
        """vLLM's hit is the model's, and its shared_prefix_boundary the longest candidate when that is past
        the hit, else 0."""
        spb = out["model_longest"] if out["model_longest"] != out["model_hit"] else 0
        if (out["hit"], out["spb"]) != (out["model_hit"], spb):
            fail(what, f"hit {out['hit']}, shared_prefix_boundary {out['spb']}",
                 f"hit {out['model_hit']}, longest {out['model_longest']}")

    def diverge(cut, extra, tail):
        """A prompt sharing the first ``cut`` tokens, served; then one sharing its junction, looked up."""
        cut = max(1, min(cut, n))
        prompt = tokens[:cut] + [rng.randrange(1, 50_000) for _ in range(extra)]
        out = lookup(f"diverge [:{cut}] + {extra}", prompt, written_cache(tuple((clip(sizes, g, cut),)
                                                                               for g in groups)), serve=True)
        if out is None:
            return
        agree(out, f"a prompt of {len(prompt)} tokens sharing {cut} differs")
        stats.diverging += 1
        junction = junction_of(sizes, out["model_hit"], out["model_longest"], rules)
        if junction <= 0:
            return
        writes = request_writes(sizes, len(prompt), R, rules, out["model_hit"], junction)
        at = prompt[:junction] + [rng.randrange(1, 50_000) for _ in range(tail)]
        layered = tuple((clip(sizes, groups[k], min(junction, cut)), clip(sizes, writes[k], junction))
                        for k in range(len(sizes.groups)))
        out = lookup(f"at junction [:{junction}] + {tail}", at, written_cache(layered), serve=False)
        if out is None:
            return
        agree(out, f"a prompt sharing the junction {junction} differs")
        stats.at_junction += 1
        stats.at_junction_positive += out["hit"] > 0

    # The first request, on an empty cache or one holding a prefix of the prompt.
    before = CacheState(lambda k, x: False)
    if scenario.held_before:
        hold_prefix(harness, sizes, tokens, scenario.held_before)
        before = CacheState.from_sets(cache_state(harness, sizes, tokens))
    first = lookup("first", tokens, before, serve=True)
    if first is None:
        return history
    if scenario.held_before:
        agree(first, "the first request's hit on the held prefix differs")
        start = first["model_hit"]
        groups = request_writes(sizes, n, R, rules, start, junction_of(sizes, start, first["model_longest"], rules))
        written = written_cache(groups)
        cache = CacheState(lambda k, x: before.has(k, x) or written.has(k, x))
    else:
        groups = request_writes(sizes, n, R, rules)
        cache = written_cache(groups)
    got = harness.retained(tokens)
    for k, sg in enumerate(sizes.groups):
        want = model_retained(sizes, cache, k, n)
        for m in sg.members:
            have = [x for x in got[m] if x <= n - L]
            if have != want:
                fail(f"retained boundaries of KV-cache group {m} (spec group {k}, {sg.kind.value} {sg.block}) "
                     f"differ after the first request", runs(have, h), runs(want, h),
                     f"  written (model): {groups[k]}\n")
            stats.retained_groups += 1

    resends = 0
    for op in scenario.ops:
        if op[0] == "diverge":
            diverge(*op[1:])
            return history
        if op[0] == "resend":
            resends += 1
            out = lookup(f"resend {resends}", tokens, cache, serve=True)
            if out is None:
                return history
            expected = repeat_hits(sizes, n, R, rules, resends)[-1]
            hit, junction, groups = repeat(sizes, n, R, rules, groups)
            assert hit == expected == out["model_hit"]  # one model, three routes to the same number
            spb = junction if junction > 0 else 0
            if (out["hit"], out["spb"]) != (expected, spb):
                fail(f"resend {resends} (N={n}) differs", f"hit {out['hit']}, shared_prefix_boundary {out['spb']}",
                     f"repeat_hits {repeat_hits(sizes, n, R, rules, resends)}, junction {spb}")
            cache = written_cache(groups)
            stats.resends += 1
            stats.below_dense += out["hit"] < dense
        else:
            extra = op[1]
            prompt = tokens + [rng.randrange(1, 50_000) for _ in range(extra)]
            out = lookup(f"sibling +{extra}", prompt, cache, serve=False)
            if out is None:
                return history
            agree(out, f"sibling of {n + extra} tokens differs")
            stats.siblings += 1
        stats.positive += out["hit"] > 0
    return history
