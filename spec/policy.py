"""The hit-length policy: how many prompt tokens a request may take from the prefix cache.

One model, several policies. The rules in which policies differ are the fields of :class:`Rules`; a
policy is a named combination of them (:data:`POLICIES`). Notation used in the docstrings:

* ``N`` prompt tokens; ``M`` the most a lookup may return; ``A`` the alignment; ``h`` the hash unit;
  ``|H|`` the request's block hashes, which cover ``covered = |H| * h`` tokens
  (:func:`kvhit.spec.sizes.hash_reach`): no lookup may read a boundary past it.
* a lookup returns ``(hit, reach)``: the hit in tokens and ``reach``, the highest boundary it reads.
* a coordinator returns ``(hit, reach, longest, converged)``; ``longest`` is vLLM's largest intermediate
  candidate (``num_uncached_common_prefix_tokens = longest - hit``), ``converged`` whether the fixed-point
  loop stopped within the passes a lowering unrolled (always True in Python).
"""

from dataclasses import dataclass, replace
from enum import Enum

from .domain import Kind
from .sizes import Sizes, hash_reach, num_hashes
from .terms import and_, cdiv, floor_to, ite, max_, max_aligned, min_, not_, or_, passes, stop


class Replay(str, Enum):
    """Where a policy's write side keeps state for a later request
    (:func:`kvhit.spec.retention.replay_boundaries`).

    * ``vllm``: vLLM 0.33's ``replay_boundaries`` (``N - 1``, or with an EAGLE drop one scheduler block
      below the resend's and a longer sibling's aligned boundaries).
    * ``prompt_end``: ``N - 1`` only (vLLM before its EAGLE-aware boundaries).
    * ``resume``: the points kvhit's own read side resumes at, then vLLM's boundaries.

    Compared with ``==``: the proofs replay the generated refimpl with the spec's rules, and the two
    modules' members are equal by value, not identical.
    """

    VLLM = "vllm"
    PROMPT_END = "prompt_end"
    RESUME = "resume"


class Junction(str, Enum):
    """Where a request records its shared-prefix junction (:func:`kvhit.spec.retention.junction_of`).

    * ``uncached``: vLLM ``hit + num_uncached_common_prefix_tokens`` (the longest candidate its lookup
      saw), when that passes the hit.
    * ``next_block``: one scheduler block past the hit.

    Compared with ``==``, as :class:`Replay`.
    """

    UNCACHED = "uncached"
    NEXT_BLOCK = "next_block"


@dataclass(frozen=True)
class Rules:
    """The rules in which the policies differ.

    Attributes:
        name: the policy's name.
        declarative: the hit is the longest aligned length every group can serve (kvhit's reference);
            otherwise vLLM's coordinators (Unitary lookup, Hybrid fixed-point loop) compute it.
        last_token_recomputed: the hit is capped at ``N - 1`` so the last prompt token is recomputed for
            its logits (vLLM ``get_computed_blocks``).
        eagle_recompute: a dropping EAGLE group must hold one drop unit past the hit, which it recomputes.
        eagle_margin: in the Hybrid loop an EAGLE group is looked up at ``candidate + margin`` (it peeks one
            drop unit past the candidate) before it drops (vLLM 0.33); without it, at the candidate.
        peek_within_hashes: that peek is capped at ``|H| * h``.
        pop_after_peek: the lookup drops the peeked unit again.
        drop_once: an EAGLE group drops once per lookup (vLLM's ``eagle_verified`` set); without it, it
            drops again on every pass of the loop (vLLM #32802).
        scale_replicated: DCP scales every group's block, sharded or not.
        replay: where the write side keeps state for a later request (:class:`Replay`).
        checkpoint_drop: the scheduler's Mamba prompt checkpoint accounts for the EAGLE drop.
        sparse_zero: retention interval 0 keeps only the replay boundaries (else it acts as dense).
        junction: where a request records its shared-prefix junction (:class:`Junction`).
        cap_at_hashes: repair F1: vLLM's coordinators look every group up at most at ``|H| * h`` (vLLM
            0.33 caps only full attention and the EAGLE peek there).
        unitary_margin: repair F2: the Unitary coordinator peeks one drop unit past ``M`` before its EAGLE
            drop, as the Hybrid one does (vLLM 0.33 looks up at ``M`` and drops a whole block below it).
        drop_before_align: repair F5: a sliding-window lookup with no full window drops the EAGLE block from
            the run from block 0 before aligning it (vLLM 0.33 aligns, drops, and aligns again).
        reverify_after_shrink: repair C1: in the Hybrid loop every shrink of the candidate clears the EAGLE
            groups' verifications, a dropping lookup's included (it then verifies its own group at the new
            candidate); vLLM 0.33 clears them only on a shrink by a lookup that did not drop, so a group
            verified at a longer candidate keeps its verification below it, where its drop unit may not be
            cached.
        probe_past_max: repair F6: a full-attention lookup also reads the block that holds ``M`` and, at
            hash granularity, the boundaries of the whole next block (within the hashes), and caps the hit
            at ``M`` before the drop: a block or boundary cached past ``M`` vouches for every token before
            it (vLLM 0.33 reads only up to ``M``, and caches only a prompt's last boundary inside a block, so
            a shorter prompt that shares a cached block reaching past its ``N - 1`` misses it).
        record_junction: the declarative hit reports the shared prefix beyond it
            (:func:`shared_prefix_tokens`), so the write side keeps state at the junction.
        lookahead_hashes: the engine has lookahead block hashes (vLLM 0.33 ``num_hash_lookahead_tokens``:
            ``VllmConfig.num_hash_lookahead_tokens``, ``get_request_block_hasher``'s third argument,
            ``Scheduler.__init__`` clearing ``use_eagle_block_drop``), so ``Mode.LOOKAHEAD`` is a setting of
            the policy; without them (vLLM 0.32, whose block hasher hashes every full block of
            ``request.num_tokens``) an EAGLE-family drafter always drops, and a lookahead setting is refused
            (:func:`check_speculation`).
        junction_below: a dropping group also keeps its state one block below the shared-prefix junction,
            so a sibling that diverges right after the junction can use the block past its hit as the
            EAGLE peek (vLLM 0.33 ``SingleTypeKVCacheManager.cache_blocks``: ``reachable_boundaries``
            gains ``shared_prefix_boundary - self.block_size`` when ``self.use_eagle``); without it only
            the junction (vLLM 0.32, the same method without that line;
            :func:`kvhit.spec.retention.junction_boundaries`).
        coarse_junction: the write side also keeps state at the junction floored to the block of each group
            vLLM's loop looks up first (:func:`prefix_groups`), where vLLM's own junction lands (its first
            lookup's candidate is a multiple of that block): a junction at the alignment alone, finer than
            that block at DCP > 1, kept less than vLLM (qwen3next at DCP 2, ``R = 0``: 16002 tokens, its first
            6400, then a prompt sharing 3200: vLLM keeps a Mamba state at 3200 and hits it; without this
            rule the reference keeps 4800 and 6400 and hits 0; :func:`kvhit.spec.retention.coarse_junctions`).
        vllm_checkpoint: the write side also keeps state at vLLM's Mamba prompt checkpoint, one more replay
            boundary (:func:`kvhit.spec.retention.replay_boundaries`).
        checkpoint_tail_when_capped: where lookups are capped (auxiliary outputs) and a Mamba group is read
            at hash granularity, the prompt's one Mamba partial tail is the resend's capped resume point only
            where that lies inside a Mamba block, and elsewhere vLLM's prompt checkpoint
            (:func:`kvhit.spec.retention.resume_tail`).

    Raises:
        ValueError: a ``replay`` or ``junction`` that is not one of its enum's values (a misspelt rule
            must not fall through to vLLM's behaviour).
    """

    name: str
    declarative: bool = False
    last_token_recomputed: bool = True
    eagle_recompute: bool = True
    eagle_margin: bool = True
    peek_within_hashes: bool = True
    pop_after_peek: bool = True
    drop_once: bool = True
    scale_replicated: bool = False
    replay: Replay = Replay.VLLM
    checkpoint_drop: bool = True
    sparse_zero: bool = True
    junction: Junction = Junction.UNCACHED
    cap_at_hashes: bool = False
    unitary_margin: bool = False
    drop_before_align: bool = False
    probe_past_max: bool = False
    reverify_after_shrink: bool = False
    record_junction: bool = True
    lookahead_hashes: bool = True
    junction_below: bool = True
    coarse_junction: bool = False
    vllm_checkpoint: bool = False
    checkpoint_tail_when_capped: bool = False

    def __post_init__(self):
        object.__setattr__(self, "replay", Replay(self.replay))
        object.__setattr__(self, "junction", Junction(self.junction))


REFERENCE = Rules("reference", declarative=True, replay=Replay.RESUME, coarse_junction=True, vllm_checkpoint=True,
                  checkpoint_tail_when_capped=True)
VLLM_0_33 = Rules("vllm_0_33")
# vLLM 0.32.0: 0.33's read side (the same coordinators, loop, finders and alignment), without lookahead block
# hashes and without the junction's lower boundary on the write side (docs/notes/vllm-0.32-policy.md, D1, D3).
VLLM_0_32 = Rules("vllm_0_32", lookahead_hashes=False, junction_below=False)
HISTORICAL = Rules("historical", eagle_margin=False, replay=Replay.PROMPT_END, checkpoint_drop=False)

# Known-bad variants: each breaks one rule, to show that the invariant guarding that rule can fail.
HISTORICAL_REPEAT_DROP = Rules("historical_repeat_drop", eagle_margin=False, drop_once=False)
NO_LAST_TOKEN_CAP = replace(REFERENCE, name="no_last_token_cap", last_token_recomputed=False)
EAGLE_NEVER_RECOMPUTES = replace(REFERENCE, name="eagle_never_recomputes", eagle_recompute=False)
PEEK_WITHOUT_POP = replace(VLLM_0_33, name="peek_without_pop", pop_after_peek=False)
PEEK_PAST_HASHES = replace(VLLM_0_33, name="peek_past_hashes", peek_within_hashes=False)
DCP_SCALES_REPLICATED = replace(REFERENCE, name="dcp_scales_replicated", scale_replicated=True)
RETAIN_PROMPT_END = replace(REFERENCE, name="retain_prompt_end", replay=Replay.PROMPT_END)
RETAIN_EVERY_BOUNDARY = replace(REFERENCE, name="retain_every_boundary", sparse_zero=False)
JUNCTION_PAST_HIT = replace(HISTORICAL, name="junction_past_hit", junction=Junction.NEXT_BLOCK)
# The reference as it was before it recorded a junction: diverging prompts after a shared prefix lose
# what vLLM's junction gives them (vLLM 0.33.0's own tests showed it).
WITHOUT_JUNCTION = replace(REFERENCE, name="without_junction", record_junction=False)
# The reference as it was before it also kept vLLM's coarser junction: at DCP > 1 a Mamba hybrid lost a hit
# vLLM's junction gives (qwen3next, DCP 2, R = 0).
FINE_JUNCTION_ONLY = replace(REFERENCE, name="fine_junction_only", coarse_junction=False)
# ... and before it also kept vLLM's Mamba prompt checkpoint: at DCP > 1 a resend resumes a full-attention
# block below it, and a prompt that later shares more found vLLM's state there (qwen3next, DCP 2, MTP 2).
WITHOUT_VLLM_CHECKPOINT = replace(REFERENCE, name="without_vllm_checkpoint", vllm_checkpoint=False)
# ... and where auxiliary outputs cap lookups at a group read at hash granularity, before it kept its Mamba tail
# where vLLM keeps its checkpoint: it kept it at the resend's capped resume point, and a prompt sharing a longer
# prefix (whose cap another request's blocks raised) found vLLM's state where the reference kept none.
TAIL_AT_CAPPED_RESUME = replace(REFERENCE, name="tail_at_capped_resume", checkpoint_tail_when_capped=False)



@dataclass(frozen=True)
class Repair:
    """A minimal change to one rule of vLLM 0.33's algorithm, as a small upstream patch makes it
    (``docs/upstream/<name>.patch``).

    Attributes:
        name: the repair (the patch's name).
        finding: the finding of docs/findings.md it removes.
        vllm: the vLLM code it changes.
        rule: the :class:`Rules` field it sets, and ``value`` what to.
        also: further ``(field, value)`` pairs the same patch sets.
    """

    name: str
    finding: str
    vllm: str
    rule: str
    value: object = True
    also: tuple = ()


REPAIRS = {r.name: r for r in (
    Repair("cap_at_hashes", "F1", "KVCacheCoordinator.find_longest_cache_hit (Unitary and Hybrid)", "cap_at_hashes"),
    Repair("unitary_margin", "F2", "UnitaryKVCacheCoordinator.find_longest_cache_hit", "unitary_margin"),
    Repair("drop_before_align", "F5", "SlidingWindowManager.find_longest_cache_hit", "drop_before_align"),
    Repair("probe_past_max", "F6", "FullAttentionManager.find_longest_cache_hit", "probe_past_max"),
    Repair("reverify_after_shrink", "C1", "HybridKVCacheCoordinator.find_longest_cache_hit",
           "reverify_after_shrink"),
    Repair("replay_at_resume", "W", "kv_cache_coordinator.replay_boundaries", "replay", Replay.RESUME,
           also=(("coarse_junction", True), ("vllm_checkpoint", True))),
)}


def repaired(names, base: Rules = VLLM_0_33, name: str | None = None) -> Rules:
    """``base`` (vLLM 0.33) with the named repairs of :data:`REPAIRS` on."""
    rules = base
    for n in names:
        rules = replace(rules, **{REPAIRS[n].rule: REPAIRS[n].value, **dict(REPAIRS[n].also)})
    return replace(rules, name=name or "+".join((base.name,) + tuple(names)))


# vLLM 0.33's own algorithm with every repair on: what the upstream patches make of it.
VLLM_0_33_REPAIRED = repaired(tuple(REPAIRS), name="vllm_0_33_repaired")

POLICIES = {r.name: r for r in (REFERENCE, VLLM_0_33, HISTORICAL, VLLM_0_33_REPAIRED)}
KNOWN_BAD = {r.name: r for r in (HISTORICAL_REPEAT_DROP, NO_LAST_TOKEN_CAP, EAGLE_NEVER_RECOMPUTES,
                                 PEEK_WITHOUT_POP, PEEK_PAST_HASHES, DCP_SCALES_REPLICATED, RETAIN_PROMPT_END,
                                 RETAIN_EVERY_BOUNDARY, JUNCTION_PAST_HIT, WITHOUT_JUNCTION,
                                 FINE_JUNCTION_ONLY, WITHOUT_VLLM_CHECKPOINT, TAIL_AT_CAPPED_RESUME)}
# Policies of other vLLM releases: named and replayable (``policy_rules``); ``make prove`` checks every claim
# about every policy for them on the settings their engine has (``kvhit.proofs.model.accepts``).
RELEASES = {r.name: r for r in (VLLM_0_32,)}
ALL_POLICIES = {**POLICIES, **KNOWN_BAD, **RELEASES}


def check_speculation(sizes: Sizes, rules: Rules):
    """Refuse a speculative setting the policy's engine does not have: lookahead block hashes
    (``L > 0``) under a policy without them (``lookahead_hashes``; vLLM 0.32 has no
    ``num_hash_lookahead_tokens``, its EAGLE-family drafters drop).

    Raises:
        ValueError: naming the policy and the setting.
    """
    if sizes.hash_lookahead > 0 and not rules.lookahead_hashes:
        raise ValueError(f"policy {rules.name} has no lookahead block hashes (L = {sizes.hash_lookahead}): its "
                         "engine drops the EAGLE block instead; use mode 'drop'")


def max_cache_hit_length(n_tokens, rules: Rules):
    """The most a hit may be: ``N - 1`` (vLLM ``KVCacheManager.get_computed_blocks``)."""
    if rules.last_token_recomputed:
        return n_tokens - 1
    return n_tokens


# ----------------------------------------------------------------------------------------------------
# Per-kind lookups, as vLLM 0.33 does them
# ----------------------------------------------------------------------------------------------------


def full_attention_lookup(cache, sizes: Sizes, k, hashes, max_length, drop, rules: Rules):
    """vLLM: ``FullAttentionManager.find_longest_cache_hit``.

    Order: the leading run of cached blocks (at most ``M // b`` blocks and the hashes), then, when the group
    is looked up at hash granularity, the highest cached boundary inside the next block up to ``M``; then
    the drop of ``min(A, b)``; then alignment down to ``A``. With ``probe_past_max`` the run also reads
    the block that holds ``M`` and the probe the whole next block (within the hashes), and the hit is then
    capped at ``M`` before the drop (which then leaves at least 0): a block or boundary cached past ``M``
    vouches for every token before it (hashes are prefix-chained), as the reference's extent says.
    """
    sg = sizes.groups[k]
    b = sg.block
    a = sizes.alignment
    limit = min_(cdiv(max_length, b) if rules.probe_past_max else max_length // b,
                 hashes * sizes.hash_block // b)
    run = cache.run_from(k, start=0, unit=b, limit=limit)
    hit = run * b
    reach = limit * b
    if sg.fine:
        per_block = b // a
        probe = run * per_block + per_block - 1
        if not rules.probe_past_max:
            probe = min_(probe, max_length // a)
        top = min_(probe, hashes * sizes.hash_block // a)
        partial = cache.last_held(k, step=a, lo=hit, hi=top * a, unit=a, before=1, after=0)
        hit = ite(partial > 0, partial, hit)
        reach = max_(reach, top * a)
    dropped = hit - min(a, b)
    if rules.probe_past_max:
        hit = min_(hit, max_length)
        dropped = max_(hit - min(a, b), 0)  # the cap can leave less than one drop unit
    hit = ite(and_(drop, hit > 0), dropped, hit)
    return floor_to(hit, a), reach


def sliding_window_lookup(cache, sizes: Sizes, k, hashes, max_length, drop, rules: Rules):
    """vLLM: ``SlidingWindowManager.find_longest_cache_hit`` (DCP 1).

    Scans blocks from ``M // b`` down for the highest run of ``ceil((W - 1) / b)`` cached blocks (one more,
    the EAGLE peek, when dropping) whose right edge passes the alignment gate (the edge, or when dropping
    the edge minus the peek block, is a multiple of ``A``); the hit is that edge, minus the peek block when
    dropping. With no such run (short prompts) it takes the run from block 0, aligns it, and, when
    dropping, pops one block and aligns again (with ``drop_before_align``: pops, then aligns). It reads from block ``M // b - 1`` without checking the
    hashes: ``reach`` can pass ``|H| * h``, which raises ``IndexError`` in vLLM.
    """
    sg = sizes.groups[k]
    b = sg.block
    a = sizes.alignment
    need = cdiv(sg.window - 1, b)
    top = max_length // b * b
    found_keep = cache.last_held(k, step=a, lo=need * b - 1, hi=top, unit=b, before=need, after=0)
    run = cache.run_from(k, start=0, unit=b, limit=max_length // b) * b
    short_keep = floor_to(run, a)
    keep = ite(found_keep > 0, found_keep, short_keep)
    if drop is False:  # a group that never drops is never read past its window
        return keep, top
    found_drop = cache.last_held(k, step=a, lo=need * b - 1, hi=top - b, unit=b, before=need, after=1)
    if rules.drop_before_align:
        short_drop = ite(run >= b, floor_to(run - b, a), 0)
    else:
        gated = floor_to(ite(run >= b, floor_to(run - b, a) + b, 0), a)
        short_drop = ite(gated > 0, floor_to(gated - b, a), 0)
    dropped = ite(found_drop > 0, found_drop, short_drop)
    return ite(drop, dropped, keep), top


def mamba_lookup(cache, sizes: Sizes, k, hashes, max_length, drop, rules: Rules):
    """vLLM: ``MambaManager.find_longest_cache_hit``: the highest single cached state at an aligned
    boundary at most ``M``; at hash granularity (capped by the hashes) when partial hits are on. It never
    drops. Without partial hits it reads from block ``M // b - 1`` without checking the hashes."""
    sg = sizes.groups[k]
    a = sizes.alignment
    if sg.fine:
        top = min_(max_length // a, hashes * sizes.hash_block // a) * a
        return cache.last_held(k, step=a, lo=0, hi=top, unit=a, before=1, after=0), top
    top = max_length // sg.block * sg.block
    return cache.last_held(k, step=a, lo=0, hi=top, unit=sg.block, before=1, after=0), top


def skipped_blocks(sg, max_length):
    """The blocks a chunked-local lookup at ``M`` counts as computed without reading them: those before the
    chunk that holds ``M`` (vLLM ``local_attention_start_idx // block_size``; null blocks, never computed)."""
    return ite(max_length > 0, floor_to(max_length, sg.chunk), 0) // sg.block


def chunked_local_lookup(cache, sizes: Sizes, k, hashes, max_length, drop, rules: Rules):
    """vLLM: ``ChunkedLocalAttentionManager.find_longest_cache_hit``: blocks before the chunk that holds
    ``M`` count as computed; then the run of cached blocks from that chunk's first block up to ``M // b``.
    Reads without checking the hashes."""
    sg = sizes.groups[k]
    b = sg.block
    start = skipped_blocks(sg, max_length)
    end = max_length // b
    run = cache.run_from(k, start=start, unit=b, limit=end)
    reach = ite(start < end, min_(start + run + 1, end) * b, 0)
    return (start + run) * b, reach


def lookup(cache, sizes: Sizes, k, hashes, max_length, drop, rules: Rules):
    """The lookup of spec group ``k``'s kind (vLLM: ``manager_cls.find_longest_cache_hit``)."""
    kind = sizes.groups[k].kind
    if kind is Kind.FULL:
        return full_attention_lookup(cache, sizes, k, hashes, max_length, drop, rules)
    if kind is Kind.SWA:
        return sliding_window_lookup(cache, sizes, k, hashes, max_length, drop, rules)
    if kind is Kind.MAMBA:
        return mamba_lookup(cache, sizes, k, hashes, max_length, drop, rules)
    return chunked_local_lookup(cache, sizes, k, hashes, max_length, drop, rules)


# ----------------------------------------------------------------------------------------------------
# vLLM's coordinators
# ----------------------------------------------------------------------------------------------------


def unitary_hit_tokens(cache, sizes: Sizes, n_tokens, rules: Rules):
    """vLLM: ``UnitaryKVCacheCoordinator.find_longest_cache_hit``: one lookup at ``M = N - 1`` with
    alignment = the block, dropping when the group is an EAGLE group. No eagle margin (``unitary_margin``:
    the lookup peeks one drop unit past ``M``, within the hashes, before it drops), no cap by the hashes
    (``cap_at_hashes``: ``M`` at most ``|H| * h``)."""
    hashes = num_hashes(sizes, n_tokens)
    sg = sizes.groups[0]
    bound = capped_length(cache, sizes, n_tokens, rules)
    if sg.drops and sg.kind is not Kind.MAMBA and rules.unitary_margin:  # Mamba never drops (as in the loop)
        bound = min_(bound + sg.margin, hash_reach(sizes, n_tokens))
    hit, reach = lookup(cache, sizes, 0, hashes, bound, sg.drops, rules)
    return hit, reach, hit, True


def max_length_within_hashes(sizes: Sizes, n_tokens, rules: Rules):
    """Where vLLM's coordinators start: ``M`` (:func:`max_cache_hit_length`), with ``cap_at_hashes`` at
    most ``|H| * h``; the reference's cap (:func:`reference_hit_tokens`) is always within the hashes."""
    m = max_cache_hit_length(n_tokens, rules)
    if rules.cap_at_hashes or rules.declarative:
        return min_(m, hash_reach(sizes, n_tokens))
    return m


def lookup_cap(cache, sizes: Sizes, covered):
    """The leading whole blocks of the capped spec group (``sizes.cap_group``, full attention) within the
    ``covered`` tokens the hashes cover, in tokens: vLLM 0.33's auxiliary outputs cap every lookup at
    ``min(k * b, N - 1)`` (``AuxOutputSchedulerConnector.max_cache_hit``), ``k`` the group's leading blocks
    that the pool or the connector's store holds. The store keeps the blocks the pool held when each request
    finished; the spec's cache is the pool, and ``k`` its run. Where the store holds more, a group read at its
    block serves no more than its run anyway; the adapter enforces no layout whose capped group is read at
    hash granularity (``engine.aux_cap_reason``)."""
    sg = sizes.groups[sizes.cap_group]
    return cache.run_from(sizes.cap_group, start=0, unit=sg.block, limit=covered // sg.block) * sg.block


def capped_top(cache, sizes: Sizes, bound, covered):
    """``bound``, at most :func:`lookup_cap` on a layout whose lookups are capped (``covered``: the tokens
    the hashes cover)."""
    if sizes.cap_group is None:
        return bound
    return min_(bound, lookup_cap(cache, sizes, covered))


def capped_length(cache, sizes: Sizes, n_tokens, rules: Rules):
    """Where vLLM's coordinators start on ``cache``: :func:`max_length_within_hashes` within the cap
    (:func:`capped_top`)."""
    return capped_top(cache, sizes, max_length_within_hashes(sizes, n_tokens, rules), hash_reach(sizes, n_tokens))


def pass_lookup(cache, sizes: Sizes, k, hashes, c, drop, rules: Rules):
    """Spec group ``k``'s lookup in a pass of vLLM's loop at candidate ``c``: ``(length, reach)``. With
    ``drop`` (the group drops this pass), an EAGLE group other than Mamba peeks one margin past ``c``
    (capped by the hashes) and pops it."""
    sg = sizes.groups[k]
    bound = c
    if sg.drops and sg.kind is not Kind.MAMBA and rules.eagle_margin:
        peek = c + sg.margin
        if rules.peek_within_hashes:
            peek = min_(peek, hashes * sizes.hash_block)
        bound = ite(drop, peek, c)
    return lookup(cache, sizes, k, hashes, bound, and_(drop, rules.pop_after_peek), rules)


def hybrid_pass(cache, sizes: Sizes, hashes, hit_length, verified, lengths, first, rules: Rules):
    """One pass of vLLM's ``HybridKVCacheCoordinator.find_longest_cache_hit`` loop.

    Spec groups in order (full attention first). A full-attention group is looked up on the first pass
    only; later passes trim the candidate to its length (its cache is downward-closed). Any other group is
    looked up at the candidate; an EAGLE group not yet verified peeks one margin past it (capped by the
    hashes) and drops. A drop marks the group verified; a shrink by a lookup that did not drop clears
    every verification (with ``reverify_after_shrink``, every shrink does, before the drop's own mark).

    Returns:
        ``(candidate, verified, lengths, longest, reach)`` after the pass.
    """
    c = hit_length
    verified = list(verified)
    lengths = list(lengths)
    longest = 0
    reach = 0
    for k, sg in enumerate(sizes.groups):
        if sg.kind is Kind.FULL and not first:
            c = min_(c, lengths[k])
            continue
        drop = sg.drops
        if rules.drop_once:
            drop = and_(sg.drops, not_(verified[k]))
        n, r = pass_lookup(cache, sizes, k, hashes, c, drop, rules)
        cleared = n < c if rules.reverify_after_shrink else and_(not_(drop), n < c)
        verified = [ite(cleared, False, v) for v in verified]
        verified[k] = or_(verified[k], drop)
        c = n
        lengths[k] = n
        longest = max_(longest, c)
        reach = max_(reach, r)
    return c, tuple(verified), tuple(lengths), longest, reach


def is_simple(sizes: Sizes) -> bool:
    """Two spec groups led by full attention: vLLM stops after one pass (its ``simple`` case)."""
    return len(sizes.groups) == 2 and sizes.groups[0].kind is Kind.FULL


def pass_bound(sizes: Sizes) -> int:
    """How many passes the Z3 lowering unrolls (Python loops until the fixed point)."""
    if is_simple(sizes):
        return 1
    return len(sizes.groups) + 1


def hybrid_hit_tokens(cache, sizes: Sizes, n_tokens, rules: Rules):
    """vLLM: ``HybridKVCacheCoordinator.find_longest_cache_hit``: passes of :func:`hybrid_pass` from
    ``M = N - 1`` until a pass no longer lowers the candidate, or after one pass when the layout is two
    spec groups led by full attention (the ``simple`` case)."""
    hashes = num_hashes(sizes, n_tokens)
    simple = is_simple(sizes)
    hit_length = capped_length(cache, sizes, n_tokens, rules)
    verified = tuple(False for _ in sizes.groups)
    lengths = tuple(0 for _ in sizes.groups)
    longest = 0
    reach = 0
    done = False
    for index in passes(pass_bound(sizes)):
        c, new_verified, new_lengths, new_longest, new_reach = hybrid_pass(
            cache, sizes, hashes, hit_length, verified, lengths, index == 0, rules)
        converged = or_(c >= hit_length, simple)
        hit_length, verified, lengths, longest, reach = ite(
            done,
            (hit_length, verified, lengths, longest, reach),
            (ite(c >= hit_length, hit_length, c), new_verified, new_lengths,
             max_(longest, new_longest), max_(reach, new_reach)))
        done = or_(done, converged)
        if stop(done):
            break
    return hit_length, reach, longest, done


# ----------------------------------------------------------------------------------------------------
# kvhit's reference: the longest aligned length that every group can serve
# ----------------------------------------------------------------------------------------------------


def full_attention_extent(cache, sizes: Sizes, k, covered):
    """The longest prefix spec group ``k`` (full attention) can serve, within the ``covered`` tokens the
    hashes cover: its leading run of cached blocks, or, when it is looked up at hash granularity, the
    highest cached boundary inside the next block (as vLLM ``FullAttentionManager.find_longest_cache_hit``
    finds them). Hashes are prefix-chained, so a cached boundary vouches for every token before it: the
    extent is downward-closed."""
    sg = sizes.groups[k]
    b = sg.block
    run = cache.run_from(k, start=0, unit=b, limit=covered // b) * b
    if not sg.fine:
        return run
    a = sizes.alignment
    partial = cache.last_held(k, step=a, lo=run, hi=min_(run + b - a, covered), unit=a, before=1, after=0)
    return max_(run, partial)


def group_serves(cache, sizes: Sizes, k, x, extent, covered, rules: Rules):
    """Whether spec group ``k`` can serve a hit of ``x`` tokens (``x`` a multiple of ``A``).

    * full attention: its cached prefix reaches ``x`` (``extent``, see :func:`full_attention_extent`);
    * sliding window: the ``ceil((W - 1) / b)`` blocks before ``x`` are cached (fewer near the start);
    * Mamba: the state at boundary ``x`` is cached;
    * chunked local: the blocks from ``x``'s chunk start to ``x`` are cached.

    A dropping EAGLE group must also hold its drop unit ``[x, x + margin)``, within the ``covered``
    tokens the hashes cover: that unit is what it recomputes. Mamba never drops (its checkpoints handle
    EAGLE on the write side).
    """
    sg = sizes.groups[k]
    a = sizes.alignment
    b = sg.block
    unit = 0
    if sg.drops and rules.eagle_recompute and sg.kind is not Kind.MAMBA:
        unit = sg.margin
    if sg.kind is Kind.FULL:
        return x + unit <= extent
    if sg.kind is Kind.SWA:
        after = 1 if unit > 0 else 0
        return and_(x + unit <= covered,
                    cache.window(k, x, unit=b, before=cdiv(sg.window - 1, b), after=after))
    if sg.kind is Kind.MAMBA:
        if sg.fine:
            return cache.window(k, x, unit=a, before=1, after=0)
        return cache.window(k, x, unit=b, before=1, after=0)
    return cache.window(k, x, unit=b, before=x % sg.chunk // b, after=0)


def serves_all(cache, sizes: Sizes, x, extents, covered, rules: Rules):
    """Whether every spec group can serve a hit of ``x`` tokens (see :func:`group_serves`), within the cap
    of a layout whose lookups are capped (:func:`lookup_cap`: a hit past it is not the scheduler's to
    take, though a dropping group's unit past it may be cached, as vLLM's peek finds it)."""
    ok = True
    if sizes.cap_group is not None:
        ok = x <= lookup_cap(cache, sizes, covered)
    for k in range(len(sizes.groups)):
        ok = and_(ok, group_serves(cache, sizes, k, x, extents[k], covered, rules))
    return ok


def group_extents(cache, sizes: Sizes, covered):
    """Each full-attention group's cached prefix (0 for other kinds, which do not use it)."""
    extents = []
    for k, sg in enumerate(sizes.groups):
        if sg.kind is Kind.FULL:
            extents.append(full_attention_extent(cache, sizes, k, covered))
        else:
            extents.append(0)
    return tuple(extents)


def reference_pass(cache, sizes: Sizes, bound, extents, covered, rules: Rules):
    """The longest multiple of ``A`` at most ``bound`` that every group serves (0 if none).

    Full-attention groups are downward-closed, so their extents bound the scan from above before any
    candidate is tried. A chunked-local group (alone, or beside full attention only: the spec models no
    other layout with one) keeps vLLM's lookup up to that bound, which is already the longest: every point
    of the bound's chunk up to the lookup's hit is served (its blocks from the chunk start are cached), the
    next is not (its block is not), and every point of an earlier chunk is at most the chunk start, which
    needs no block.
    """
    top = capped_top(cache, sizes, bound, covered)
    for k, sg in enumerate(sizes.groups):
        if sg.kind is Kind.FULL:
            top = min_(top, extents[k])
    chunked = chunked_group(sizes)
    if chunked is not None:
        return chunked_local_lookup(cache, sizes, chunked, hashes=covered // sizes.hash_block, max_length=top,
                                    drop=False, rules=rules)[0]
    return max_aligned(sizes.alignment, top, lambda x: serves_all(cache, sizes, x, extents, covered, rules))


def chunked_group(sizes: Sizes):
    """The chunked-local spec group of the layout, or None (the spec models at most one, beside full
    attention only: :class:`kvhit.spec.domain.Layout` and :func:`kvhit.spec.sizes.derive_sizes`)."""
    for k, sg in enumerate(sizes.groups):
        if sg.kind is Kind.CHUNKED:
            return k
    return None


def prefix_groups(sizes: Sizes) -> tuple:
    """The spec groups whose cache says how far a prompt is shared with what was cached before it: the
    full-attention groups (they keep every block, so their cached prefix is the shared prefix), or, in a
    layout without one, the first spec group (the one vLLM's loop looks up first)."""
    full = tuple(k for k, sg in enumerate(sizes.groups) if sg.kind is Kind.FULL)
    return full or (0,)


def shared_prefix_tokens(cache, sizes: Sizes, bound, extents, covered, rules: Rules):
    """How far the request shares a servable prefix with the cache: the longest multiple of ``A`` at most
    ``bound`` that every group of :func:`prefix_groups` serves (0 if none), whatever the other groups
    hold.

    When it passes the hit, the groups that lag (sliding window, Mamba: they keep state only at some
    boundaries) are what stops the hit there, and the request records it as its shared-prefix junction
    (vLLM ``num_uncached_common_prefix_tokens``, :func:`kvhit.spec.retention.junction_of`): its write side
    keeps the lagging groups' state at the junction, so the next prompt sharing that prefix hits it (a
    shared system prompt served to diverging requests). vLLM's loop gets the same from its first lookup's
    candidate.
    """
    top = capped_top(cache, sizes, bound, covered)
    members = prefix_groups(sizes)
    for k in members:
        if sizes.groups[k].kind is Kind.FULL:
            top = min_(top, extents[k])

    def serves(x):
        ok = True
        for k in members:
            ok = and_(ok, group_serves(cache, sizes, k, x, extents[k], covered, rules))
        return ok

    return max_aligned(sizes.alignment, top, serves)


def reference_hit_tokens(cache, sizes: Sizes, n_tokens, rules: Rules):
    """kvhit's reference policy: the longest hit that every group can serve, a multiple of ``A``, at most
    ``N - 1`` and ``|H| * h``, with each dropping EAGLE group holding (and recomputing) exactly one drop
    unit past it (see :func:`group_serves` and :func:`reference_pass`). ``longest`` is the shared prefix
    (:func:`shared_prefix_tokens`) where the layout has groups that lag it; one group lags nothing (vLLM's
    Unitary coordinator reports no uncached prefix either). Its ``reach`` is ``covered``: every query it
    makes is bounded by the hashes (its runs by ``covered // b``, its windows by ``x + unit <= covered``),
    but the reach is not measured."""
    covered = hash_reach(sizes, n_tokens)
    cap = max_length_within_hashes(sizes, n_tokens, rules)
    extents = group_extents(cache, sizes, covered)
    hit = reference_pass(cache, sizes, cap, extents, covered, rules)
    if sizes.unitary or not rules.record_junction:
        return hit, covered, hit, True
    return hit, covered, max_(hit, shared_prefix_tokens(cache, sizes, cap, extents, covered, rules)), True


def hit_tokens(cache, sizes: Sizes, n_tokens, rules: Rules):
    """The hit of a request of ``n_tokens`` prompt tokens under ``rules``:
    ``(hit, reach, longest, converged)``. A setting the policy's engine lacks is refused
    (:func:`check_speculation`)."""
    check_speculation(sizes, rules)
    if rules.declarative:
        return reference_hit_tokens(cache, sizes, n_tokens, rules)
    if sizes.unitary:
        return unitary_hit_tokens(cache, sizes, n_tokens, rules)
    return hybrid_hit_tokens(cache, sizes, n_tokens, rules)
