"""Derived sizes: effective blocks, scheduler block, hash unit, alignment, spec groups, eagle margins.

All layout arithmetic is concrete. ``num_hashes`` is the one size that depends on the (symbolic) prompt.
"""

from dataclasses import dataclass

from .domain import Group, Kind, Layout, Mode, Speculation
from .terms import floor_to, gcd_all, lcm_all, max_


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


def effective_block(group: Group, dcp: int, scale_replicated: bool = False) -> int:
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
            if (layout.dcp == 1 and g.block_size > h) or (layout.dcp > 1 and g.block_size >= h):
                mamba_wants_it = True
    if not mamba_wants_it:
        return False
    for g, b in zip(layout.groups, blocks):
        if not fine_grained_capable(g.kind) and b != h:
            return False
    return True


def derive_sizes(layout: Layout, speculation: Speculation, scale_replicated: bool = False) -> Sizes:
    """All derived sizes of a layout, validated.

    vLLM: ``resolve_kv_cache_block_sizes`` (S, h), ``partial_hash_hits_enabled`` and
    ``HybridKVCacheCoordinator._cache_hit_alignment_tokens`` (A), ``verify_and_split_kv_cache_groups``
    (spec groups), ``KVCacheCoordinator.__init__`` (eagle groups, with the all-groups fallback),
    ``eagle_proof_margin`` (margins).

    Raises:
        ValueError: block sizes that the hash unit does not divide, a ``prefix_match_unit`` a single group
            cannot use, or a scheduler block shorter than the prefill lookahead.
    """
    blocks = tuple(effective_block(g, layout.dcp, scale_replicated) for g in layout.groups)
    unitary = len(layout.groups) == 1
    scheduler_block = lcm_all(blocks)
    if unitary:
        if layout.prefix_match_unit not in (None, blocks[0]):
            raise ValueError(f"prefix_match_unit {layout.prefix_match_unit} must equal the block "
                             f"{blocks[0]} of a single-group layout")
        h = blocks[0]
        partial = False
        alignment = blocks[0]
    else:
        h = layout.prefix_match_unit if layout.prefix_match_unit is not None else gcd_all(blocks)
        for i, b in enumerate(blocks):
            if b % h != 0:
                raise ValueError(f"group {i}: effective block {b} is not a multiple of the hash unit {h}")
        partial = partial_hash_hits_enabled(layout, blocks, h)
        alignment = h if partial else scheduler_block
    flagged = any(g.eagle for g in layout.groups)
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
        margin = h if (partial and fine_grained_capable(kind) and b > h) else b
        groups.append(SpecGroup(kind=kind, block=b, window=window, chunk=chunk, members=members, drops=drops,
                                margin=margin, fine=fine))
    groups.sort(key=lambda sg: sg.kind is not Kind.FULL)
    chunked = [sg for sg in groups if sg.kind is Kind.CHUNKED]
    if len(chunked) > 1:
        raise ValueError("chunked local attention beside another chunked-local spec is not modelled by the spec "
                         "(it models one chunked-local spec group, alone or beside full-attention groups)")
    if chunked and not unitary:
        if speculation.mode is not Mode.NONE:
            raise ValueError("EAGLE-family speculation with chunked local attention beside other groups is not "
                             "a layout vLLM builds (it turns its hybrid KV-cache manager off for chunked local "
                             "attention with EAGLE or MTP, and every layer becomes full attention)")
        if chunked[0].block != alignment:
            raise ValueError(f"chunked-local block {chunked[0].block} differs from the hit alignment {alignment} "
                             "(vLLM asserts they are equal)")
    for sg in groups:
        if sg.drops and sg.kind is Kind.CHUNKED:
            raise ValueError("EAGLE drop with chunked local attention is not supported "
                             "(vLLM asserts drop_eagle_block is False for chunked local attention)")
    for i, g in enumerate(layout.groups):
        if alignment % g.tokens_per_state != 0:
            raise ValueError(f"group {i}: hit alignment {alignment} is not a multiple of its "
                             f"tokens_per_state {g.tokens_per_state} (vLLM raises the same)")
    if (flagged or speculation.drop) and speculation.prefill_lookahead > scheduler_block:
        raise ValueError(f"scheduler block {scheduler_block} is shorter than the prefill lookahead "
                         f"{speculation.prefill_lookahead} (vLLM raises the same)")
    cap_group = None
    for k, sg in enumerate(groups):
        if layout.aux_cap_group in sg.members:
            cap_group = k
    return Sizes(scheduler_block=scheduler_block, hash_block=h, partial_hits=partial, alignment=alignment,
                 effective_blocks=blocks, groups=tuple(groups), unitary=unitary,
                 hash_lookahead=speculation.hash_lookahead, prefill_lookahead=speculation.prefill_lookahead,
                 drop=speculation.drop, dcp=layout.dcp, config_block=min(g.block_size for g in layout.groups),
                 cap_group=cap_group)


def num_hashes(sizes: Sizes, n_tokens):
    """``|H|``: block hashes a request of ``n_tokens`` has. With lookahead hashes a block's hash waits
    for the ``L`` tokens after it. vLLM: ``get_request_block_hasher``."""
    return max_(0, (n_tokens - sizes.hash_lookahead) // sizes.hash_block)


def hash_reach(sizes: Sizes, n_tokens):
    """Tokens the hashes cover: ``|H| * h``; no lookup may read a boundary past it."""
    return num_hashes(sizes, n_tokens) * sizes.hash_block


def align(sizes: Sizes, x):
    """``floor_A(x)``."""
    return floor_to(x, sizes.alignment)
