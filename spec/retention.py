"""The write side: what a request leaves in the cache, and where a later request can resume.

A request with prompt ``N`` is admitted with a hit of ``start`` tokens and a shared-prefix junction ``J``
(vLLM ``shared_prefix_boundary``; :data:`NO_JUNCTION` for none), prefilled in the chunks the scheduler
cuts, samples one token and ends. The write side says, per spec group, which of the prompt's block
boundaries stay findable, as one :class:`kvhit.spec.cache.Held` per spec group, which the read side then
consumes (:func:`kvhit.spec.cache.written`). Only boundaries up to ``N - L`` matter to a later prompt that
shares the ``N`` tokens: a block hash past them covers tokens past the prompt.

Policies differ in three rules of :class:`kvhit.spec.policy.Rules`:

* ``replay``: where the masks keep state. vLLM 0.33 (``Replay.VLLM``): ``replay_boundaries`` (``N - 1``,
  or with an EAGLE drop one scheduler block below the last and the resend's aligned boundaries);
  historical (``Replay.PROMPT_END``): ``N - 1`` always; reference (``Replay.RESUME``): the points the read
  side itself resumes at, computed by the read side on the cache the request would leave if every state
  were retained, then vLLM's. One definition, two views: what is retained is what is resumed at. The
  scheduler then also ends a chunk at each retained Mamba state, the resend's point is the Mamba prompt
  checkpoint, and a Mamba group read at its block keeps what vLLM's bookkeeping can (one state per block
  slot, one partial tail per request: :func:`mamba_held`); ``replay_at_resume.patch`` in ``docs/upstream/``.
* ``checkpoint_drop``: the Mamba prompt checkpoint the scheduler stops at accounts for the EAGLE drop
  (vLLM 0.33) or not (historical).
* ``junction``: where a request records its junction (vLLM: ``hit + num_uncached``, ``Junction.UNCACHED``).

Known simplifications (stated in the README): one request at a time, a token budget that never cuts a
chunk (only the scheduler's mandatory Mamba stops do), no backend-internal Mamba checkpoints, a request that
samples one token and ends (decode steps would cache more), and a later request keeps the whole tail at
its junction (vLLM keeps only the blocks it computed).
"""

from dataclasses import dataclass, replace

from .cache import Held, live_gaps, written
from .domain import Kind
from .policy import (Junction, Replay, Rules, check_speculation, hit_tokens, max_length_within_hashes, prefix_groups,
                     skipped_blocks)
from .sizes import Sizes, hash_reach
from .terms import and_, cdiv, eq, floor_to, ite, max_, min_, not_, or_

# Absent positions, one name per meaning. Each is -1: every reader ignores a position <= 0 (and a gap whose
# lo >= hi), so an absent entry keeps a tuple's length fixed before the prompt is known, as Z3 needs.
NO_JUNCTION = -1  # the request records no shared-prefix junction (vLLM shared_prefix_boundary 0)
NO_PARTIAL_TAIL = -1  # no partial-tail entry of a full-attention group (an entry of Held.points)
NO_STATE = -1  # no Mamba state (an entry of Held.points, or a chunk end that holds none)
NO_TAIL = -1  # no kept sliding-window tail (an entry of Held.ends)
NO_STOP = -1  # no mandatory chunk stop (an entry of ChunkStops)
NO_GAP = (-1, -1)  # no blocks lost at a chunk stop (an entry of Held.gaps: empty, lo >= hi)


def check_retention(sizes: Sizes, interval):
    """vLLM ``_validate_prefix_cache_retention_interval``: ``None`` (dense), 0 (replay boundaries only)
    or a positive multiple of the scheduler block; anything but 0 needs a sliding-window or Mamba group.

    Raises:
        ValueError: any other value, naming it and the scheduler block.
    """
    if interval is not None and (isinstance(interval, bool) or not isinstance(interval, int) or interval < 0
                                 or interval % sizes.scheduler_block != 0):
        raise ValueError(f"retention interval {interval!r} must be None, 0 or a positive multiple of the "
                         f"scheduler block {sizes.scheduler_block}")
    sparse_kinds = [sg for sg in sizes.groups if sg.kind in (Kind.SWA, Kind.MAMBA)]
    if interval != 0 and not sparse_kinds:
        raise ValueError(f"retention interval {interval!r} needs a sliding-window or Mamba group; this "
                         "layout has none, so use 0 (vLLM raises the same)")


def checkpoint_position(n_tokens, unit: int, drop: bool, lookahead: int):
    """vLLM ``get_mamba_prefill_checkpoint_position``: the prompt's reusable Mamba boundary, leaving the
    last token (or the ``L`` lookahead tokens) to recompute; with the EAGLE drop, one unit lower."""
    if drop:
        return max_(floor_to(n_tokens, unit) - unit, 0)
    return max_(floor_to(n_tokens - max(1, lookahead), unit), 0)


def prompt_checkpoint(sizes: Sizes, n_tokens, rules: Rules):
    """Where vLLM registers the prompt's Mamba state: :func:`checkpoint_position` at the hash unit, with the
    EAGLE drop when the layout drops and ``rules.checkpoint_drop``."""
    return checkpoint_position(n_tokens, sizes.hash_block, sizes.drop and rules.checkpoint_drop, sizes.hash_lookahead)


def reprefillable(sizes: Sizes) -> int:
    """Tokens multi-module MTP may prefill again (vLLM ``num_reprefillable_tokens``)."""
    return max(0, sizes.prefill_lookahead - 1)


def align_cacheable(sizes: Sizes, x):
    """vLLM ``_align_cacheable``: hits are scheduler-block aligned unless partial hits are on."""
    if sizes.partial_hits:
        return x
    return floor_to(x, sizes.scheduler_block)


def cacheable_tokens(sizes: Sizes, k, computed):
    """vLLM ``get_num_cacheable_tokens`` for spec group ``k`` after ``computed`` tokens.

    One group: all but the reprefillable tail. Hybrid: the aligned prefix; a dropping group also one
    block past the aligned boundary (the EAGLE peek), within the finalized tokens.
    """
    finalized = max_(0, computed - reprefillable(sizes))
    if sizes.unitary:
        return finalized
    aligned = align_cacheable(sizes, computed)
    if sizes.groups[k].drops:
        return ite(aligned > 0, min_(finalized, align_cacheable(sizes, finalized) + sizes.groups[k].block),
                   aligned)
    return aligned


def group_extent(sizes: Sizes, k, n_tokens, decoded: bool = False, chunked: bool = True):
    """The prompt-only prefix spec group ``k`` can cache, within its cacheable tokens and ``N - L``: whole
    blocks for attention; for Mamba, boundaries at the unit it is read at (a Mamba state can sit inside a
    block when it is read at hash granularity: the prompt checkpoint's partial tail). ``decoded``: after
    enough decode steps that every prompt token is finalized and aligned (the caching calls of later steps
    reach ``N - L``).

    ``chunked``: the extent bounds a Mamba group's periodic states, which are chunk ends, and the scheduler
    ends no chunk within the prefill lookahead of the prompt end (vLLM ``Scheduler._reserve_prefill_lookahead``;
    a mandatory stop there stalls the prefill instead, S1): with multi-module MTP (``Lp >= 2``) the extent is
    at most ``N - Lp``. A state in ``(N - Lp, N)`` can still lie at the end of a Mamba block that the last
    chunk runs through (:func:`mamba_chunk_ends`; full16 (DCP 2) + Mamba 32 + Mamba 128, MTP 2, ``N = 193``
    admitted at 176: Mamba 32 at 192, kept by vLLM and the model when the mask keeps it), and one at ``N``
    itself is a chunk end (:func:`mamba_held`). Without it: the cacheable
    prefix as the resume points read it (vLLM, patched: ``PromptCacheView``, which finds a hash within the
    group's cacheable tokens whatever the chunks were)."""
    top = n_tokens - sizes.hash_lookahead
    if not decoded:
        top = min_(cacheable_tokens(sizes, k, n_tokens), top)
        if chunked and sizes.groups[k].kind is Kind.MAMBA and sizes.prefill_lookahead >= 2:
            top = min_(top, n_tokens - sizes.prefill_lookahead)
    unit = read_unit(sizes, k) if sizes.groups[k].kind is Kind.MAMBA else sizes.groups[k].block
    return floor_to(max_(top, 0), unit)


def read_unit(sizes: Sizes, k) -> int:
    """The unit spec group ``k``'s single boundaries are read at."""
    sg = sizes.groups[k]
    if sg.fine:
        return sizes.alignment
    return sg.block


def partial_tail_boundary(sizes: Sizes, k, n_tokens, cacheable, covered):
    """vLLM ``FullAttentionManager.partial_tail_boundary`` (``_cache_partial_tail_block``'s arithmetic,
    factored out by the patch): the prompt's last hash boundary, at most ``N`` for an EAGLE group and
    ``N - 1`` otherwise (the token limit) and within the ``covered`` tokens the request's hashes cover, when
    it lies inside a block of full-attention group ``k`` and within the ``cacheable`` tokens of the call.
    ``(x, ok)``: the boundary and whether the call registers it."""
    sg = sizes.groups[k]
    limit = floor_to(n_tokens if sg.drops else n_tokens - 1, sizes.hash_block)
    x = min_(limit, covered)
    return x, and_(and_(x > 0, x <= cacheable), not_(eq_zero_mod(x, sg.block)))


def partial_tails(sizes: Sizes, k, n_tokens):
    """vLLM ``FullAttentionManager._cache_partial_tail_block``: the boundary inside a block that a
    full-attention group whose block exceeds the hash unit registers at each caching call, from the
    hashes the request has then: at schedule time (``N`` tokens) and, with a drafter, again after the
    sampled token. A later call that caches the block whole drops the earlier entry. :data:`NO_PARTIAL_TAIL`
    for none."""
    sg = sizes.groups[k]
    h = sizes.hash_block
    if sg.block == h:
        return ()
    cacheable = cacheable_tokens(sizes, k, n_tokens)
    calls = (n_tokens, n_tokens + 1) if sizes.prefill_lookahead > 0 else (n_tokens,)
    points = []
    full_before = 0
    for tokens in calls:
        covered = hash_reach(sizes, tokens)
        full = floor_to(min_(cacheable, covered), sg.block)
        # an entry on a block this call caches whole is replaced by the full entry
        points = [ite(and_(full_before <= floor_to(p, sg.block), floor_to(p, sg.block) < full),
                      NO_PARTIAL_TAIL, p) for p in points]
        x, ok = partial_tail_boundary(sizes, k, n_tokens, cacheable, covered)
        # a block carries one partial entry: a new one replaces an older one on the same block
        points = [ite(and_(ok, eq(floor_to(p, sg.block), floor_to(x, sg.block))), NO_PARTIAL_TAIL, p)
                  for p in points]
        points.append(ite(and_(ok, x <= n_tokens - sizes.hash_lookahead), x, NO_PARTIAL_TAIL))
        full_before = full
    return tuple(points)


def decoded_tail(sizes: Sizes, k, n_tokens):
    """The partial-tail entry full-attention group ``k`` holds for the prompt once a decode step has made
    every prompt token final (``N + 1 + reprefillable`` tokens computed, the sampled one included): that
    step's caching call registers the prompt's last hash boundary when it lies inside a block and within the
    call's cacheable tokens (:func:`partial_tail_boundary`: at most ``N``, or ``N - 1`` without the EAGLE
    drop; vLLM ``_cache_partial_tail_block``, replacing the prefill's entry on that block; the blocks before
    it are then cached whole), and none otherwise. A later prompt sharing the ``N`` tokens can use it only up
    to ``N - L``; once the call completes the block, only the whole block's entry is left, past ``N - L``.
    Longer decoding can move the entry on or complete the block; a state kept for this entry then goes
    unused. :data:`NO_PARTIAL_TAIL` for none (also when the group's block is the hash unit)."""
    sg = sizes.groups[k]
    if sg.block == sizes.hash_block:
        return NO_PARTIAL_TAIL
    tokens = n_tokens + 1 + reprefillable(sizes)
    x, ok = partial_tail_boundary(sizes, k, n_tokens, cacheable_tokens(sizes, k, tokens),
                                  hash_reach(sizes, tokens))
    return ite(and_(ok, x <= n_tokens - sizes.hash_lookahead), x, NO_PARTIAL_TAIL)


def dense_groups(sizes: Sizes, n_tokens, decoded: bool = False):
    """What the request would leave if every state were retained, as the resume points read it: each group
    holds every boundary up to its cacheable extent (full attention also its partial tail; the view of
    :func:`group_extent` without the chunk limit); ``decoded``: once decode steps have cached the rest of the prompt
    (:func:`decoded_tail`)."""
    out = []
    for k, sg in enumerate(sizes.groups):
        points = ()
        if sg.kind is Kind.FULL:
            points = (decoded_tail(sizes, k, n_tokens),) if decoded else partial_tails(sizes, k, n_tokens)
        extent = group_extent(sizes, k, n_tokens, decoded, chunked=False)
        out.append(Held(kind=sg.kind, block=sg.block, unit=read_unit(sizes, k), extent=extent, every=True,
                        points=points))
    return tuple(out)


def far_sibling(sizes: Sizes, n_tokens):
    """A longer prompt sharing the ``N`` tokens whose own cap and hashes do not bind."""
    return n_tokens + 2 * sizes.scheduler_block + sizes.hash_lookahead + 1


def resumes_after_decoding(sizes: Sizes) -> bool:
    """Whether a resend after decoding resumes elsewhere than right after the prefill, so that
    :func:`resume_points` has a fourth point: only where the EAGLE drop and the reprefillable tail of
    multi-module MTP keep the cacheable tokens short of the prompt."""
    return sizes.drop and reprefillable(sizes) > 0


def resume_points(sizes: Sizes, n_tokens, rules: Rules, read=None):
    """Where the read side resumes, with every state retained: a resend, a sibling one token longer, and a
    far sibling (kvhit's reference replay boundaries), on the cache the request leaves when it ends right
    after its prefill; and a resend on the cache it leaves after decoding, whose later caching calls cache
    the prompt's last blocks (without that point a request that decodes would leave less than vLLM's own
    boundaries do: qwen3next, MTP 2, drop, N = 8000 resumes at 6400 after decoding, 4800 without).

    The decoded cache differs only where the EAGLE drop and the reprefillable tail of multi-module MTP keep
    the cacheable tokens short of the prompt, and there its near and far siblings resume where its resend
    does (every catalogue layout at DCP 1, 2, 4 and 8 and every speculative mode, prompts up to 8 alignment
    units; ``tests/properties/test_write_side.py``): one point, and only then. ``read``: how to read a cache
    description (:func:`kvhit.spec.cache.written` unless a caller has a faster reader of the same
    descriptions).

    The hits are the declarative read side's under the policy's rules (the longest aligned length every
    group serves). For the reference that is its own read side; for ``vllm_0_33_repaired``, whose read side
    ``make prove`` proves valid, aligned, capped and the longest valid (so equal to it on every cache), it
    is the same number at the cost of one candidate scan instead of vLLM's unrolled loop
    (``tests/properties/test_write_side.py`` compares the two on concrete prompts)."""
    if not rules.declarative:
        rules = replace(rules, declarative=True)
    groups = dense_groups(sizes, n_tokens)
    dense = written(groups) if read is None else read(groups)
    points = (hit_tokens(dense, sizes, n_tokens, rules)[0], hit_tokens(dense, sizes, n_tokens + 1, rules)[0],
              hit_tokens(dense, sizes, far_sibling(sizes, n_tokens), rules)[0])
    if resumes_after_decoding(sizes):
        groups = dense_groups(sizes, n_tokens, True)
        decoded = written(groups) if read is None else read(groups)
        points += (hit_tokens(decoded, sizes, n_tokens, rules)[0],)
    return points


def replay_boundaries(sizes: Sizes, n_tokens, rules: Rules, read=None):
    """Where the masks keep state for a later request replaying the prompt (vLLM ``replay_boundaries``).

    vLLM: ``N - 1`` (a resend is capped there); with an EAGLE drop, the resend's and a longer sibling's
    aligned boundaries one scheduler block lower. Historical: ``N - 1``. Reference: :func:`resume_points`
    first, then vLLM's boundaries, so that it never keeps less than vLLM does: a prompt that diverges from
    this one inside its last blocks resumes at vLLM's lower boundary under vLLM (block 32, MTP, drop,
    ``R = 0``, ``N = 128``: vLLM keeps 64 and 96, the resume points are 96 only, and a prompt sharing 100
    tokens of it hits 64 under vLLM; vLLM's own ``test_hybrid_mamba_retention_mtp_resend_of_aligned_prompt``;
    DeepSeek-V4, a prompt sharing 20220 of a 45591-token prompt: 16384). With ``rules.vllm_checkpoint``
    and a Mamba group, vLLM's Mamba prompt checkpoint after the resume points
    (``get_mamba_prefill_checkpoint_position`` at the hash unit, where vLLM registers the prompt's state):
    where a full-attention block is coarser than the hash unit (DCP > 1), a resend resumes a block below
    it, and a later prompt sharing a longer prefix with another found vLLM's state there (qwen3next at
    DCP 2, MTP 2, lookahead, ``R = 0``: ``N = 6401``, a long sibling sharing it, then a prompt following
    the sibling: vLLM hits 4800, the reference without it 3200).
    """
    ours = resume_points(sizes, n_tokens, rules, read) if rules.replay == Replay.RESUME else ()
    if rules.vllm_checkpoint and any(sg.kind is Kind.MAMBA for sg in sizes.groups):
        ours += (prompt_checkpoint(sizes, n_tokens, rules),)
    if rules.replay == Replay.PROMPT_END or not sizes.drop:
        return ours + (n_tokens - 1,)
    s = sizes.scheduler_block
    return ours + (max_(floor_to(n_tokens - 1, s) - s, 0), max_(floor_to(n_tokens, s) - s, 0))


def coarse_junctions(sizes: Sizes, junction, rules: Rules):
    """With ``rules.coarse_junction``: the junction floored to the block of each group vLLM's loop looks up
    first (:func:`~kvhit.spec.policy.prefix_groups`) that the alignment is not a multiple of, where vLLM's
    own junction lands (its first lookup's candidate is a multiple of that block). :data:`NO_JUNCTION`
    for none; none without the rule."""
    if not rules.coarse_junction:
        return ()
    out = []
    for b in sorted({sizes.groups[k].block for k in prefix_groups(sizes)}):
        if sizes.alignment % b:
            out.append(ite(junction >= b, floor_to(junction, b), NO_JUNCTION))
    return tuple(out)


def junction_boundaries(sizes: Sizes, k, junction, rules: Rules):
    """Where spec group ``k`` keeps state for the request's shared-prefix junction: the junction; for a
    dropping group with ``rules.junction_below`` one block below it (a sibling that diverges right after the
    junction cannot peek past it: vLLM 0.33 ``SingleTypeKVCacheManager.cache_blocks``; vLLM 0.32 keeps only
    the junction); then the :func:`coarse_junctions`. :data:`NO_JUNCTION` for none."""
    sg = sizes.groups[k]
    here = ite(junction > 0, junction, NO_JUNCTION)
    coarse = coarse_junctions(sizes, junction, rules)
    if not (sg.drops and rules.junction_below):
        return (here,) + coarse
    return (here, ite(junction > 0, junction - sg.block, NO_JUNCTION)) + coarse


def gaps_possible(sizes: Sizes, k) -> bool:
    """Whether spec group ``k`` (a sliding window) can lose blocks before they are cached: only when a
    Mamba group makes the scheduler stop between chunks, and a chunk end can run a window plus a block
    past what that chunk caches (a lag of at most ``S - 1`` tokens, or ``S + Lp - 2b`` behind the EAGLE
    peek; with partial hits at most ``Lp + b - 1``). A static over-approximation: when it says yes,
    :func:`sliding_window_gaps` decides."""
    sg = sizes.groups[k]
    if sg.kind is not Kind.SWA or sizes.partial_hits or not any(g.kind is Kind.MAMBA for g in sizes.groups):
        return False
    return sg.window + sg.block <= sizes.scheduler_block + reprefillable(sizes)


def sliding_window_gaps(sizes: Sizes, k, n_tokens, start, junction, rules: Rules, retained=()):
    """Blocks of sliding-window group ``k`` freed before any caching call covered them.

    vLLM frees the blocks a chunk starting at ``s`` no longer reads (those ending at or before
    ``s - W + 1``, ``SlidingWindowManager.get_num_skipped_tokens``) before caching that chunk; the chunk
    ending at ``s`` cached only its cacheable prefix (``get_num_cacheable_tokens``: aligned, one peek block
    past it when dropping, nothing when the aligned prefix is 0). A block between the two is never cached.
    One ``(lo, hi)`` per scheduler stop (:func:`chunk_stops`); :data:`NO_GAP` at a stop not strictly
    between ``start`` and ``N``.
    """
    if not gaps_possible(sizes, k):
        return ()
    sg = sizes.groups[k]
    b = sg.block
    out = []
    for s in chunk_stops(sizes, n_tokens, start, junction, rules, retained).all():
        inside = and_(start < s, s < n_tokens)
        cached = floor_to(min_(cacheable_tokens(sizes, k, s), hash_reach(sizes, n_tokens)), b)
        freed = floor_to(max_(s - sg.window + 1, 0), b)
        out.append(ite(inside, (cached, freed), NO_GAP))
    return tuple(out)


def sliding_window_held(sizes: Sizes, k, n_tokens, interval, boundaries, rules: Rules, gaps=()):
    """vLLM ``SlidingWindowManager.reachable_block_mask``: the ``need``-block tails a hit needs, ending
    ``shift`` blocks past each aligned boundary; every ``interval`` tokens (every ``A`` when dense); every
    block when a tail would cover a whole segment or the alignment is finer than the block. Blocks in
    ``gaps`` (:func:`sliding_window_gaps`) are not held; a tail reaching into one is not kept at all
    (:data:`NO_TAIL`)."""
    sg = sizes.groups[k]
    b = sg.block
    a = sizes.alignment
    extent = group_extent(sizes, k, n_tokens)
    shift = 1 if sg.drops else 0
    need = cdiv(sg.window - 1, b) + shift
    all_blocks = Held(kind=Kind.SWA, block=b, unit=b, extent=extent, every=True, need=need, shift=shift,
                      gaps=gaps)
    if a % b != 0:
        return all_blocks
    dense = interval is None or (interval == 0 and not rules.sparse_zero)
    segment = a if dense else interval
    if segment > 0 and need >= segment // b:
        return all_blocks
    ends = ()
    if not dense:
        ends = []
        for x in boundaries:
            t = floor_to(x, a) + shift * b
            lost = False
            for lo, hi in gaps:
                lost = or_(lost, and_(and_(lo < hi, lo < t), t - need * b < hi))
            ends.append(ite(lost, NO_TAIL, t))
        ends = tuple(ends)
    return Held(kind=Kind.SWA, block=b, unit=b, extent=extent, every=False, ends=ends, need=need, shift=shift,
                period=segment, gaps=gaps)


@dataclass(frozen=True)
class ChunkStops:
    """The scheduler's mandatory chunk ends of a prefill from ``start`` (vLLM
    ``_mamba_block_aligned_split``'s ``stops``), unfiltered: a stop counts only strictly between ``start``
    and ``N``; an absent one is :data:`NO_STOP`.

    Attributes:
        mandatory: the positions a chunk must end at, in this order: the prompt checkpoint at the config
            block (vLLM ``last_cache_position``), with partial hits the partial-hit tail past it (vLLM
            ``tail_boundary``), and the junction floored to the config block past ``start`` (vLLM
            ``junction_stop``). The next chunk starts at each.
        retained: under ``Replay.RESUME``, the retained Mamba states the scheduler also ends a chunk at
            (:func:`retained_stops`; the periodic ones are not listed: :func:`mamba_held`).
        block_ends: the end of the config block that ``start`` and each of those but the checkpoint (a
            multiple of the config block already) lies in (vLLM ``next_block_boundary``: a chunk that
            starts inside a config block stops at its end); the retained stops' only when the alignment is
            not a multiple of the config block.
    """

    mandatory: tuple = ()
    retained: tuple = ()
    block_ends: tuple = ()

    def all(self) -> tuple:
        """Every stop: the mandatory ones, the retained ones, then the block ends."""
        return self.mandatory + self.retained + self.block_ends


def chunk_stops(sizes: Sizes, n_tokens, start, junction, rules: Rules, retained=()) -> ChunkStops:
    """The scheduler's mandatory chunk ends when a Mamba group is present (vLLM
    ``_mamba_block_aligned_split``, ``block_size`` = the config block; none without a Mamba group): see
    :class:`ChunkStops`. ``retained``: :func:`retained_stops` (none unless ``Replay.RESUME``)."""
    if not any(sg.kind is Kind.MAMBA for sg in sizes.groups):
        return ChunkStops()
    big = sizes.config_block
    last_cache_position = checkpoint_position(n_tokens, big, sizes.drop and rules.checkpoint_drop,
                                              sizes.hash_lookahead)
    later = []  # the stops past the checkpoint
    if sizes.partial_hits:
        tail = prompt_checkpoint(sizes, n_tokens, rules)
        later.append(ite(and_(last_cache_position < tail, tail < n_tokens), tail, NO_STOP))
    later.append(ite(and_(start < junction, junction < n_tokens), start + floor_to(junction - start, big),
                     NO_STOP))
    inside = list(retained) if sizes.alignment % big else []  # a retained stop is a multiple of A
    return ChunkStops(mandatory=(last_cache_position,) + tuple(later), retained=tuple(retained),
                      block_ends=tuple(ceil_to(e, big) for e in [start] + later + inside))


def retained_stops(sizes: Sizes, n_tokens, boundaries, start, junction, rules: Rules):
    """Where the scheduler also ends a chunk so that a Mamba state exists wherever one is retained, under
    ``Replay.RESUME`` (vLLM, patched: ``KVCacheCoordinator.next_mamba_state_boundary``, one more entry of
    ``_mamba_block_aligned_split``'s ``stops``): each replay boundary, the junction and its
    :func:`coarse_junctions` floored to the alignment, within ``(start, N - max(Lp, 1)]`` (no chunk may
    end within the prefill lookahead of the prompt end, ``_reserve_prefill_lookahead``) and some Mamba
    group's cached tokens at the prompt end (its cacheable tokens within the hashes). The scheduler also
    stops at every multiple of the retention interval (of ``max(A, b)`` when dense) there: those are the
    Mamba groups' periodic states (:func:`mamba_held`), not listed. :data:`NO_STOP` for an absent one;
    none under another ``replay`` rule."""
    if rules.replay != Replay.RESUME:
        return ()
    top = n_tokens - max(sizes.prefill_lookahead, 1)
    cached = []
    for k, sg in enumerate(sizes.groups):
        if sg.kind is Kind.MAMBA:
            cached.append(min_(cacheable_tokens(sizes, k, n_tokens), hash_reach(sizes, n_tokens)))
    if not cached:
        return ()
    out = []
    for x in tuple(boundaries) + (junction,) + coarse_junctions(sizes, junction, rules):
        p = floor_to(x, sizes.alignment)
        within = False
        for c in cached:
            within = or_(within, p <= c)
        out.append(ite(and_(and_(start < p, p <= top), within), p, NO_STOP))
    return tuple(out)


def mamba_chunk_ends(sizes: Sizes, n_tokens, block: int, start, junction, rules: Rules, retained=()):
    """Where a Mamba group of ``block`` tokens holds a state after a prefill (vLLM
    ``_mamba_block_aligned_split`` with a budget that never binds): the chunk ends (the prompt
    checkpoint, the partial-hit tail, the junction floored to the config block, the retained states of
    ``retained``, the end of a config block a chunk started inside) and the end of each Mamba block a chunk
    ran through after starting inside it; each only strictly between ``start`` and ``N``; then ``N``. Others
    are :data:`NO_STATE`."""
    stops = chunk_stops(sizes, n_tokens, start, junction, rules, retained)
    # A chunk that starts inside a Mamba block carries the state on to that block's end, where its slot
    # then holds it: the start and the checkpoint, partial-hit tail, junction and retained stops.
    inside = stops.retained if sizes.alignment % block else ()  # a retained stop is a multiple of A
    ends = stops.all() + tuple(ceil_to(e, block) for e in (start,) + stops.mandatory + inside)
    return tuple(ite(and_(start < e, e < n_tokens), e, NO_STATE) for e in ends) + (n_tokens,)


def ceil_to(x, unit: int):
    """``x`` rounded up to a multiple of ``unit``."""
    return cdiv(x, unit) * unit


def mamba_at_hash_granularity(sizes: Sizes) -> bool:
    """Whether a Mamba group is read at hash granularity (its hits may end inside a block): its states inside a
    block are partial tails, of which vLLM, and so the reference (:func:`mamba_held`), keeps one per request."""
    return any(sg.kind is Kind.MAMBA and sg.fine for sg in sizes.groups)


# Why write_side_unmodelled leaves a layout out: the two speculative settings whose write side the spec does
# not model, each named once (the adapter's log line and status file start with it).
ONLY_MAMBA_DROPS = "EAGLE drop mode in which only Mamba groups drop"
FINE_MAMBA_MTP_DROP = "a Mamba group read at hash granularity that drops, in EAGLE drop mode with multi-module MTP"
CAPPED_FINE_MAMBA_MTP_DROP = ("lookups capped by auxiliary outputs beside a Mamba group read at hash granularity, in "
                              "EAGLE drop mode with multi-module MTP")


def write_side_unmodelled(sizes: Sizes) -> str:
    """Why the reference's write side is not modelled on this layout and speculative setting, or ``""``
    where it is. Such a layout is left wholly to vLLM by the adapter, and the default proof domain leaves its
    write side out (``kvhit prove --extended`` still checks it; it refutes a write-side claim of each kind):

    - :data:`FINE_MAMBA_MTP_DROP`: a Mamba group read at hash granularity that drops itself (vLLM flags every
      group when its planner flags none), with multi-module MTP (``Lp >= 2``) in drop mode. Its caching calls
      end ``Lp - 1`` tokens before the chunk, so no partial tail is kept at the resend's resume point:
      ``scheduler_and_mask_boundaries_agree`` fails (``qwen3next_pmu160`` with no group flagged EAGLE, dense,
      ``N = 478``: the first repeat hits 0, a cache holding every state 160; ``three_kind``, dense,
      ``N = 4800``: the first repeat and a longer sibling hit 1600 where every state retained gives 3040).
    - :data:`ONLY_MAMBA_DROPS`: drop mode in which every dropping group is a Mamba group. The reference's
      Mamba lookups never drop, and ``reference_never_below_vllm`` is refuted there (``mamba16``, ``R = 0``).
    - :data:`CAPPED_FINE_MAMBA_MTP_DROP`: lookups capped at full attention's leading whole blocks (auxiliary
      outputs) beside a Mamba group read at hash granularity, with multi-module MTP in drop mode. A resend's
      capped resume point then lies inside a Mamba block, a block below vLLM's prompt checkpoint, and a
      request keeps one partial tail: at the resume point, a prompt that later shares more of it finds
      vLLM's tail where the reference kept none (``reference_never_below_vllm`` refuted: 11200 tokens, a
      prompt of 1920 sharing 1761, then one of 6399 sharing 4799 with the first hit 1600 where vLLM hits
      1760); at vLLM's checkpoint, the first repeat misses the resume point
      (``scheduler_and_mask_boundaries_agree`` fails: ``N = 3840``, 1600 where every state retained gives
      3040, measured with the tail moved there on 2026-12-08). :func:`resume_tail` keeps the first.
    """
    if (sizes.drop and sizes.prefill_lookahead >= 2 and mamba_at_hash_granularity(sizes)
            and any(sg.kind is Kind.MAMBA and sg.drops for sg in sizes.groups)):
        return (f"{FINE_MAMBA_MTP_DROP}: its caching calls end Lp - 1 tokens before the chunk, so no partial "
                "tail is kept at the resend's resume point (scheduler_and_mask_boundaries_agree fails on "
                "concrete prompts, e.g. qwen3next_pmu160 with no group flagged EAGLE, dense retention, "
                "N = 478: the first repeat hits 0, a cache holding every state 160)")
    if sizes.drop and sizes.prefill_lookahead >= 2 and sizes.cap_group is not None and mamba_at_hash_granularity(sizes):
        return (f"{CAPPED_FINE_MAMBA_MTP_DROP}: a resend's capped resume point lies inside a Mamba block below "
                "vLLM's prompt checkpoint, and a request keeps one partial tail, so the reference's write side "
                "either misses the first repeat or gives less than vLLM's (reference_never_below_vllm fails on "
                "concrete prompts: 11200 tokens, a prompt of 1920 sharing 1761, then one of 6399 sharing 4799 "
                "with the first hit 1600 where vLLM hits 1760)")
    dropping = [sg.kind for sg in sizes.groups if sg.drops]
    if dropping and all(kind is Kind.MAMBA for kind in dropping):
        return (f"{ONLY_MAMBA_DROPS}: the reference's Mamba lookups never drop, and its write side is not proved "
                "never below vLLM's there (kvhit prove --extended refutes reference_never_below_vllm on one "
                "Mamba group in drop mode)")
    return ""


def resume_period(sizes: Sizes, block: int, interval, rules: Rules) -> int:
    """Under ``Replay.RESUME``, the step of the periodic states of a Mamba group of ``block`` tokens: the
    scheduler ends a chunk at every multiple of it (vLLM, patched: ``next_mamba_state_boundary``): the
    retention interval when positive, ``max(A, b)`` when dense (retention None, or 0 read as dense without
    ``rules.sparse_zero``; a hit is a multiple of ``A`` and a cached state a block end), else 0 (none)."""
    if interval is not None and interval > 0:
        return interval
    if interval is None or not rules.sparse_zero:
        return max(sizes.alignment, block)
    return 0


def resume_tail(sizes: Sizes, n_tokens, boundaries, rules: Rules):
    """Where the reference keeps the prompt's Mamba checkpoint, its one partial tail (``boundaries``:
    :func:`replay_boundaries` under ``Replay.RESUME``, the :func:`resume_points` first): where a resend
    resumes right after the prefill; where it resumes after decoding, when that one is nowhere (multi-module
    MTP in drop mode, whose reprefillable tail keeps a short prompt's cacheable tokens below a hit). Without
    the second, a prompt of at most one full-attention block kept no tail where vLLM keeps its checkpoint,
    and a later prompt that shares the tail and a longer prefix with another hit less than under vLLM
    (Qwen3.5's layout at 160-token hash units, MTP 2, drop: prompts of 320, a 4162-token sibling, then one
    sharing 3157 of it: 0 where vLLM hits 160).

    With ``rules.checkpoint_tail_when_capped``, where lookups are capped (auxiliary outputs) and a Mamba group
    is read at hash granularity, the resend's resume point only where it lies inside a Mamba block (a state
    there is a tail or nothing); where it is a block end (held as a block state) or 0, vLLM's prompt
    checkpoint, where vLLM keeps its tail. A resend is capped at the prompt's leading whole blocks, so a short
    prompt's resume point is 0, and a later prompt that shares more of it, once another request's blocks
    raise its cap, found vLLM's tail where the reference kept none (a prompt of 2080 tokens, its first 801,
    then its first 1600: vLLM hits 800, the reference without the rule 0)."""
    if resumes_after_decoding(sizes):
        resend = ite(boundaries[0] > 0, boundaries[0], boundaries[3])
    else:
        resend = boundaries[0]
    if not (rules.checkpoint_tail_when_capped and sizes.cap_group is not None and mamba_at_hash_granularity(sizes)):
        return resend
    block = min(sg.block for sg in sizes.groups if sg.kind is Kind.MAMBA and sg.fine)
    return ite(eq_zero_mod(resend, block), prompt_checkpoint(sizes, n_tokens, rules), resend)


def mamba_held(sizes: Sizes, k, n_tokens, interval, boundaries, start, junction, rules: Rules, retained=()):
    """The Mamba states a request leaves: vLLM's bookkeeping, one state per Mamba block slot and one partial
    tail per request (vLLM ``MambaManager``).

    A state exists at each chunk end (:func:`mamba_chunk_ends`); a block-aligned one is cached when the mask
    keeps it (``MambaManager.reachable_block_mask``: every one when dense or when the interval is at most
    one block; one per ``interval`` tokens; the block ending at or before each aligned boundary), and the
    prompt checkpoint is registered as a tail whatever the mask says (``_cache_partial_tail_block``) when a
    caching call's cacheable tokens end exactly there. vLLM 0.33: the checkpoint is
    ``get_mamba_prefill_checkpoint_position`` at the hash unit. ``Replay.RESUME`` (vLLM, patched): the
    checkpoint is the resend's resume point (:func:`resume_tail`), and the scheduler also ends a chunk at
    each retained state (``retained``, :func:`retained_stops`) and at every multiple of the interval (of
    ``max(A, b)`` when dense: ``next_mamba_state_boundary``) up to the extent, so those are states too: the
    ``period``. The reference keeps this bookkeeping too, on a Mamba group read at hash granularity as on
    any other: a state inside a block is a partial tail, of which vLLM holds one per request, so a reference
    that kept one at every retained point inside a block could not be enforced (and, measured, kept fewer
    block-end states than vLLM's mask, so gave less than vLLM).
    """
    sg = sizes.groups[k]
    b = sg.block
    unit = read_unit(sizes, k)
    extent = group_extent(sizes, k, n_tokens)  # of the periodic states
    # no chunk ends within the prefill lookahead of the prompt end, but a block end the last chunk runs
    # through and the prompt end's own state can be cached
    top = group_extent(sizes, k, n_tokens, chunked=False)
    aligned = tuple(floor_to(x, sizes.alignment) for x in boundaries)
    resume = rules.replay == Replay.RESUME
    # vLLM's mask: every block when dense or when the interval is at most one block (vLLM returns None)
    every_block = interval is not None and interval > 0 and interval // b <= 1
    dense = interval is None or every_block or (interval == 0 and not rules.sparse_zero)
    period = interval if (interval is not None and interval > 0 and not every_block) else 0
    if resume:  # every multiple of the interval within the extent is a chunk end, so a state
        period = resume_period(sizes, b, interval, rules)
    ends = mamba_chunk_ends(sizes, n_tokens, b, start, junction, rules, retained)
    points = []
    for e in ends:
        kept = dense
        if period > 0:
            kept = or_(kept, eq_zero_mod(e, period))
        for x in aligned:
            kept = or_(kept, eq(e, floor_to(x, b)))  # the block ending at or before the boundary
        ok = and_(and_(and_(e > 0, e <= top), eq_zero_mod(e, b)), kept)
        points.append(ite(ok, e, NO_STATE))
    if resume:
        tail = resume_tail(sizes, n_tokens, boundaries, rules)
    else:
        tail = prompt_checkpoint(sizes, n_tokens, rules)
    is_end = False
    for e in ends:
        is_end = or_(is_end, eq(e, tail))
    # registered by a caching call whose cacheable tokens end exactly there: one at a chunk end (a scheduler
    # stop) or the last one (a state that only lands at a Mamba block's end inside a chunk gets no call)
    called = eq(cacheable_tokens(sizes, k, n_tokens), tail)
    for c in chunk_stops(sizes, n_tokens, start, junction, rules, retained).all():
        called = or_(called, and_(and_(start < c, c < n_tokens), eq(cacheable_tokens(sizes, k, c), tail)))
    ok = and_(and_(and_(tail > 0, tail <= n_tokens - sizes.hash_lookahead), is_end), called)
    points.append(ite(ok, tail, NO_STATE))
    return Held(kind=Kind.MAMBA, block=b, unit=unit, extent=extent, every=False, points=tuple(points),
                period=period if resume else 0)


def eq_zero_mod(x, unit: int):
    """Whether ``x`` is a multiple of ``unit``."""
    return eq(x - floor_to(x, unit), 0)


def request_writes(sizes: Sizes, n_tokens, interval, rules: Rules, start=0, junction=NO_JUNCTION,
                   again=False, boundaries=None):
    """What a request with prompt ``N``, admitted with a hit of ``start`` tokens and junction ``J``,
    leaves in the cache: one :class:`Held` per spec group. ``again``: an earlier request with the same
    prompt already left the replay boundaries' sliding-window tails, so only the junction's are new.
    ``boundaries``: :func:`replay_boundaries`, when the caller already has them."""
    check_retention(sizes, interval)
    check_speculation(sizes, rules)
    if boundaries is None:
        boundaries = replay_boundaries(sizes, n_tokens, rules)
    retained = retained_stops(sizes, n_tokens, boundaries, start, junction, rules)
    out = []
    for k, sg in enumerate(sizes.groups):
        at = boundaries + junction_boundaries(sizes, k, junction, rules)
        if sg.kind is Kind.SWA:
            if again:
                at = junction_boundaries(sizes, k, junction, rules)
            gaps = sliding_window_gaps(sizes, k, n_tokens, start, junction, rules, retained)
            held = sliding_window_held(sizes, k, n_tokens, interval, at, rules, gaps)
            if gaps and not (isinstance(start, int) and start == 0):
                # what this request writes starts at its hit: the blocks before it are the earlier
                # request's (see merge)
                held = replace(held, gaps=gaps + ((0, floor_to(max_(start, 0), sg.block)),))
            out.append(held)
        elif sg.kind is Kind.MAMBA:
            out.append(mamba_held(sizes, k, n_tokens, interval, at, start, junction, rules, retained))
        elif sg.kind is Kind.CHUNKED:
            out.append(chunked_local_held(sizes, k, n_tokens, start, rules))
        else:
            points = ()
            if sg.kind is Kind.FULL:
                points = partial_tails(sizes, k, n_tokens)
            out.append(Held(kind=sg.kind, block=sg.block, unit=read_unit(sizes, k),
                            extent=group_extent(sizes, k, n_tokens), every=True, points=points))
    return tuple(out)


def chunked_local_held(sizes: Sizes, k, n_tokens, start, rules: Rules):
    """What chunked-local group ``k`` holds of the prompt: every block up to its extent but those its
    lookup counted as computed without reading them (vLLM ``ChunkedLocalAttentionManager``: null blocks
    before the chunk holding the lookup's bound, never computed nor cached; its mask caches every other
    block). Every hit of that lookup lies in that chunk, and the blocks between its start and the hit are
    the cached ones the hit found: a gap ``[0, skipped)``, the rest held.

    Alone, the lookup's bound is the request's ``M``, so what the request leaves does not depend on its
    hit (a first request on an empty cache skips that chunk's start too). Beside full attention (Llama 4)
    the bound is the full-attention groups' hit, which is as long as the layout's hit ``start`` up to the
    end of its chunk (the chunked lookup returns at least the bound's chunk start): the gap ends at
    ``start``'s chunk start."""
    sg = sizes.groups[k]
    bound = max_length_within_hashes(sizes, n_tokens, rules) if sizes.unitary else start
    skipped = skipped_blocks(sg, bound) * sg.block
    return Held(kind=Kind.CHUNKED, block=sg.block, unit=sg.block, extent=group_extent(sizes, k, n_tokens),
                every=True, gaps=((0, skipped),))


def merge(old, new):
    """The cache after a later request with the same prompt wrote ``new`` on top of ``old``.

    A block is held when either request holds it. Both keep every block, or the same periodic tails (same
    prompt, same interval), and each drops whole the explicit tails reaching into its own gaps, so a block
    is missing exactly when it lies in a gap of both: the gaps become the pairwise intersections."""
    out = []
    for g, h in zip(old, new):
        gaps = tuple((max_(a[0], c[0]), min_(a[1], c[1])) for a in live_gaps(g.gaps) for c in live_gaps(h.gaps))
        out.append(replace(g, points=g.points + h.points, ends=g.ends + h.ends, gaps=gaps))
    return tuple(out)


def junction_of(sizes: Sizes, hit, longest, rules: Rules):
    """Where a request records its junction: vLLM ``hit + num_uncached`` when something was uncached
    (``longest`` is the longest candidate the lookup saw), else none."""
    if rules.junction == Junction.NEXT_BLOCK:
        return hit + sizes.scheduler_block
    return ite(longest > hit, longest, NO_JUNCTION)


def clip(sizes: Sizes, g: Held, shared):
    """What a later prompt that shares only the first ``shared`` tokens of ``g``'s prompt can read of it:
    the boundaries up to ``shared - L`` (the hash of the block ending at ``x`` covers the ``L`` lookahead
    tokens past it; a hash past them covers tokens the two prompts do not share)."""
    top = shared - sizes.hash_lookahead
    absent = NO_STATE if g.kind is Kind.MAMBA else NO_PARTIAL_TAIL
    points = tuple(ite(p <= top, p, absent) for p in g.points)
    return replace(g, extent=min_(g.extent, top), points=points)


def serve(sizes: Sizes, n_tokens, interval, rules: Rules, cache):
    """A request with prompt ``N`` served on ``cache`` (what earlier prompts left, as it can read it):
    ``(hit, reach, converged, junction, what it leaves)``: its lookup (:func:`hit_tokens`), the junction
    it records and its write side."""
    hit, reach, longest, converged = hit_tokens(cache, sizes, n_tokens, rules)
    junction = junction_of(sizes, hit, longest, rules)
    return hit, reach, converged, junction, request_writes(sizes, n_tokens, interval, rules, hit, junction)


def repeat(sizes: Sizes, n_tokens, interval, rules: Rules, groups):
    """One more request with the same prompt on the cache ``groups``: ``(hit, junction, groups after)``."""
    hit, _, longest, _ = hit_tokens(written(groups), sizes, n_tokens, rules)
    junction = junction_of(sizes, hit, longest, rules)
    after = merge(groups, request_writes(sizes, n_tokens, interval, rules, hit, junction, True))
    return hit, junction, after


def repeat_hits(sizes: Sizes, n_tokens, interval, rules: Rules, repeats: int):
    """The hits of ``repeats`` resends of a prompt after its first request on an empty cache."""
    groups = request_writes(sizes, n_tokens, interval, rules)
    hits = []
    for _ in range(repeats):
        hit, _, groups = repeat(sizes, n_tokens, interval, rules, groups)
        hits.append(hit)
    return tuple(hits)


def retained_states(g: Held):
    """What a group retains: Mamba states (one per distinct position; every state at its unit when it
    keeps every one), or sliding-window blocks counted as ``need`` per distinct tail (every block when
    it keeps every one). Sliding-window gaps are not subtracted: an upper bound there."""
    if g.every:
        return g.extent // (g.block if g.kind is Kind.SWA else g.unit)
    total = 0
    if g.period > 0:
        if g.kind is Kind.SWA:
            total = max_(0, (g.extent + (g.need - g.shift) * g.block - 1) // g.period)
        else:
            total = g.extent // g.period
    seen = []
    positions = g.ends if g.kind is Kind.SWA else g.points
    for p in positions:
        fresh = p > 0
        if g.kind is Kind.SWA:
            fresh = and_(fresh, p - g.need * g.block < g.extent)
        if g.period > 0:
            periodic = and_(eq_zero_mod(p - g.shift * g.block, g.period), p >= g.shift * g.block + g.period)
            if g.kind is Kind.MAMBA:
                periodic = and_(eq_zero_mod(p, g.period), p <= g.extent)
            fresh = and_(fresh, not_(periodic))
        for q in seen:
            fresh = and_(fresh, not_(eq(p, q)))
        total = total + ite(fresh, 1, 0)
        seen.append(p)
    if g.kind is Kind.SWA:
        return total * g.need
    return total


def retention_bound(sizes: Sizes, g: Held, n_tokens, interval, boundaries: int):
    """The most :func:`retained_states` may be for a first request: ``ceil(N / R)`` segments (none when
    ``R = 0``) plus the replay boundaries, in states, or in tails of ``need`` blocks for a sliding
    window."""
    count = boundaries
    if interval > 0:
        count = cdiv(n_tokens, interval) + boundaries
    if g.kind is Kind.SWA:
        return count * max(g.need, 1)
    return count
