"""kvhit reference implementation, GENERATED from spec/ by `make gen` (python -m kvhit.spec.codegen). DO NOT EDIT.

Sources: spec/runtime.py, spec/domain.py, spec/sizes.py, spec/cache.py, spec/policy.py, spec/retention.py, spec/api.py (lowered with spec/terms.py's operator table).
spec-sha256: 354c44233853d586b5e8fb63aa334df46d2eb5153aba81fd289ca329167f1ecf
output-sha256: c195a4a0f9d5f67d3ad38ddfa26cdd86153ca8133313d8e12f9800e4535f6fa4
"""

import itertools
import math
from dataclasses import dataclass, field, replace
from enum import Enum


# --------------------------------------------------------------------------------------------------
# spec/runtime.py
# Concrete helpers the policy needs at run time.
#
# Codegen copies this module into ``refimpl`` as it is: it is the Python meaning of the operators that are
# not a one-line expression (the candidate scan) and of the layout arithmetic (lcm, gcd).
# --------------------------------------------------------------------------------------------------

def max_aligned(step, hi, pred):
    """The largest ``x = k * step`` with ``0 < x <= hi`` and ``pred(x)``, or 0 if there is none."""
    x = hi // step * step
    while x > 0:
        if pred(x):
            return x
        x -= step
    return 0

def lcm_all(values):
    """Least common multiple of positive integers."""
    out = 1
    for v in values:
        out = out * v // math.gcd(out, v)
    return out

def gcd_all(values):
    """Greatest common divisor of positive integers."""
    out = 0
    for v in values:
        out = math.gcd(out, v)
    return out


# --------------------------------------------------------------------------------------------------
# spec/domain.py
# Domain types: what a KV-cache layout and a speculative-decoding setting are.
#
# Layout values are always concrete; only request state (prompt length, cache contents) is symbolic.
# Every constructor validates its input and raises ``ValueError`` naming the problem.
# --------------------------------------------------------------------------------------------------

class Kind(str, Enum):
    """The kind of a KV-cache group, i.e. which vLLM manager looks it up.

    vLLM: ``FullAttentionManager`` (also MLA), ``SlidingWindowManager`` (also SWA-MLA),
    ``MambaManager`` (``mamba_cache_mode="align"``), ``ChunkedLocalAttentionManager``.
    """
    FULL = 'full'
    SWA = 'swa'
    MAMBA = 'mamba'
    CHUNKED = 'chunked'

    @property
    def prose(self) -> str:
        """The kind as reports and log lines name it: "full attention", "sliding window", "Mamba", "chunked
        local"."""
        return {'full': 'full attention', 'swa': 'sliding window', 'mamba': 'Mamba', 'chunked': 'chunked local'}[self.value]

class Mode(str, Enum):
    """How EAGLE/MTP speculative decoding protects the last cached block.

    * ``none``: no EAGLE-family drafter.
    * ``lookahead``: each block hash also covers the next ``L`` tokens, so a block is only findable once
      the tokens the draft needs after it exist (vLLM 0.33's default for eagle/mtp without a KV connector).
    * ``drop``: the EAGLE groups recompute one drop unit past the hit (the "eagle drop"; vLLM with a KV
      connector or ``disable_lookahead_block_hashes=True``).
    """
    NONE = 'none'
    LOOKAHEAD = 'lookahead'
    DROP = 'drop'

def _positive_int(value, what):
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f'{what} must be an integer, got {value!r}')
    if value <= 0:
        raise ValueError(f'{what} must be positive, got {value}')
    return value

@dataclass(frozen=True)
class Group:
    """One KV-cache group: a kind, a per-rank block size in tokens, and its flags.

    Attributes:
        kind: which manager looks the group up.
        block_size: tokens per block on one rank (vLLM ``spec.block_size``).
        window: sliding window in tokens (``swa`` only).
        chunk: attention chunk size in tokens (``chunked`` only).
        dcp_sharded: whether decode context parallelism shards this group's KV across ranks, which
            multiplies its effective block size by the DCP size. Attention groups default to sharded,
            Mamba to not (vLLM: ``AttentionSpec.dcp_sharded`` / ``KVCacheSpec.dcp_sharded``).
        eagle: whether the group holds a draft (EAGLE/MTP) layer (vLLM ``is_eagle_group``).
        tokens_per_state: tokens one cached entry summarises (DeepSeek-V4's compressed MLA: 4 or 128);
            the hit alignment must be a multiple of it. Groups that differ only here are not merged.
    """
    kind: Kind
    block_size: int
    window: int | None = None
    chunk: int | None = None
    dcp_sharded: bool | None = None
    eagle: bool = False
    tokens_per_state: int = 1

    def __post_init__(self):
        object.__setattr__(self, 'kind', Kind(self.kind))
        _positive_int(self.block_size, f'{self.kind.value} group block_size')
        _positive_int(self.tokens_per_state, 'tokens_per_state')
        if self.dcp_sharded is None:
            object.__setattr__(self, 'dcp_sharded', self.kind is not Kind.MAMBA)
        if self.kind is Kind.SWA:
            if self.window is None:
                raise ValueError('a sliding-window group needs a window')
            _positive_int(self.window, 'sliding window')
            if self.window < 2:
                raise ValueError(f'sliding window {self.window} keeps no context; the spec needs >= 2')
        elif self.window is not None:
            raise ValueError(f'window is only for sliding-window groups, not {self.kind.value}')
        if self.kind is Kind.CHUNKED:
            if self.chunk is None:
                raise ValueError('a chunked-local group needs a chunk size')
            _positive_int(self.chunk, 'attention chunk size')
            if self.eagle:
                raise ValueError('an EAGLE group in chunked local attention is not supported (vLLM asserts drop_eagle_block is False for chunked local attention)')
        elif self.chunk is not None:
            raise ValueError(f'chunk is only for chunked-local groups, not {self.kind.value}')
        if self.kind is Kind.MAMBA and self.dcp_sharded:
            raise ValueError('a Mamba group cannot be DCP-sharded (vLLM never shards Mamba state)')

@dataclass(frozen=True)
class Layout:
    """A model's KV-cache layout as the scheduler sees it.

    Attributes:
        groups: the KV-cache groups, in vLLM's group order.
        dcp: decode context parallel world size.
        prefix_match_unit: the hash unit an operator asked for (vLLM ``prefix_match_unit``), or None for
            the GCD rule.
        name: a label for reports.
        aux_cap_group: the KV-cache group whose leading whole blocks cap every lookup, or None (vLLM 0.33's
            auxiliary outputs: ``AuxOutputSchedulerConnector.max_cache_hit`` passes
            ``min(k * b, N - 1)``, ``k`` the leading blocks of the coordinator's ``full_attention_group_id``
            that its store or the pool holds). The spec models a full-attention group there.
    """
    groups: tuple
    dcp: int = 1
    prefix_match_unit: int | None = None
    name: str = ''
    aux_cap_group: int | None = None

    def __post_init__(self):
        groups = tuple((g if isinstance(g, Group) else Group(**g) for g in self.groups))
        object.__setattr__(self, 'groups', groups)
        if not groups:
            raise ValueError('a layout needs at least one KV-cache group')
        _positive_int(self.dcp, 'DCP world size')
        if self.prefix_match_unit is not None:
            _positive_int(self.prefix_match_unit, 'prefix_match_unit')
        if self.aux_cap_group is not None:
            g = self.aux_cap_group
            if not isinstance(g, int) or isinstance(g, bool) or (not 0 <= g < len(groups)):
                raise ValueError(f'aux_cap_group {g!r} is not a KV-cache group of this layout (0..{len(groups) - 1})')
            if groups[g].kind is not Kind.FULL:
                raise ValueError(f'aux_cap_group {g}: a cap by the leading blocks of a {groups[g].kind.value} group is not modelled by the spec (it models the cap of a full-attention group)')
        hybrid = len(groups) > 1
        for i, g in enumerate(groups):
            sharded = g.dcp_sharded and self.dcp > 1
            if sharded and g.kind in (Kind.SWA, Kind.CHUNKED):
                raise ValueError(f'group {i}: DCP {self.dcp} with a sharded {g.kind.value} group is not supported (vLLM asserts DCP == 1 in its sliding-window and chunked-local lookups); mark the group replicated (dcp_sharded=False) or use DCP 1')
        if hybrid and any((g.kind is Kind.CHUNKED for g in groups)):
            others = sorted({g.kind.value for g in groups if g.kind not in (Kind.FULL, Kind.CHUNKED)})
            if others:
                raise ValueError(f"chunked local attention beside groups of kind {' and '.join(others)} is not modelled by the spec (it models chunked local attention alone or beside full-attention groups)")

@dataclass(frozen=True)
class Speculation:
    """The speculative-decoding setting that shapes the hit.

    Attributes:
        mode: none, lookahead or drop (see :class:`Mode`).
        num_speculative_tokens: draft tokens per step (``k``).
        multi_module_mtp: MTP with more than one prediction module, which makes the prefill lookahead
            ``k`` tokens instead of 1 (vLLM ``use_multi_module_mtp``).
    """
    mode: Mode = Mode.NONE
    num_speculative_tokens: int = 0
    multi_module_mtp: bool = False
    label: str = field(default='', compare=False)

    def __post_init__(self):
        object.__setattr__(self, 'mode', Mode(self.mode))
        if self.mode is Mode.NONE:
            if self.num_speculative_tokens or self.multi_module_mtp:
                raise ValueError('num_speculative_tokens / multi_module_mtp need an EAGLE-family mode')
        else:
            _positive_int(self.num_speculative_tokens, 'num_speculative_tokens')

    @property
    def prefill_lookahead(self) -> int:
        """Tokens the draft needs past a prefill (vLLM ``num_prefill_lookahead_tokens``, ``Lp``)."""
        if self.mode is Mode.NONE:
            return 0
        if self.multi_module_mtp and self.num_speculative_tokens > 1:
            return self.num_speculative_tokens
        return 1

    @property
    def hash_lookahead(self) -> int:
        """Extra tokens each block hash covers (vLLM ``num_hash_lookahead_tokens``, ``L``)."""
        return self.prefill_lookahead if self.mode is Mode.LOOKAHEAD else 0

    @property
    def drop(self) -> bool:
        """Whether EAGLE groups drop (recompute) one unit past the hit."""
        return self.mode is Mode.DROP

    def describe(self) -> str:
        if self.mode is Mode.NONE:
            return 'none'
        mtp = f' mtp{self.num_speculative_tokens}' if self.multi_module_mtp else ''
        return f'{self.mode.value} Lp={self.prefill_lookahead}{mtp}'
NO_SPECULATION = Speculation()


# --------------------------------------------------------------------------------------------------
# spec/sizes.py
# Derived sizes: effective blocks, scheduler block, hash unit, alignment, spec groups, eagle margins.
#
# All layout arithmetic is concrete. ``num_hashes`` is the one size that depends on the (symbolic) prompt.
# --------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class SpecGroup:
    """KV-cache groups that vLLM looks up together: equal spec, same manager (vLLM ``SpecGroup``).

    Attributes:
        kind, block: the shared kind and effective (DCP-scaled) block size.
        window, chunk: as on :class:`Group`.
        members: indices of the KV-cache groups merged here.
        drops: whether the group is an EAGLE group that drops (recomputes) a unit past the hit.
        margin: the eagle drop unit in tokens (vLLM ``eagle_proof_margin``): ``h`` when the group is looked
            up at hash granularity (partial hits on, a fine-grained manager, block > h), else its block.
        fine: whether the group is looked up at hash granularity (vLLM ``A < b and b % A == 0``).
    """
    kind: Kind
    block: int
    window: int | None
    chunk: int | None
    members: tuple
    drops: bool
    margin: int
    fine: bool

@dataclass(frozen=True)
class Sizes:
    """Everything the hit computation needs to know about a layout and a speculative setting.

    Attributes:
        scheduler_block: ``S``, the LCM of the effective blocks (vLLM ``scheduler_block_size``).
        hash_block: ``h``, the hash unit (vLLM ``hash_block_size``).
        partial_hits: whether fine-grained (hash-unit) hits are on (vLLM ``enable_partial_hash_hits``).
        alignment: ``A``, what every hit is a multiple of (vLLM ``cache_hit_alignment_tokens``).
        effective_blocks: per KV-cache group, ``block_size * dcp`` if sharded else ``block_size``.
        groups: the spec groups, full attention first (vLLM's lookup order).
        unitary: one KV-cache group (vLLM ``UnitaryKVCacheCoordinator``).
        hash_lookahead: ``L``; prefill_lookahead: ``Lp``; drop: whether EAGLE groups drop.
        config_block: the smallest per-rank block of the layout (vLLM ``cache_config.block_size``, which
            the scheduler's Mamba chunk rules use).
        cap_group: the spec group (full attention) whose leading whole blocks cap every lookup (the
            layout's ``aux_cap_group``: :func:`kvhit.spec.policy.lookup_cap`), or None.
    """
    scheduler_block: int
    hash_block: int
    partial_hits: bool
    alignment: int
    effective_blocks: tuple
    groups: tuple
    unitary: bool
    hash_lookahead: int
    prefill_lookahead: int
    drop: bool
    dcp: int
    config_block: int = 0
    cap_group: int | None = None

    @property
    def eagle_unit(self) -> int:
        """The largest drop unit over dropping groups (0 when nothing drops)."""
        return max([g.margin for g in self.groups if g.drops], default=0)

def effective_block(group: Group, dcp: int, scale_replicated: bool=False) -> int:
    """A group's block in tokens across DCP ranks.

    vLLM: ``SingleTypeKVCacheManager.__init__`` (``block_size * dcp if spec.dcp_sharded``) and
    ``resolve_dcp_kv_block_size``. Only sharded groups scale; replicated draft groups and Mamba do not.
    ``scale_replicated`` is the known-bad variant that scales every group.
    """
    if group.dcp_sharded or scale_replicated:
        return group.block_size * dcp
    return group.block_size

def fine_grained_capable(kind: Kind) -> bool:
    """Whether the kind's manager can look up at hash granularity (vLLM
    ``supports_fine_grained_hash_lookup``: full attention and Mamba)."""
    return kind in (Kind.FULL, Kind.MAMBA)

def partial_hash_hits_enabled(layout: Layout, blocks, h: int) -> bool:
    """vLLM: ``partial_hash_hits_enabled``: some Mamba group's block exceeds the hash unit (or equals it
    under DCP > 1, where the full-attention block scales instead), and every group either looks up at
    hash granularity or has a block equal to the hash unit."""
    mamba_wants_it = False
    for g in layout.groups:
        if g.kind is Kind.MAMBA:
            if layout.dcp == 1 and g.block_size > h or (layout.dcp > 1 and g.block_size >= h):
                mamba_wants_it = True
    if not mamba_wants_it:
        return False
    for g, b in zip(layout.groups, blocks):
        if not fine_grained_capable(g.kind) and b != h:
            return False
    return True

def derive_sizes(layout: Layout, speculation: Speculation, scale_replicated: bool=False) -> Sizes:
    """All derived sizes of a layout, validated.

    vLLM: ``resolve_kv_cache_block_sizes`` (S, h), ``partial_hash_hits_enabled`` and
    ``HybridKVCacheCoordinator._cache_hit_alignment_tokens`` (A), ``verify_and_split_kv_cache_groups``
    (spec groups), ``KVCacheCoordinator.__init__`` (eagle groups, with the all-groups fallback),
    ``eagle_proof_margin`` (margins).

    Raises:
        ValueError: block sizes that the hash unit does not divide, a ``prefix_match_unit`` a single group
            cannot use, or a scheduler block shorter than the prefill lookahead.
    """
    blocks = tuple((effective_block(g, layout.dcp, scale_replicated) for g in layout.groups))
    unitary = len(layout.groups) == 1
    scheduler_block = lcm_all(blocks)
    if unitary:
        if layout.prefix_match_unit not in (None, blocks[0]):
            raise ValueError(f'prefix_match_unit {layout.prefix_match_unit} must equal the block {blocks[0]} of a single-group layout')
        h = blocks[0]
        partial = False
        alignment = blocks[0]
    else:
        h = layout.prefix_match_unit if layout.prefix_match_unit is not None else gcd_all(blocks)
        for i, b in enumerate(blocks):
            if b % h != 0:
                raise ValueError(f'group {i}: effective block {b} is not a multiple of the hash unit {h}')
        partial = partial_hash_hits_enabled(layout, blocks, h)
        alignment = h if partial else scheduler_block
    flagged = any((g.eagle for g in layout.groups))
    merged = []
    for i, (g, b) in enumerate(zip(layout.groups, blocks)):
        drops = speculation.drop and (g.eagle or not flagged)
        key = (g.kind, b, g.window, g.chunk, g.dcp_sharded, g.tokens_per_state)
        for j, (other_key, members, other_drops) in enumerate(merged):
            if other_key == key:
                merged[j] = (key, members + (i,), other_drops or drops)
                break
        else:
            merged.append((key, (i,), drops))
    groups = []
    for (kind, b, window, chunk, _, _), members, drops in merged:
        fine = alignment < b and b % alignment == 0 and fine_grained_capable(kind)
        margin = h if partial and fine_grained_capable(kind) and (b > h) else b
        groups.append(SpecGroup(kind=kind, block=b, window=window, chunk=chunk, members=members, drops=drops, margin=margin, fine=fine))
    groups.sort(key=lambda sg: sg.kind is not Kind.FULL)
    chunked = [sg for sg in groups if sg.kind is Kind.CHUNKED]
    if len(chunked) > 1:
        raise ValueError('chunked local attention beside another chunked-local spec is not modelled by the spec (it models one chunked-local spec group, alone or beside full-attention groups)')
    if chunked and (not unitary):
        if speculation.mode is not Mode.NONE:
            raise ValueError('EAGLE-family speculation with chunked local attention beside other groups is not a layout vLLM builds (it turns its hybrid KV-cache manager off for chunked local attention with EAGLE or MTP, and every layer becomes full attention)')
        if chunked[0].block != alignment:
            raise ValueError(f'chunked-local block {chunked[0].block} differs from the hit alignment {alignment} (vLLM asserts they are equal)')
    for sg in groups:
        if sg.drops and sg.kind is Kind.CHUNKED:
            raise ValueError('EAGLE drop with chunked local attention is not supported (vLLM asserts drop_eagle_block is False for chunked local attention)')
    for i, g in enumerate(layout.groups):
        if alignment % g.tokens_per_state != 0:
            raise ValueError(f'group {i}: hit alignment {alignment} is not a multiple of its tokens_per_state {g.tokens_per_state} (vLLM raises the same)')
    if (flagged or speculation.drop) and speculation.prefill_lookahead > scheduler_block:
        raise ValueError(f'scheduler block {scheduler_block} is shorter than the prefill lookahead {speculation.prefill_lookahead} (vLLM raises the same)')
    cap_group = None
    for k, sg in enumerate(groups):
        if layout.aux_cap_group in sg.members:
            cap_group = k
    return Sizes(scheduler_block=scheduler_block, hash_block=h, partial_hits=partial, alignment=alignment, effective_blocks=blocks, groups=tuple(groups), unitary=unitary, hash_lookahead=speculation.hash_lookahead, prefill_lookahead=speculation.prefill_lookahead, drop=speculation.drop, dcp=layout.dcp, config_block=min((g.block_size for g in layout.groups)), cap_group=cap_group)

def num_hashes(sizes: Sizes, n_tokens):
    """``|H|``: block hashes a request of ``n_tokens`` has. With lookahead hashes a block's hash waits
    for the ``L`` tokens after it. vLLM: ``get_request_block_hasher``."""
    return max(0, (n_tokens - sizes.hash_lookahead) // sizes.hash_block)

def hash_reach(sizes: Sizes, n_tokens):
    """Tokens the hashes cover: ``|H| * h``; no lookup may read a boundary past it."""
    return num_hashes(sizes, n_tokens) * sizes.hash_block

def align(sizes: Sizes, x):
    """``floor_A(x)``."""
    return x // sizes.alignment * sizes.alignment


# --------------------------------------------------------------------------------------------------
# spec/cache.py
# The cache state a lookup reads, as an oracle over token boundaries.
#
# A spec group ``k`` "has" boundary ``x`` when the block hash ending at token ``x`` is cached for every
# KV-cache group of the spec group (vLLM: ``BlockPool.get_cached_block``). A block of ``u`` tokens with index
# ``j`` is cached when boundary ``(j + 1) * u`` is. A lookup asks two queries, ``window`` and ``run_from``,
# and a scan over the first, ``last_held`` (:func:`scan_last_held`, its one definition). The Z3 lowering gives
# the two queries a symbolic meaning (:class:`kvhit.spec.lower_z3.SymbolicCache`) and lowers the scan; here they
# are plain loops over the oracle.
#
# The write side describes what a request leaves behind as one :class:`Held` per spec group; the same
# description is read here by plain loops (:func:`written_cache`) and in Z3 by a decision procedure over
# its tails and points (:class:`kvhit.spec.lower_z3.SymbolicWrittenCache`). What several requests leave is
# *layered*: per spec group a tuple of :class:`Held` layers, of which the cache holds the union
# (:func:`layers`).
# --------------------------------------------------------------------------------------------------

class CacheState:
    """Which boundaries each spec group can serve.

    Args:
        has: ``has(k, x)`` is True when spec group ``k`` holds the hash of the block ending at token ``x``.
    """

    def __init__(self, has):
        self.has = has
        self.max_query = 0

    def _has(self, k, x):
        if x > self.max_query:
            self.max_query = x
        return self.has(k, x)

    def window(self, k, x, unit, before, after):
        """Whether blocks ``[max(0, x // unit - before), x // unit + after)`` of ``unit`` tokens are all
        cached in spec group ``k``: the context a window ending at ``x`` needs, plus ``after`` blocks past
        it (the EAGLE peek)."""
        i = x // unit
        for j in range(max(0, i - before), i + after):
            if not self._has(k, (j + 1) * unit):
                return False
        return True

    def run_from(self, k, start, unit, limit):
        """How many consecutive ``unit`` blocks from block ``start`` are cached, stopping at block
        ``limit``."""
        n = 0
        while start + n < limit and self._has(k, (start + n + 1) * unit):
            n += 1
        return n

    def last_held(self, k, step, lo, hi, unit, before, after):
        """The largest multiple ``x`` of ``step`` with ``lo < x <= hi`` whose window is cached in spec group
        ``k`` (``window(k, x, unit, before, after)``), or 0: the downward scan a lookup makes for a single
        cached state, a partial block or a sliding window's context (:func:`scan_last_held`)."""
        return scan_last_held(self, k, step, lo, hi, unit, before, after)

    @classmethod
    def from_sets(cls, boundaries):
        """A cache from one set of cached boundaries per spec group."""
        sets = [frozenset(s) for s in boundaries]
        return cls(lambda k, x: x in sets[k])

    @classmethod
    def up_to(cls, extents):
        """A dense cache: spec group ``k`` holds every boundary up to ``extents[k]`` tokens."""
        ext = list(extents)
        return cls(lambda k, x: 0 < x <= ext[k])

def scan_last_held(cache, k, step, lo, hi, unit, before, after):
    """What ``last_held`` means, for every cache state: scan the multiples of ``step`` down from ``hi`` for
    the first above ``lo`` whose window is cached. The Z3 caches lower this scan; a cache state that knows
    its own structure may answer ``last_held`` without it, with the same result and the same ``max_query``
    (the scan asks its highest candidate first)."""
    return max_aligned(step, hi, lambda x: x > lo and cache.window(k, x, unit, before, after))

@dataclass(frozen=True, kw_only=True)
class Held:
    """What one spec group holds of a prompt after the write side has run: positions in tokens. Built with
    keywords only (eleven fields, most of them integers).

    Attributes:
        kind, block: the spec group's kind and effective block.
        unit: the unit its single boundaries are read at (the alignment when it is looked up at hash
            granularity, else its block).
        extent: no block ends past it (the cacheable, prompt-only prefix).
        every: every boundary up to ``extent`` is held (full attention always; a sliding window whose
            mask keeps every block; every Mamba state).
        points: single held boundaries (full attention's partial tail; Mamba states).
        ends: sliding window: positions where an explicitly kept tail of ``need`` blocks ends.
        need: sliding window: blocks per kept tail.
        shift: sliding window: blocks a tail reaches past its boundary (1 when the group drops).
        period: tokens between periodic tails (sliding window) or states (Mamba); 0 for none. Periodic
            sliding-window tails end at ``shift * block + m * period`` for ``m >= 1``.
        gaps: sliding window, chunked local: ``(lo, hi)`` token ranges (multiples of the block; empty
            when ``lo >= hi``) whose blocks are not held whatever the rest says: blocks freed before any
            caching call covered them (sliding window), or never computed (chunked local: ``(0, hi)``).
    """
    kind: Kind
    block: int
    unit: int
    extent: object = 0
    every: bool = False
    points: tuple = ()
    ends: tuple = ()
    need: int = 0
    shift: int = 0
    period: int = 0
    gaps: tuple = ()

def live_gaps(gaps):
    """``gaps`` without the ones known to be empty before any prompt is chosen (concrete ``lo >= hi``)."""
    return tuple(((lo, hi) for lo, hi in gaps if not (isinstance(lo, int) and isinstance(hi, int) and (lo >= hi))))

def held_from(g: Held):
    """Where a chunked-local group's held blocks start, in tokens: the end of its gaps, each of which starts at
    block 0 (the blocks its request's lookup counted as computed without reading them)."""
    start = 0
    for _, hi in live_gaps(g.gaps):
        start = max(start, hi)
    return start

def holds_block(g: Held, j):
    """Whether block ``j`` (of ``g.block`` tokens) of a sliding-window or chunked-local group is kept
    (Python only)."""
    if (j + 1) * g.block > g.extent:
        return False
    for lo, hi in g.gaps:
        if lo <= j * g.block < hi:
            return False
    if g.every:
        return True
    per = g.period // g.block
    if per > 0 and j >= g.shift and ((j - g.shift) % per >= per - g.need):
        return True
    for end in g.ends:
        if end - g.need * g.block <= j * g.block < end:
            return True
    return False

def holds(g: Held, x):
    """Whether a group holds the hash of the block ending at token ``x`` (Python only)."""
    if x <= 0:
        return False
    if g.kind in (Kind.SWA, Kind.CHUNKED):
        return x % g.block == 0 and holds_block(g, x // g.block - 1)
    if x in g.points:
        return True
    if x > g.extent:
        return False
    if g.kind is Kind.MAMBA:
        return x % g.unit == 0 and (g.every or (g.period > 0 and x % g.period == 0))
    return x % g.block == 0

def layers(group):
    """The layers of a written spec group: a :class:`Held` is one layer, a tuple of them is several (what
    several earlier prompts left, each clipped to what a later prompt shares with it)."""
    if isinstance(group, Held):
        return (group,)
    return tuple(group)

def holds_some(held, x):
    """Whether some layer in ``held`` holds the hash of the block ending at token ``x`` (Python only; a
    loop, which a single layer reads as fast as :func:`holds` alone)."""
    for g in held:
        if holds(g, x):
            return True
    return False

def written_cache(groups):
    """A cache whose group ``k`` holds what ``groups[k]`` says: a :class:`Held`, or a tuple of
    :class:`Held` layers, of which it holds the union (a boundary is held when some layer holds it)."""
    held = tuple((layers(g) for g in groups))
    return CacheState(lambda k, x: holds_some(held[k], x))


# --------------------------------------------------------------------------------------------------
# spec/policy.py
# The hit-length policy: how many prompt tokens a request may take from the prefix cache.
#
# One model, several policies. The rules in which policies differ are the fields of :class:`Rules`; a
# policy is a named combination of them (:data:`POLICIES`). Notation used in the docstrings:
#
# * ``N`` prompt tokens; ``M`` the most a lookup may return; ``A`` the alignment; ``h`` the hash unit;
#   ``|H|`` the request's block hashes, which cover ``covered = |H| * h`` tokens
#   (:func:`kvhit.spec.sizes.hash_reach`): no lookup may read a boundary past it.
# * a lookup returns ``(hit, reach)``: the hit in tokens and ``reach``, the highest boundary it reads.
# * a coordinator returns ``(hit, reach, longest, converged)``; ``longest`` is vLLM's largest intermediate
#   candidate (``num_uncached_common_prefix_tokens = longest - hit``), ``converged`` whether the fixed-point
#   loop stopped within the passes a lowering unrolled (always True in Python).
# --------------------------------------------------------------------------------------------------

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
    VLLM = 'vllm'
    PROMPT_END = 'prompt_end'
    RESUME = 'resume'

class Junction(str, Enum):
    """Where a request records its shared-prefix junction (:func:`kvhit.spec.retention.junction_of`).

    * ``uncached``: vLLM ``hit + num_uncached_common_prefix_tokens`` (the longest candidate its lookup
      saw), when that passes the hit.
    * ``next_block``: one scheduler block past the hit.

    Compared with ``==``, as :class:`Replay`.
    """
    UNCACHED = 'uncached'
    NEXT_BLOCK = 'next_block'

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
        object.__setattr__(self, 'replay', Replay(self.replay))
        object.__setattr__(self, 'junction', Junction(self.junction))
REFERENCE = Rules('reference', declarative=True, replay=Replay.RESUME, coarse_junction=True, vllm_checkpoint=True, checkpoint_tail_when_capped=True)
VLLM_0_33 = Rules('vllm_0_33')
VLLM_0_32 = Rules('vllm_0_32', lookahead_hashes=False, junction_below=False)
HISTORICAL = Rules('historical', eagle_margin=False, replay=Replay.PROMPT_END, checkpoint_drop=False)
HISTORICAL_REPEAT_DROP = Rules('historical_repeat_drop', eagle_margin=False, drop_once=False)
NO_LAST_TOKEN_CAP = replace(REFERENCE, name='no_last_token_cap', last_token_recomputed=False)
EAGLE_NEVER_RECOMPUTES = replace(REFERENCE, name='eagle_never_recomputes', eagle_recompute=False)
PEEK_WITHOUT_POP = replace(VLLM_0_33, name='peek_without_pop', pop_after_peek=False)
PEEK_PAST_HASHES = replace(VLLM_0_33, name='peek_past_hashes', peek_within_hashes=False)
DCP_SCALES_REPLICATED = replace(REFERENCE, name='dcp_scales_replicated', scale_replicated=True)
RETAIN_PROMPT_END = replace(REFERENCE, name='retain_prompt_end', replay=Replay.PROMPT_END)
RETAIN_EVERY_BOUNDARY = replace(REFERENCE, name='retain_every_boundary', sparse_zero=False)
JUNCTION_PAST_HIT = replace(HISTORICAL, name='junction_past_hit', junction=Junction.NEXT_BLOCK)
WITHOUT_JUNCTION = replace(REFERENCE, name='without_junction', record_junction=False)
FINE_JUNCTION_ONLY = replace(REFERENCE, name='fine_junction_only', coarse_junction=False)
WITHOUT_VLLM_CHECKPOINT = replace(REFERENCE, name='without_vllm_checkpoint', vllm_checkpoint=False)
TAIL_AT_CAPPED_RESUME = replace(REFERENCE, name='tail_at_capped_resume', checkpoint_tail_when_capped=False)

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
REPAIRS = {r.name: r for r in (Repair('cap_at_hashes', 'F1', 'KVCacheCoordinator.find_longest_cache_hit (Unitary and Hybrid)', 'cap_at_hashes'), Repair('unitary_margin', 'F2', 'UnitaryKVCacheCoordinator.find_longest_cache_hit', 'unitary_margin'), Repair('drop_before_align', 'F5', 'SlidingWindowManager.find_longest_cache_hit', 'drop_before_align'), Repair('probe_past_max', 'F6', 'FullAttentionManager.find_longest_cache_hit', 'probe_past_max'), Repair('reverify_after_shrink', 'C1', 'HybridKVCacheCoordinator.find_longest_cache_hit', 'reverify_after_shrink'), Repair('replay_at_resume', 'W', 'kv_cache_coordinator.replay_boundaries', 'replay', Replay.RESUME, also=(('coarse_junction', True), ('vllm_checkpoint', True))))}

def repaired(names, base: Rules=VLLM_0_33, name: str | None=None) -> Rules:
    """``base`` (vLLM 0.33) with the named repairs of :data:`REPAIRS` on."""
    rules = base
    for n in names:
        rules = replace(rules, **{REPAIRS[n].rule: REPAIRS[n].value, **dict(REPAIRS[n].also)})
    return replace(rules, name=name or '+'.join((base.name,) + tuple(names)))
VLLM_0_33_REPAIRED = repaired(tuple(REPAIRS), name='vllm_0_33_repaired')
POLICIES = {r.name: r for r in (REFERENCE, VLLM_0_33, HISTORICAL, VLLM_0_33_REPAIRED)}
KNOWN_BAD = {r.name: r for r in (HISTORICAL_REPEAT_DROP, NO_LAST_TOKEN_CAP, EAGLE_NEVER_RECOMPUTES, PEEK_WITHOUT_POP, PEEK_PAST_HASHES, DCP_SCALES_REPLICATED, RETAIN_PROMPT_END, RETAIN_EVERY_BOUNDARY, JUNCTION_PAST_HIT, WITHOUT_JUNCTION, FINE_JUNCTION_ONLY, WITHOUT_VLLM_CHECKPOINT, TAIL_AT_CAPPED_RESUME)}
RELEASES = {r.name: r for r in (VLLM_0_32,)}
ALL_POLICIES = {**POLICIES, **KNOWN_BAD, **RELEASES}

def check_speculation(sizes: Sizes, rules: Rules):
    """Refuse a speculative setting the policy's engine does not have: lookahead block hashes
    (``L > 0``) under a policy without them (``lookahead_hashes``; vLLM 0.32 has no
    ``num_hash_lookahead_tokens``, its EAGLE-family drafters drop).

    Raises:
        ValueError: naming the policy and the setting.
    """
    if sizes.hash_lookahead > 0 and (not rules.lookahead_hashes):
        raise ValueError(f"policy {rules.name} has no lookahead block hashes (L = {sizes.hash_lookahead}): its engine drops the EAGLE block instead; use mode 'drop'")

def max_cache_hit_length(n_tokens, rules: Rules):
    """The most a hit may be: ``N - 1`` (vLLM ``KVCacheManager.get_computed_blocks``)."""
    if rules.last_token_recomputed:
        return n_tokens - 1
    return n_tokens

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
    limit = min(-(-max_length // b) if rules.probe_past_max else max_length // b, hashes * sizes.hash_block // b)
    run = cache.run_from(k, start=0, unit=b, limit=limit)
    hit = run * b
    reach = limit * b
    if sg.fine:
        per_block = b // a
        probe = run * per_block + per_block - 1
        if not rules.probe_past_max:
            probe = min(probe, max_length // a)
        top = min(probe, hashes * sizes.hash_block // a)
        partial = cache.last_held(k, step=a, lo=hit, hi=top * a, unit=a, before=1, after=0)
        hit = partial if partial > 0 else hit
        reach = max(reach, top * a)
    dropped = hit - min(a, b)
    if rules.probe_past_max:
        hit = min(hit, max_length)
        dropped = max(hit - min(a, b), 0)
    hit = dropped if drop and hit > 0 else hit
    return (hit // a * a, reach)

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
    need = -(-(sg.window - 1) // b)
    top = max_length // b * b
    found_keep = cache.last_held(k, step=a, lo=need * b - 1, hi=top, unit=b, before=need, after=0)
    run = cache.run_from(k, start=0, unit=b, limit=max_length // b) * b
    short_keep = run // a * a
    keep = found_keep if found_keep > 0 else short_keep
    if drop is False:
        return (keep, top)
    found_drop = cache.last_held(k, step=a, lo=need * b - 1, hi=top - b, unit=b, before=need, after=1)
    if rules.drop_before_align:
        short_drop = (run - b) // a * a if run >= b else 0
    else:
        gated = ((run - b) // a * a + b if run >= b else 0) // a * a
        short_drop = (gated - b) // a * a if gated > 0 else 0
    dropped = found_drop if found_drop > 0 else short_drop
    return (dropped if drop else keep, top)

def mamba_lookup(cache, sizes: Sizes, k, hashes, max_length, drop, rules: Rules):
    """vLLM: ``MambaManager.find_longest_cache_hit``: the highest single cached state at an aligned
    boundary at most ``M``; at hash granularity (capped by the hashes) when partial hits are on. It never
    drops. Without partial hits it reads from block ``M // b - 1`` without checking the hashes."""
    sg = sizes.groups[k]
    a = sizes.alignment
    if sg.fine:
        top = min(max_length // a, hashes * sizes.hash_block // a) * a
        return (cache.last_held(k, step=a, lo=0, hi=top, unit=a, before=1, after=0), top)
    top = max_length // sg.block * sg.block
    return (cache.last_held(k, step=a, lo=0, hi=top, unit=sg.block, before=1, after=0), top)

def skipped_blocks(sg, max_length):
    """The blocks a chunked-local lookup at ``M`` counts as computed without reading them: those before the
    chunk that holds ``M`` (vLLM ``local_attention_start_idx // block_size``; null blocks, never computed)."""
    return (max_length // sg.chunk * sg.chunk if max_length > 0 else 0) // sg.block

def chunked_local_lookup(cache, sizes: Sizes, k, hashes, max_length, drop, rules: Rules):
    """vLLM: ``ChunkedLocalAttentionManager.find_longest_cache_hit``: blocks before the chunk that holds
    ``M`` count as computed; then the run of cached blocks from that chunk's first block up to ``M // b``.
    Reads without checking the hashes."""
    sg = sizes.groups[k]
    b = sg.block
    start = skipped_blocks(sg, max_length)
    end = max_length // b
    run = cache.run_from(k, start=start, unit=b, limit=end)
    reach = min(start + run + 1, end) * b if start < end else 0
    return ((start + run) * b, reach)

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

def unitary_hit_tokens(cache, sizes: Sizes, n_tokens, rules: Rules):
    """vLLM: ``UnitaryKVCacheCoordinator.find_longest_cache_hit``: one lookup at ``M = N - 1`` with
    alignment = the block, dropping when the group is an EAGLE group. No eagle margin (``unitary_margin``:
    the lookup peeks one drop unit past ``M``, within the hashes, before it drops), no cap by the hashes
    (``cap_at_hashes``: ``M`` at most ``|H| * h``)."""
    hashes = num_hashes(sizes, n_tokens)
    sg = sizes.groups[0]
    bound = capped_length(cache, sizes, n_tokens, rules)
    if sg.drops and sg.kind is not Kind.MAMBA and rules.unitary_margin:
        bound = min(bound + sg.margin, hash_reach(sizes, n_tokens))
    hit, reach = lookup(cache, sizes, 0, hashes, bound, sg.drops, rules)
    return (hit, reach, hit, True)

def max_length_within_hashes(sizes: Sizes, n_tokens, rules: Rules):
    """Where vLLM's coordinators start: ``M`` (:func:`max_cache_hit_length`), with ``cap_at_hashes`` at
    most ``|H| * h``; the reference's cap (:func:`reference_hit_tokens`) is always within the hashes."""
    m = max_cache_hit_length(n_tokens, rules)
    if rules.cap_at_hashes or rules.declarative:
        return min(m, hash_reach(sizes, n_tokens))
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
    return min(bound, lookup_cap(cache, sizes, covered))

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
            peek = min(peek, hashes * sizes.hash_block)
        bound = peek if drop else c
    return lookup(cache, sizes, k, hashes, bound, drop and rules.pop_after_peek, rules)

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
        if sg.kind is Kind.FULL and (not first):
            c = min(c, lengths[k])
            continue
        drop = sg.drops
        if rules.drop_once:
            drop = sg.drops and (not verified[k])
        n, r = pass_lookup(cache, sizes, k, hashes, c, drop, rules)
        cleared = n < c if rules.reverify_after_shrink else not drop and n < c
        verified = [False if cleared else v for v in verified]
        verified[k] = verified[k] or drop
        c = n
        lengths[k] = n
        longest = max(longest, c)
        reach = max(reach, r)
    return (c, tuple(verified), tuple(lengths), longest, reach)

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
    verified = tuple((False for _ in sizes.groups))
    lengths = tuple((0 for _ in sizes.groups))
    longest = 0
    reach = 0
    done = False
    for index in itertools.count():
        c, new_verified, new_lengths, new_longest, new_reach = hybrid_pass(cache, sizes, hashes, hit_length, verified, lengths, index == 0, rules)
        converged = c >= hit_length or simple
        hit_length, verified, lengths, longest, reach = (hit_length, verified, lengths, longest, reach) if done else (hit_length if c >= hit_length else c, new_verified, new_lengths, max(longest, new_longest), max(reach, new_reach))
        done = done or converged
        if done:
            break
    return (hit_length, reach, longest, done)

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
    partial = cache.last_held(k, step=a, lo=run, hi=min(run + b - a, covered), unit=a, before=1, after=0)
    return max(run, partial)

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
    if sg.drops and rules.eagle_recompute and (sg.kind is not Kind.MAMBA):
        unit = sg.margin
    if sg.kind is Kind.FULL:
        return x + unit <= extent
    if sg.kind is Kind.SWA:
        after = 1 if unit > 0 else 0
        return x + unit <= covered and cache.window(k, x, unit=b, before=-(-(sg.window - 1) // b), after=after)
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
        ok = ok and group_serves(cache, sizes, k, x, extents[k], covered, rules)
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
            top = min(top, extents[k])
    chunked = chunked_group(sizes)
    if chunked is not None:
        return chunked_local_lookup(cache, sizes, chunked, hashes=covered // sizes.hash_block, max_length=top, drop=False, rules=rules)[0]
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
    full = tuple((k for k, sg in enumerate(sizes.groups) if sg.kind is Kind.FULL))
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
            top = min(top, extents[k])

    def serves(x):
        ok = True
        for k in members:
            ok = ok and group_serves(cache, sizes, k, x, extents[k], covered, rules)
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
        return (hit, covered, hit, True)
    return (hit, covered, max(hit, shared_prefix_tokens(cache, sizes, cap, extents, covered, rules)), True)

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


# --------------------------------------------------------------------------------------------------
# spec/retention.py
# The write side: what a request leaves in the cache, and where a later request can resume.
#
# A request with prompt ``N`` is admitted with a hit of ``start`` tokens and a shared-prefix junction ``J``
# (vLLM ``shared_prefix_boundary``; :data:`NO_JUNCTION` for none), prefilled in the chunks the scheduler
# cuts, samples one token and ends. The write side says, per spec group, which of the prompt's block
# boundaries stay findable, as one :class:`kvhit.spec.cache.Held` per spec group, which the read side then
# consumes (:func:`kvhit.spec.cache.written`). Only boundaries up to ``N - L`` matter to a later prompt that
# shares the ``N`` tokens: a block hash past them covers tokens past the prompt.
#
# Policies differ in three rules of :class:`kvhit.spec.policy.Rules`:
#
# * ``replay``: where the masks keep state. vLLM 0.33 (``Replay.VLLM``): ``replay_boundaries`` (``N - 1``,
#   or with an EAGLE drop one scheduler block below the last and the resend's aligned boundaries);
#   historical (``Replay.PROMPT_END``): ``N - 1`` always; reference (``Replay.RESUME``): the points the read
#   side itself resumes at, computed by the read side on the cache the request would leave if every state
#   were retained, then vLLM's. One definition, two views: what is retained is what is resumed at. The
#   scheduler then also ends a chunk at each retained Mamba state, the resend's point is the Mamba prompt
#   checkpoint, and a Mamba group read at its block keeps what vLLM's bookkeeping can (one state per block
#   slot, one partial tail per request: :func:`mamba_held`); ``replay_at_resume.patch`` in ``docs/upstream/``.
# * ``checkpoint_drop``: the Mamba prompt checkpoint the scheduler stops at accounts for the EAGLE drop
#   (vLLM 0.33) or not (historical).
# * ``junction``: where a request records its junction (vLLM: ``hit + num_uncached``, ``Junction.UNCACHED``).
#
# Known simplifications (stated in the README): one request at a time, a token budget that never cuts a
# chunk (only the scheduler's mandatory Mamba stops do), no backend-internal Mamba checkpoints, a request that
# samples one token and ends (decode steps would cache more), and a later request keeps the whole tail at
# its junction (vLLM keeps only the blocks it computed).
# --------------------------------------------------------------------------------------------------

NO_JUNCTION = -1
NO_PARTIAL_TAIL = -1
NO_STATE = -1
NO_TAIL = -1
NO_STOP = -1
NO_GAP = (-1, -1)

def check_retention(sizes: Sizes, interval):
    """vLLM ``_validate_prefix_cache_retention_interval``: ``None`` (dense), 0 (replay boundaries only)
    or a positive multiple of the scheduler block; anything but 0 needs a sliding-window or Mamba group.

    Raises:
        ValueError: any other value, naming it and the scheduler block.
    """
    if interval is not None and (isinstance(interval, bool) or not isinstance(interval, int) or interval < 0 or (interval % sizes.scheduler_block != 0)):
        raise ValueError(f'retention interval {interval!r} must be None, 0 or a positive multiple of the scheduler block {sizes.scheduler_block}')
    sparse_kinds = [sg for sg in sizes.groups if sg.kind in (Kind.SWA, Kind.MAMBA)]
    if interval != 0 and (not sparse_kinds):
        raise ValueError(f'retention interval {interval!r} needs a sliding-window or Mamba group; this layout has none, so use 0 (vLLM raises the same)')

def checkpoint_position(n_tokens, unit: int, drop: bool, lookahead: int):
    """vLLM ``get_mamba_prefill_checkpoint_position``: the prompt's reusable Mamba boundary, leaving the
    last token (or the ``L`` lookahead tokens) to recompute; with the EAGLE drop, one unit lower."""
    if drop:
        return max(n_tokens // unit * unit - unit, 0)
    return max((n_tokens - max(1, lookahead)) // unit * unit, 0)

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
    return x // sizes.scheduler_block * sizes.scheduler_block

def cacheable_tokens(sizes: Sizes, k, computed):
    """vLLM ``get_num_cacheable_tokens`` for spec group ``k`` after ``computed`` tokens.

    One group: all but the reprefillable tail. Hybrid: the aligned prefix; a dropping group also one
    block past the aligned boundary (the EAGLE peek), within the finalized tokens.
    """
    finalized = max(0, computed - reprefillable(sizes))
    if sizes.unitary:
        return finalized
    aligned = align_cacheable(sizes, computed)
    if sizes.groups[k].drops:
        return min(finalized, align_cacheable(sizes, finalized) + sizes.groups[k].block) if aligned > 0 else aligned
    return aligned

def group_extent(sizes: Sizes, k, n_tokens, decoded: bool=False, chunked: bool=True):
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
        top = min(cacheable_tokens(sizes, k, n_tokens), top)
        if chunked and sizes.groups[k].kind is Kind.MAMBA and (sizes.prefill_lookahead >= 2):
            top = min(top, n_tokens - sizes.prefill_lookahead)
    unit = read_unit(sizes, k) if sizes.groups[k].kind is Kind.MAMBA else sizes.groups[k].block
    return max(top, 0) // unit * unit

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
    limit = (n_tokens if sg.drops else n_tokens - 1) // sizes.hash_block * sizes.hash_block
    x = min(limit, covered)
    return (x, x > 0 and x <= cacheable and (not eq_zero_mod(x, sg.block)))

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
        full = min(cacheable, covered) // sg.block * sg.block
        points = [NO_PARTIAL_TAIL if full_before <= p // sg.block * sg.block and p // sg.block * sg.block < full else p for p in points]
        x, ok = partial_tail_boundary(sizes, k, n_tokens, cacheable, covered)
        points = [NO_PARTIAL_TAIL if ok and p // sg.block * sg.block == x // sg.block * sg.block else p for p in points]
        points.append(x if ok and x <= n_tokens - sizes.hash_lookahead else NO_PARTIAL_TAIL)
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
    x, ok = partial_tail_boundary(sizes, k, n_tokens, cacheable_tokens(sizes, k, tokens), hash_reach(sizes, tokens))
    return x if ok and x <= n_tokens - sizes.hash_lookahead else NO_PARTIAL_TAIL

def dense_groups(sizes: Sizes, n_tokens, decoded: bool=False):
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
        out.append(Held(kind=sg.kind, block=sg.block, unit=read_unit(sizes, k), extent=extent, every=True, points=points))
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
    dense = written_cache(groups) if read is None else read(groups)
    points = (hit_tokens(dense, sizes, n_tokens, rules)[0], hit_tokens(dense, sizes, n_tokens + 1, rules)[0], hit_tokens(dense, sizes, far_sibling(sizes, n_tokens), rules)[0])
    if resumes_after_decoding(sizes):
        groups = dense_groups(sizes, n_tokens, True)
        decoded = written_cache(groups) if read is None else read(groups)
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
    if rules.vllm_checkpoint and any((sg.kind is Kind.MAMBA for sg in sizes.groups)):
        ours += (prompt_checkpoint(sizes, n_tokens, rules),)
    if rules.replay == Replay.PROMPT_END or not sizes.drop:
        return ours + (n_tokens - 1,)
    s = sizes.scheduler_block
    return ours + (max((n_tokens - 1) // s * s - s, 0), max(n_tokens // s * s - s, 0))

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
            out.append(junction // b * b if junction >= b else NO_JUNCTION)
    return tuple(out)

def junction_boundaries(sizes: Sizes, k, junction, rules: Rules):
    """Where spec group ``k`` keeps state for the request's shared-prefix junction: the junction; for a
    dropping group with ``rules.junction_below`` one block below it (a sibling that diverges right after the
    junction cannot peek past it: vLLM 0.33 ``SingleTypeKVCacheManager.cache_blocks``; vLLM 0.32 keeps only
    the junction); then the :func:`coarse_junctions`. :data:`NO_JUNCTION` for none."""
    sg = sizes.groups[k]
    here = junction if junction > 0 else NO_JUNCTION
    coarse = coarse_junctions(sizes, junction, rules)
    if not (sg.drops and rules.junction_below):
        return (here,) + coarse
    return (here, junction - sg.block if junction > 0 else NO_JUNCTION) + coarse

def gaps_possible(sizes: Sizes, k) -> bool:
    """Whether spec group ``k`` (a sliding window) can lose blocks before they are cached: only when a
    Mamba group makes the scheduler stop between chunks, and a chunk end can run a window plus a block
    past what that chunk caches (a lag of at most ``S - 1`` tokens, or ``S + Lp - 2b`` behind the EAGLE
    peek; with partial hits at most ``Lp + b - 1``). A static over-approximation: when it says yes,
    :func:`sliding_window_gaps` decides."""
    sg = sizes.groups[k]
    if sg.kind is not Kind.SWA or sizes.partial_hits or (not any((g.kind is Kind.MAMBA for g in sizes.groups))):
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
        inside = start < s and s < n_tokens
        cached = min(cacheable_tokens(sizes, k, s), hash_reach(sizes, n_tokens)) // b * b
        freed = max(s - sg.window + 1, 0) // b * b
        out.append((cached, freed) if inside else NO_GAP)
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
    need = -(-(sg.window - 1) // b) + shift
    all_blocks = Held(kind=Kind.SWA, block=b, unit=b, extent=extent, every=True, need=need, shift=shift, gaps=gaps)
    if a % b != 0:
        return all_blocks
    dense = interval is None or (interval == 0 and (not rules.sparse_zero))
    segment = a if dense else interval
    if segment > 0 and need >= segment // b:
        return all_blocks
    ends = ()
    if not dense:
        ends = []
        for x in boundaries:
            t = x // a * a + shift * b
            lost = False
            for lo, hi in gaps:
                lost = lost or (lo < hi and lo < t and (t - need * b < hi))
            ends.append(NO_TAIL if lost else t)
        ends = tuple(ends)
    return Held(kind=Kind.SWA, block=b, unit=b, extent=extent, every=False, ends=ends, need=need, shift=shift, period=segment, gaps=gaps)

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
    if not any((sg.kind is Kind.MAMBA for sg in sizes.groups)):
        return ChunkStops()
    big = sizes.config_block
    last_cache_position = checkpoint_position(n_tokens, big, sizes.drop and rules.checkpoint_drop, sizes.hash_lookahead)
    later = []
    if sizes.partial_hits:
        tail = prompt_checkpoint(sizes, n_tokens, rules)
        later.append(tail if last_cache_position < tail and tail < n_tokens else NO_STOP)
    later.append(start + (junction - start) // big * big if start < junction and junction < n_tokens else NO_STOP)
    inside = list(retained) if sizes.alignment % big else []
    return ChunkStops(mandatory=(last_cache_position,) + tuple(later), retained=tuple(retained), block_ends=tuple((ceil_to(e, big) for e in [start] + later + inside)))

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
            cached.append(min(cacheable_tokens(sizes, k, n_tokens), hash_reach(sizes, n_tokens)))
    if not cached:
        return ()
    out = []
    for x in tuple(boundaries) + (junction,) + coarse_junctions(sizes, junction, rules):
        p = x // sizes.alignment * sizes.alignment
        within = False
        for c in cached:
            within = within or p <= c
        out.append(p if start < p and p <= top and within else NO_STOP)
    return tuple(out)

def mamba_chunk_ends(sizes: Sizes, n_tokens, block: int, start, junction, rules: Rules, retained=()):
    """Where a Mamba group of ``block`` tokens holds a state after a prefill (vLLM
    ``_mamba_block_aligned_split`` with a budget that never binds): the chunk ends (the prompt
    checkpoint, the partial-hit tail, the junction floored to the config block, the retained states of
    ``retained``, the end of a config block a chunk started inside) and the end of each Mamba block a chunk
    ran through after starting inside it; each only strictly between ``start`` and ``N``; then ``N``. Others
    are :data:`NO_STATE`."""
    stops = chunk_stops(sizes, n_tokens, start, junction, rules, retained)
    inside = stops.retained if sizes.alignment % block else ()
    ends = stops.all() + tuple((ceil_to(e, block) for e in (start,) + stops.mandatory + inside))
    return tuple((e if start < e and e < n_tokens else NO_STATE for e in ends)) + (n_tokens,)

def ceil_to(x, unit: int):
    """``x`` rounded up to a multiple of ``unit``."""
    return -(-x // unit) * unit

def mamba_at_hash_granularity(sizes: Sizes) -> bool:
    """Whether a Mamba group is read at hash granularity (its hits may end inside a block): its states inside a
    block are partial tails, of which vLLM, and so the reference (:func:`mamba_held`), keeps one per request."""
    return any((sg.kind is Kind.MAMBA and sg.fine for sg in sizes.groups))
ONLY_MAMBA_DROPS = 'EAGLE drop mode in which only Mamba groups drop'
FINE_MAMBA_MTP_DROP = 'a Mamba group read at hash granularity that drops, in EAGLE drop mode with multi-module MTP'
CAPPED_FINE_MAMBA_MTP_DROP = 'lookups capped by auxiliary outputs beside a Mamba group read at hash granularity, in EAGLE drop mode with multi-module MTP'

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
    if sizes.drop and sizes.prefill_lookahead >= 2 and mamba_at_hash_granularity(sizes) and any((sg.kind is Kind.MAMBA and sg.drops for sg in sizes.groups)):
        return f"{FINE_MAMBA_MTP_DROP}: its caching calls end Lp - 1 tokens before the chunk, so no partial tail is kept at the resend's resume point (scheduler_and_mask_boundaries_agree fails on concrete prompts, e.g. qwen3next_pmu160 with no group flagged EAGLE, dense retention, N = 478: the first repeat hits 0, a cache holding every state 160)"
    if sizes.drop and sizes.prefill_lookahead >= 2 and (sizes.cap_group is not None) and mamba_at_hash_granularity(sizes):
        return f"{CAPPED_FINE_MAMBA_MTP_DROP}: a resend's capped resume point lies inside a Mamba block below vLLM's prompt checkpoint, and a request keeps one partial tail, so the reference's write side either misses the first repeat or gives less than vLLM's (reference_never_below_vllm fails on concrete prompts: 11200 tokens, a prompt of 1920 sharing 1761, then one of 6399 sharing 4799 with the first hit 1600 where vLLM hits 1760)"
    dropping = [sg.kind for sg in sizes.groups if sg.drops]
    if dropping and all((kind is Kind.MAMBA for kind in dropping)):
        return f"{ONLY_MAMBA_DROPS}: the reference's Mamba lookups never drop, and its write side is not proved never below vLLM's there (kvhit prove --extended refutes reference_never_below_vllm on one Mamba group in drop mode)"
    return ''

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
        resend = boundaries[0] if boundaries[0] > 0 else boundaries[3]
    else:
        resend = boundaries[0]
    if not (rules.checkpoint_tail_when_capped and sizes.cap_group is not None and mamba_at_hash_granularity(sizes)):
        return resend
    block = min((sg.block for sg in sizes.groups if sg.kind is Kind.MAMBA and sg.fine))
    return prompt_checkpoint(sizes, n_tokens, rules) if eq_zero_mod(resend, block) else resend

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
    extent = group_extent(sizes, k, n_tokens)
    top = group_extent(sizes, k, n_tokens, chunked=False)
    aligned = tuple((x // sizes.alignment * sizes.alignment for x in boundaries))
    resume = rules.replay == Replay.RESUME
    every_block = interval is not None and interval > 0 and (interval // b <= 1)
    dense = interval is None or every_block or (interval == 0 and (not rules.sparse_zero))
    period = interval if interval is not None and interval > 0 and (not every_block) else 0
    if resume:
        period = resume_period(sizes, b, interval, rules)
    ends = mamba_chunk_ends(sizes, n_tokens, b, start, junction, rules, retained)
    points = []
    for e in ends:
        kept = dense
        if period > 0:
            kept = kept or eq_zero_mod(e, period)
        for x in aligned:
            kept = kept or e == x // b * b
        ok = e > 0 and e <= top and eq_zero_mod(e, b) and kept
        points.append(e if ok else NO_STATE)
    if resume:
        tail = resume_tail(sizes, n_tokens, boundaries, rules)
    else:
        tail = prompt_checkpoint(sizes, n_tokens, rules)
    is_end = False
    for e in ends:
        is_end = is_end or e == tail
    called = cacheable_tokens(sizes, k, n_tokens) == tail
    for c in chunk_stops(sizes, n_tokens, start, junction, rules, retained).all():
        called = called or (start < c and c < n_tokens and (cacheable_tokens(sizes, k, c) == tail))
    ok = tail > 0 and tail <= n_tokens - sizes.hash_lookahead and is_end and called
    points.append(tail if ok else NO_STATE)
    return Held(kind=Kind.MAMBA, block=b, unit=unit, extent=extent, every=False, points=tuple(points), period=period if resume else 0)

def eq_zero_mod(x, unit: int):
    """Whether ``x`` is a multiple of ``unit``."""
    return x - x // unit * unit == 0

def request_writes(sizes: Sizes, n_tokens, interval, rules: Rules, start=0, junction=NO_JUNCTION, again=False, boundaries=None):
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
            if gaps and (not (isinstance(start, int) and start == 0)):
                held = replace(held, gaps=gaps + ((0, max(start, 0) // sg.block * sg.block),))
            out.append(held)
        elif sg.kind is Kind.MAMBA:
            out.append(mamba_held(sizes, k, n_tokens, interval, at, start, junction, rules, retained))
        elif sg.kind is Kind.CHUNKED:
            out.append(chunked_local_held(sizes, k, n_tokens, start, rules))
        else:
            points = ()
            if sg.kind is Kind.FULL:
                points = partial_tails(sizes, k, n_tokens)
            out.append(Held(kind=sg.kind, block=sg.block, unit=read_unit(sizes, k), extent=group_extent(sizes, k, n_tokens), every=True, points=points))
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
    return Held(kind=Kind.CHUNKED, block=sg.block, unit=sg.block, extent=group_extent(sizes, k, n_tokens), every=True, gaps=((0, skipped),))

def merge(old, new):
    """The cache after a later request with the same prompt wrote ``new`` on top of ``old``.

    A block is held when either request holds it. Both keep every block, or the same periodic tails (same
    prompt, same interval), and each drops whole the explicit tails reaching into its own gaps, so a block
    is missing exactly when it lies in a gap of both: the gaps become the pairwise intersections."""
    out = []
    for g, h in zip(old, new):
        gaps = tuple(((max(a[0], c[0]), min(a[1], c[1])) for a in live_gaps(g.gaps) for c in live_gaps(h.gaps)))
        out.append(replace(g, points=g.points + h.points, ends=g.ends + h.ends, gaps=gaps))
    return tuple(out)

def junction_of(sizes: Sizes, hit, longest, rules: Rules):
    """Where a request records its junction: vLLM ``hit + num_uncached`` when something was uncached
    (``longest`` is the longest candidate the lookup saw), else none."""
    if rules.junction == Junction.NEXT_BLOCK:
        return hit + sizes.scheduler_block
    return longest if longest > hit else NO_JUNCTION

def clip(sizes: Sizes, g: Held, shared):
    """What a later prompt that shares only the first ``shared`` tokens of ``g``'s prompt can read of it:
    the boundaries up to ``shared - L`` (the hash of the block ending at ``x`` covers the ``L`` lookahead
    tokens past it; a hash past them covers tokens the two prompts do not share)."""
    top = shared - sizes.hash_lookahead
    absent = NO_STATE if g.kind is Kind.MAMBA else NO_PARTIAL_TAIL
    points = tuple((p if p <= top else absent for p in g.points))
    return replace(g, extent=min(g.extent, top), points=points)

def serve(sizes: Sizes, n_tokens, interval, rules: Rules, cache):
    """A request with prompt ``N`` served on ``cache`` (what earlier prompts left, as it can read it):
    ``(hit, reach, converged, junction, what it leaves)``: its lookup (:func:`hit_tokens`), the junction
    it records and its write side."""
    hit, reach, longest, converged = hit_tokens(cache, sizes, n_tokens, rules)
    junction = junction_of(sizes, hit, longest, rules)
    return (hit, reach, converged, junction, request_writes(sizes, n_tokens, interval, rules, hit, junction))

def repeat(sizes: Sizes, n_tokens, interval, rules: Rules, groups):
    """One more request with the same prompt on the cache ``groups``: ``(hit, junction, groups after)``."""
    hit, _, longest, _ = hit_tokens(written_cache(groups), sizes, n_tokens, rules)
    junction = junction_of(sizes, hit, longest, rules)
    after = merge(groups, request_writes(sizes, n_tokens, interval, rules, hit, junction, True))
    return (hit, junction, after)

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
            total = max(0, (g.extent + (g.need - g.shift) * g.block - 1) // g.period)
        else:
            total = g.extent // g.period
    seen = []
    positions = g.ends if g.kind is Kind.SWA else g.points
    for p in positions:
        fresh = p > 0
        if g.kind is Kind.SWA:
            fresh = fresh and p - g.need * g.block < g.extent
        if g.period > 0:
            periodic = eq_zero_mod(p - g.shift * g.block, g.period) and p >= g.shift * g.block + g.period
            if g.kind is Kind.MAMBA:
                periodic = eq_zero_mod(p, g.period) and p <= g.extent
            fresh = fresh and (not periodic)
        for q in seen:
            fresh = fresh and (not p == q)
        total = total + (1 if fresh else 0)
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
        count = -(-n_tokens // interval) + boundaries
    if g.kind is Kind.SWA:
        return count * max(g.need, 1)
    return count


# --------------------------------------------------------------------------------------------------
# spec/api.py
# What an engine or a tool calls: sizes and hits by policy name.
# --------------------------------------------------------------------------------------------------

def policy_rules(policy):
    """The rules of a policy given by name (``reference``, ``vllm_0_33``, ``historical``, ...)."""
    if policy not in ALL_POLICIES:
        raise ValueError(f"unknown policy {policy!r}; known: {', '.join(sorted(ALL_POLICIES))}")
    return ALL_POLICIES[policy]

def sizes_for(layout: Layout, speculation: Speculation, policy='reference') -> Sizes:
    """Derived sizes of a layout under a policy."""
    return derive_sizes(layout, speculation, policy_rules(policy).scale_replicated)

def as_cache(cache):
    """A :class:`CacheState` from a cache state, a list of boundary sets, or a list of extents."""
    if isinstance(cache, CacheState):
        return cache
    cache = list(cache)
    if all((isinstance(c, int) for c in cache)):
        return CacheState.up_to(cache)
    return CacheState.from_sets(cache)

def hit(layout: Layout, speculation: Speculation, n_tokens: int, cache, policy='reference') -> int:
    """The hit in tokens of a request of ``n_tokens`` prompt tokens.

    Args:
        cache: per spec group, either a :class:`CacheState` oracle, a set of cached boundaries, or an
            extent (every boundary up to it cached).
    """
    if n_tokens < 1:
        raise ValueError(f'a request needs at least one prompt token, got {n_tokens}')
    rules = policy_rules(policy)
    sizes = derive_sizes(layout, speculation, rules.scale_replicated)
    return hit_tokens(as_cache(cache), sizes, n_tokens, rules)[0]
