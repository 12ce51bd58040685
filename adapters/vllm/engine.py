# SPDX-License-Identifier: Apache-2.0
"""kvhit's reference policy inside vLLM's scheduler process, for every supported vLLM release: the hit
length (read side), where a request leaves state (write side) and which cached blocks are evicted first.

The version-independent part of the adapter: the layout mapping (:func:`model_coordinator`), the reference
hit over vLLM's block pool and the enforced lookup, the write model, the eviction tier, the metrics and
bounded logs, the status file, and :func:`install` / :func:`uninstall` over a version module's ``SEAMS``.
The replacements installed into vLLM are made here from the originals a version module captures
(``*_seam`` factories); each version module (``v0_32``, ``v0_33``: vLLM 0.32.0, 0.33.0) holds those
captures, its ``SEAMS`` table, what differs in its release (a :class:`Release`) and the seams whose
signature or behaviour is its own. This
module imports only vLLM names that are the same in every supported release; of kvhit it imports only
the generated ``kvhit.refimpl``, with its staged lowering (``kvhit.refimpl.staging``, the spec's
``kvhit.spec.stage`` as codegen copies it), which specialises the reference hit to the layout once, when
the coordinator is built (the real-Scheduler runs of ``tests/adapter/test_scheduler_plugin.py`` and
``tests/conformance/test_adapter_on_0_32.py`` check that no ``kvhit.spec``, no ``kvhit.proofs`` and no z3
are imported). It is imported only after
:func:`kvhit.adapters.vllm.install` checked the vLLM version.

An enforced lookup, for a request of ``N`` tokens (vLLM passes ``max_cache_hit_length = N - 1``)::

    for each of vLLM's full-attention spec groups:                   # the prefix, walked once
        walk = manager_cls.find_longest_cache_hit(max_length=vLLM's first-pass bound, no drop)
    hit = hit_tokens(N, PoolCache(walks))     # refimpl.hit_tokens(..., REFERENCE), staged for the layout;
                                              # leading runs: the walks'; other queries: get_cached_block
    for each of vLLM's spec groups:                                  # blocks come from vLLM's own finders
        full attention: the walk's blocks cut to cdiv(hit, block)
        Mamba:          what its finder returns at hit, from the pool's answer the reference already has
        other kinds:    manager_cls.find_longest_cache_hit(max_length=hit), which must return exactly hit
    num_uncached = (reference hit of the first spec group alone) - hit   # vLLM: its first lookup's result

The finders are called without the EAGLE drop: the reference already checked, on the block pool, that each
dropping group holds the unit past the hit, and the drop would only pop that unit again (vLLM's own loop
looks a verified group up without the drop too). Anything the spec does not model is reported once and left
to vLLM.
"""

from __future__ import annotations

import contextvars
import dataclasses
import json
import logging
import operator
import os
import time
import types
import weakref
from collections.abc import Callable, Collection, Sequence
from fractions import Fraction
from typing import NamedTuple

import vllm
from prometheus_client import Counter
from vllm.utils.math_utils import cdiv
from vllm.v1.core import kv_cache_coordinator, kv_cache_manager, single_type_kv_cache_manager
from vllm.v1.core.block_pool import BlockPool
from vllm.v1.core.kv_cache_utils import FreeKVCacheBlockQueue
from vllm.v1.core.kv_cache_coordinator import eagle_proof_margin
from vllm.v1.core.kv_cache_coordinator import (
    HybridKVCacheCoordinator,
    KVCacheCoordinator,
    UnitaryKVCacheCoordinator,
)
from vllm.v1.core.sched import scheduler
from vllm.v1.core.single_type_kv_cache_manager import (
    ChunkedLocalAttentionManager,
    FullAttentionManager,
    MambaManager,
    SlidingWindowManager,
)
from vllm.v1.kv_cache_interface import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowMLASpec,
    SlidingWindowSpec,
)

import kvhit
from kvhit.refimpl import (
    REFERENCE,
    CacheState,
    Group,
    Kind,
    Layout,
    Rules,
    Sizes,
    Speculation,
    check_retention,
    coarse_junctions,
    derive_sizes,
    group_extent,
    group_extents,
    hit_tokens,
    num_hashes,
    reference_pass,
    replay_boundaries,
    resume_period,
    resume_tail,
    write_side_unmodelled,
)

from kvhit.refimpl.staging import SpecError, stage_hit_tokens

from . import log_once, logger


@dataclasses.dataclass(frozen=True)
class Release:
    """What the engine needs to know of one vLLM release besides the seams its version module installs:
    the attributes and rules that differ between releases. Each version module defines one (``RELEASE``).

    Attributes:
        stock_rules: ``refimpl``'s rules of the release's own policy: what stock vLLM hits on the same cache
            (:func:`count_enforced` with ``KVHIT_COUNT_GAINS``).
        drop_group_ids: the KV-cache group ids in which a coordinator drops the EAGLE block.
        hash_lookahead_tokens: how many tokens past each block a coordinator's block hashes cover, as vLLM
            holds the number (read through :func:`_integer`).
        stock_reachable_boundaries: ``(coordinator, manager, request, junctions)`` -> the boundaries vLLM's
            own ``SingleTypeKVCacheManager.cache_blocks`` gives ``manager.reachable_block_mask`` for
            ``request`` with shared-prefix boundaries ``junctions`` (:meth:`EvictionTier.mark`).
    """

    stock_rules: Rules
    drop_group_ids: Callable[[KVCacheCoordinator], Collection[int]]
    hash_lookahead_tokens: Callable[[KVCacheCoordinator], object]
    stock_reachable_boundaries: Callable[..., list[int]]


VLLM_VERSION = vllm.__version__
"""The version of the vLLM this process imported: one ``kvhit.adapters.vllm.RELEASES`` names."""

LOG_INTERVAL_S = 10.0
"""At most one shadow-divergence line and one enforce-fallback line per this many seconds."""

# --------------------------------------------------------------------------------------------------
# Layouts: vLLM's KV-cache config -> kvhit's Layout
# --------------------------------------------------------------------------------------------------

# Exact spec classes and the exact manager class vLLM picks for them, per spec kind. Subclasses
# (RSWASpec, SinkFullAttentionSpec, HiddenStateCacheSpec, CircularBufferSpec, HiSparse*) and role managers
# are different policies: not modelled.
_KINDS: tuple[tuple[tuple[type, ...], type, Kind], ...] = (
    ((FullAttentionSpec, MLAAttentionSpec), FullAttentionManager, Kind.FULL),
    ((SlidingWindowSpec, SlidingWindowMLASpec), SlidingWindowManager, Kind.SWA),
    ((MambaSpec,), MambaManager, Kind.MAMBA),
    ((ChunkedLocalAttentionSpec,), ChunkedLocalAttentionManager, Kind.CHUNKED),
)


class Unmodelled(Exception):
    """A layout or a call the spec does not model; vLLM's own code handles it."""


def _integer(value, what: str) -> int:
    """``value`` as vLLM's arithmetic uses it, as an int: an int, a bool (vLLM takes ``True`` as 1) or
    another integer type (numpy's); anything else is :class:`Unmodelled`."""
    try:
        return operator.index(value)
    except TypeError:
        raise Unmodelled(f"{what} is {value!r} ({type(value).__name__}), not an integer") from None


@dataclasses.dataclass(frozen=True)
class CoordinatorModel:
    """A vLLM coordinator's layout as kvhit models it.

    Attributes:
        layout, speculation: the spec's description of it.
        sizes: the spec's derived sizes, checked equal to what vLLM resolved.
        members: per spec group (``sizes.groups`` order), the vLLM KV-cache group ids it covers.
        spec_group_of: per vLLM KV-cache group id, the index of its spec group.
        label: a short description for logs and metric labels.
        write: the reference write side for this layout, or None when the spec does not model it
            (``write_note`` says why). Such a model is never installed: the scheduler leaves the whole
            layout to vLLM, read side and write side (:func:`get_kv_cache_coordinator_seam`); it is built
            only to check its read side's parts (``tests/adapter/test_pool_cache.py``).
        walked: the spec groups whose leading run a lookup's walks of vLLM's full-attention groups give,
            with those groups' indices in vLLM's lookup order (:func:`walk_sources`).
        plans: per vLLM spec group in lookup order, what looking it up needs (:func:`group_plans`).
        hit_tokens: ``refimpl.hit_tokens`` under the reference policy on this layout, as a function of
            ``(N, cache)``: the spec's ``hit_tokens`` staged for the layout (:func:`reference_hit_tokens`).
        cache: the :class:`PoolCache` of the coordinator's pool on ``members``, which each lookup starts.
        release: the vLLM release the coordinator belongs to.
        capped: its scheduler caps lookups below ``N - 1`` (auxiliary outputs, :func:`aux_cap_reason`):
            a capped lookup is answered by the reference too (:func:`capped_reference`).
    """

    layout: Layout
    speculation: Speculation
    sizes: Sizes
    members: tuple[tuple[int, ...], ...]
    spec_group_of: tuple[int, ...]
    label: str
    write: WriteModel | None = None
    write_note: str = ""
    walked: tuple[tuple[int, tuple[int, ...]], ...] = ()
    plans: tuple = dataclasses.field(default=(), compare=False, repr=False)
    hit_tokens: Callable = dataclasses.field(default=None, compare=False, repr=False)
    cache: PoolCache = dataclasses.field(default=None, compare=False, repr=False)
    release: Release = dataclasses.field(default=None, compare=False, repr=False)
    capped: bool = False

    @property
    def unitary(self) -> bool:
        return self.sizes.unitary


class WriteModel:
    """The reference write side of one modelled layout: where a request's prompt leaves state.

    ``refimpl.replay_boundaries(sizes, N, REFERENCE)`` are the points kvhit's own read side resumes at (a
    resend, a sibling one token longer, a far sibling) on the cache the request would leave with every state
    retained, then vLLM's own replay boundaries (so enforce never keeps less than stock). vLLM's masks keep state exactly there when they are given these boundaries (its sliding-window
    and Mamba masks have the spec's mechanics), and the scheduler ends a prefill chunk at each of them so
    that every Mamba group has a state to keep::

        | hit | chunk | chunk    | chunk |       Mamba states at the chunk ends; the mask keeps those
        0    start    b1         b2      N       at b1, b2 (and every R tokens / every unit when R = None)

    Attributes:
        sizes: the layout's derived sizes.
        retention: vLLM's ``prefix_cache_retention_interval`` (None: dense).
        mamba_groups: the spec-group indices of Mamba groups.
    """

    def __init__(self, sizes: Sizes, retention: int | None, label: str = "") -> None:
        self.label = label
        self.sizes = sizes
        self.retention = retention
        self.mamba_groups = tuple(k for k, sg in enumerate(sizes.groups) if sg.kind is Kind.MAMBA)
        self._boundaries: dict[int, tuple[int, ...]] = {}

    def resume_points(self, n_tokens: int) -> tuple[int, ...]:
        """``refimpl.replay_boundaries(sizes, N, REFERENCE)``: (resend, near sibling, far sibling, ...,
        then vLLM's boundaries)."""
        found = self._boundaries.get(n_tokens)
        if found is None:
            found = tuple(replay_boundaries(self.sizes, n_tokens, REFERENCE))
            if len(self._boundaries) > 4096:
                self._boundaries.clear()
            self._boundaries[n_tokens] = found
        return found

    def boundaries(self, n_tokens: int) -> tuple[int, ...]:
        """The reference replay boundaries of a prompt of ``n_tokens``, ascending, distinct."""
        return tuple(sorted(set(self.resume_points(n_tokens))))

    def resend_boundary(self, n_tokens: int) -> int:
        """The reference's Mamba prompt checkpoint (``refimpl.resume_tail``): where a resend of the prompt
        resumes, after its prefill or, if nowhere then, after decoding."""
        resend = resume_tail(self.sizes, n_tokens, self.resume_points(n_tokens), REFERENCE)
        return resend // self.sizes.alignment * self.sizes.alignment

    def junctions(self, junction: int) -> tuple[int, ...]:
        """Where the reference keeps state for a request's shared-prefix junction besides what vLLM's
        managers add for it (the junction, and one block below it in a dropping group): the junction and
        ``refimpl.coarse_junctions`` (the junction floored to the block vLLM's own junction lands on), the
        positive ones."""
        if junction <= 0:
            return ()
        return tuple(x for x in (junction,) + tuple(coarse_junctions(self.sizes, junction, REFERENCE)) if x > 0)

    def next_mamba_stop(self, n_tokens: int, start: int, end: int, junction: int = 0) -> int | None:
        """The first position strictly inside ``(start, end)`` where a Mamba group of the prompt keeps a
        state under the reference (``refimpl.mamba_held``): an aligned replay boundary or the request's
        shared-prefix junction (``junction``, when positive) and its floors (:meth:`junctions`), or a
        multiple of the group's periodic step (``refimpl.resume_period``: the retention interval,
        ``max(A, b)`` when dense); each at most the group's extent."""
        a = self.sizes.alignment
        best = None
        at = self.boundaries(n_tokens) + self.junctions(junction)
        for k in self.mamba_groups:
            extent = group_extent(self.sizes, k, n_tokens)
            candidates = [x // a * a for x in at]
            step = resume_period(self.sizes, self.sizes.groups[k].block, self.retention, REFERENCE)
            if step:
                candidates.append((start // step + 1) * step)
            for x in candidates:
                if start < x < end and x <= extent and (best is None or x < best):
                    best = x
        return best


def _write_side(coordinator: KVCacheCoordinator, sizes: Sizes,
                label: str) -> tuple[WriteModel | None, str]:
    """The reference write side for a coordinator whose read side the spec models, or ``(None, why the
    spec does not model it)``: such a layout is left wholly to vLLM
    (:func:`get_kv_cache_coordinator_seam`)."""
    retention = coordinator.retention_interval
    if retention is None and not any(sg.kind in (Kind.SWA, Kind.MAMBA) for sg in sizes.groups):
        # vLLM accepts dense retention on any layout (KVCacheConfig's default; vLLM's unit tests build it)
        # and only sliding-window and Mamba groups read the interval: without one, None keeps what 0 keeps.
        retention = 0
    try:
        check_retention(sizes, retention)
    except ValueError as e:
        return None, f"the spec's write side rejects it: {e}"
    why = write_side_unmodelled(sizes)
    if why:
        return None, why
    pool = coordinator.block_pool
    if _sparse_managers(coordinator) and (type(pool) is not BlockPool
                                          or type(pool.free_block_queue) is not FreeKVCacheBlockQueue):
        return None, (f"its block pool ({type(pool).__name__} with a {type(pool.free_block_queue).__name__}) "
                      "is not vLLM's BlockPool and FreeKVCacheBlockQueue, whose eviction order kvhit sets so "
                      "that the reference's extra sliding-window and Mamba blocks are evicted first")
    return WriteModel(sizes, retention, label), ""


def _sparse_managers(coordinator: KVCacheCoordinator) -> tuple[int, ...]:
    """The KV-cache group ids whose manager caches blocks through a sparse mask (sliding window, Mamba):
    the groups where the reference write side keeps more than vLLM's (:class:`EvictionTier`)."""
    return tuple(gid for gid, manager in enumerate(coordinator.single_type_managers)
                 if type(manager) in (SlidingWindowManager, MambaManager))


def _group_of(index: int, group_spec, manager) -> Group:
    """One vLLM KV-cache group as a spec group, or :class:`Unmodelled`."""
    spec = group_spec.kv_cache_spec
    kind = next((k for specs, mgr, k in _KINDS if type(spec) in specs and type(manager) is mgr), None)
    if kind is None:
        raise Unmodelled(f"group {index}: {type(spec).__name__} looked up by {type(manager).__name__} "
                         "is not a kind the spec models")
    if not spec.prefix_cacheable:
        raise Unmodelled(f"group {index}: {type(spec).__name__} does not take part in prefix caching")
    if manager.retains_longer_hit:
        raise Unmodelled(f"group {index}: {type(manager).__name__} retains a longer hit")
    if manager.pcp_world_size != 1:
        raise Unmodelled(f"group {index}: prefill context parallelism {manager.pcp_world_size} "
                         "is not modelled")
    if kind is Kind.MAMBA and spec.mamba_cache_mode != "align":
        raise Unmodelled(f"group {index}: Mamba cache mode {spec.mamba_cache_mode!r} (the spec models "
                         "'align')")
    tokens_per_state = getattr(spec, "tokens_per_state", 1)
    if isinstance(tokens_per_state, Fraction) and tokens_per_state.denominator != 1:
        raise Unmodelled(f"group {index}: fractional tokens_per_state {tokens_per_state}")
    tokens_per_state = int(tokens_per_state)
    try:
        return Group(
            kind,
            _integer(spec.block_size, f"group {index}: block_size"),
            window=_integer(spec.sliding_window, f"group {index}: sliding_window") if kind is Kind.SWA else None,
            chunk=(_integer(spec.attention_chunk_size, f"group {index}: attention_chunk_size")
                   if kind is Kind.CHUNKED else None),
            dcp_sharded=bool(spec.dcp_sharded),
            eagle=bool(group_spec.is_eagle_group),
            tokens_per_state=max(1, tokens_per_state),  # MambaSpec uses -1 for "one token per state"
        )
    except ValueError as e:
        raise Unmodelled(f"group {index}: {e}") from e


def _speculation_of(coordinator: KVCacheCoordinator, release: Release) -> Speculation:
    """The speculative setting the coordinator was built for.

    vLLM passes it as ``use_eagle`` (the drop: ``release.drop_group_ids``), the hash lookahead
    (``release.hash_lookahead_tokens``) and ``num_prefill_lookahead`` (kept as
    ``num_reprefillable_tokens = max(0, Lp - 1)``).
    """
    lookahead = _integer(release.hash_lookahead_tokens(coordinator), "num_hash_lookahead_tokens")
    reprefillable = _integer(coordinator.num_reprefillable_tokens, "num_reprefillable_tokens")
    drop = bool(release.drop_group_ids(coordinator))
    if lookahead and drop:
        raise Unmodelled("lookahead hashes together with the EAGLE drop (vLLM's scheduler never builds it)")
    if lookahead:
        if reprefillable != lookahead - 1:
            raise Unmodelled(f"{lookahead} hash lookahead tokens with a prefill lookahead of "
                             f"{reprefillable + 1}")
        return Speculation("lookahead", lookahead, multi_module_mtp=lookahead > 1)
    if drop:
        prefill = reprefillable + 1
        return Speculation("drop", prefill, multi_module_mtp=prefill > 1)
    if reprefillable:
        raise Unmodelled(f"a prefill lookahead of {reprefillable + 1} tokens without lookahead hashes "
                         "or the EAGLE drop")
    return Speculation("none")


def _describe(layout: Layout, speculation: Speculation) -> str:
    parts = []
    for g in layout.groups:
        text = f"{g.kind.value}{g.block_size}"
        if g.window is not None:
            text += f"w{g.window}"
        if g.chunk is not None:
            text += f"c{g.chunk}"
        if g.tokens_per_state > 1:
            text += f"t{g.tokens_per_state}"
        if layout.dcp > 1 and not g.dcp_sharded and g.kind is not Kind.MAMBA:
            text += "r"
        if g.eagle:
            text += "e"
        parts.append(text)
    extra = f" dcp{layout.dcp}" if layout.dcp > 1 else ""
    if layout.prefix_match_unit is not None:
        extra += f" pmu{layout.prefix_match_unit}"
    if layout.aux_cap_group is not None:
        extra += f" aux{layout.aux_cap_group}"
    return f"{'+'.join(parts)}{extra} {speculation.describe()}"


def model_coordinator(coordinator: KVCacheCoordinator, release: Release,
                      aux_cap_group: int | None = None) -> CoordinatorModel:
    """Map a coordinator of vLLM ``release`` to kvhit's layout and check the derived sizes.
    ``aux_cap_group``: the KV-cache group whose leading blocks cap every lookup (auxiliary outputs:
    :func:`aux_cap_group`), or None.

    Raises:
        Unmodelled: a coordinator, group kind or setting the spec does not model, or derived sizes
            that differ from the ones vLLM resolved (the message names both).
    """
    if type(coordinator) not in (UnitaryKVCacheCoordinator, HybridKVCacheCoordinator):
        raise Unmodelled(f"coordinator {type(coordinator).__name__}")
    config = coordinator.kv_cache_config
    managers = coordinator.single_type_managers
    groups = tuple(_group_of(i, g, m) for i, (g, m) in enumerate(zip(config.kv_cache_groups, managers)))
    unitary = type(coordinator) is UnitaryKVCacheCoordinator
    dcp = _integer(managers[0].dcp_world_size if unitary else coordinator.dcp_world_size, "dcp_world_size")
    h = _integer(coordinator.block_pool.hash_block_size, "hash_block_size")
    speculation = _speculation_of(coordinator, release)
    try:
        layout = Layout(groups, dcp=dcp, aux_cap_group=aux_cap_group)
        sizes = derive_sizes(layout, speculation)
        if sizes.hash_block != h and not unitary:
            layout = Layout(groups, dcp=dcp, prefix_match_unit=h, aux_cap_group=aux_cap_group)
            sizes = derive_sizes(layout, speculation)
    except ValueError as e:
        raise Unmodelled(f"the spec rejects the layout: {e}") from e
    layout = dataclasses.replace(layout, name=_describe(layout, speculation))

    if unitary:
        alignment, partial = coordinator.block_size, False
        vllm_drops = {0: 0 in release.drop_group_ids(coordinator)}
    else:
        alignment, partial = coordinator._cache_hit_alignment_tokens, coordinator.enable_partial_hash_hits
        vllm_drops = {gid: g.use_eagle for g in coordinator.attention_groups for gid in g.group_ids}
    vllm_sizes = (coordinator.scheduler_block_size, h, alignment, partial,
                  tuple(m.block_size for m in managers))
    spec_sizes = (sizes.scheduler_block, sizes.hash_block, sizes.alignment, sizes.partial_hits,
                  tuple(sizes.effective_blocks))
    if vllm_sizes != spec_sizes:
        raise Unmodelled(f"{layout.name}: vLLM resolved (S, h, A, partial hits, blocks) = {vllm_sizes}, "
                         f"the spec derives {spec_sizes}")
    spec_group_of = [0] * len(groups)
    for k, sg in enumerate(sizes.groups):
        for gid in sg.members:
            spec_group_of[gid] = k
            if vllm_drops[gid] != sg.drops:
                raise Unmodelled(f"{layout.name}: group {gid} drops in vLLM: {vllm_drops[gid]}, "
                                 f"in the spec: {sg.drops}")
    write, write_note = _write_side(coordinator, sizes, layout.name)
    members = tuple(tuple(sg.members) for sg in sizes.groups)
    walked = walk_sources(members, _spec_groups(coordinator)[0], _block_sizes(coordinator))
    return CoordinatorModel(layout, speculation, sizes, members, tuple(spec_group_of), layout.name, write,
                            write_note, walked, group_plans(coordinator, members),
                            reference_hit_tokens(layout, speculation),
                            PoolCache(coordinator.block_pool, sizes.hash_block, members, walked), release)


# --------------------------------------------------------------------------------------------------
# The reference hit over vLLM's block pool
# --------------------------------------------------------------------------------------------------


class _Stock(Exception):
    """A call outside what the spec models: vLLM answers it."""


class _Inconsistent(Exception):
    """vLLM's finders cannot provide blocks for the reference hit: a spec/vLLM disagreement."""


class _Walk(NamedTuple):
    """One of vLLM's full-attention spec groups looked up by its own finder (:func:`_walk_full_attention`).

    Attributes:
        group_ids: its KV-cache group ids.
        block: its block (the manager's, scaled by DCP when sharded).
        blocks, found: what ``FullAttentionManager.find_longest_cache_hit`` returned.
        walked: how many blocks from block 0 the finder looked at: it found ``found // block`` of them
            cached, so when that is less than ``walked`` block ``found // block`` is not.
    """

    group_ids: list[int]
    block: int
    blocks: tuple[list, ...]
    found: int
    walked: int


# A _Walk without NamedTuple's Python-level __new__ (a lookup makes one per walk).
_new_tuple = tuple.__new__

# PoolCache.asked's "not asked yet" (None is the pool's "not cached").
_UNASKED = object()


class PoolCache(CacheState):
    """The cache a request sees in vLLM's block pool: spec group ``k`` has boundary ``x`` when the
    request's block hash ending at ``x`` is cached for every KV-cache group of ``k`` (vLLM:
    ``BlockPool.get_cached_block``).

    Built once per coordinator and spec-group membership, and :meth:`start` ed for each lookup (one at a
    time: vLLM's scheduler is one thread; the lookup path makes no object it does not need). The pool is
    asked each boundary once per lookup (answers are memoised in ``asked``: the pool does not change during
    a lookup), and what it gave is kept: a Mamba group's blocks at the hit are the ones the reference asked
    about (:func:`_group_blocks`). A full-attention group's leading run, which a lookup reads from block 0
    and which is most of its work on a long prompt, is the run vLLM's own finder already walked
    (``sources``: the walks that give it), extended through the pool only past where that walk stopped;
    ``run_from`` and ``max_query`` are what the loop over ``has`` would give
    (``tests/adapter/test_pool_cache.py``).

    Args:
        members: per spec group, the KV-cache group ids to ask for.
        sources: per spec group whose leading run vLLM's walks give, the indices of those walks in vLLM's
            lookup order (:func:`walk_sources`).
    """

    def __init__(self, block_pool, hash_block: int, members: Sequence[Sequence[int]],
                 sources: Sequence[tuple[int, Sequence[int]]] = ()) -> None:
        # CacheState's oracle is the method below, not an instance attribute
        self.get_cached_block = block_pool.get_cached_block
        self.hash_block, self.members, self.sources = hash_block, members, dict(sources)
        # (k, x) -> what the pool gave for it, in the order first asked: the blocks of k's KV-cache groups
        # (``get_cached_block``'s list), or None when it is not cached
        self.asked: dict[tuple[int, int], list | None] = {}
        self.block_hashes: Sequence = ()
        self.walks: Sequence[_Walk | None] = ()
        self.max_query = 0

    def start(self, block_hashes: Sequence, walks: Sequence[_Walk | None] = ()) -> PoolCache:
        """The cache of a lookup of ``block_hashes`` whose walks of vLLM's spec groups are ``walks`` (none:
        every run is read from the pool); what the last lookup asked is forgotten."""
        self.block_hashes, self.walks, self.max_query = block_hashes, walks, 0
        self.asked.clear()
        return self

    def has(self, k, x):
        """Whether the request's block hash ending at token ``x`` is cached for every KV-cache group of
        spec group ``k``."""
        key = (k, x)
        found = self.asked.get(key, _UNASKED)
        if found is _UNASKED:
            j, rest = divmod(x, self.hash_block)
            if rest:
                raise ValueError(f"boundary {x} is not a multiple of the hash unit {self.hash_block}")
            hashes = self.block_hashes
            found = self.asked[key] = (self.get_cached_block(hashes[j - 1], self.members[k])
                                       if 0 < j <= len(hashes) else None)
        return found is not None

    def run_from(self, k, start, unit, limit):
        """``CacheState.run_from``; from block 0 of a walked group, the walks' answer: the shortest of the
        runs of the walks that give the group (a block is cached for the spec group when it is for every
        walk), known past where the first of them stopped looking only if none stopped earlier."""
        indices = self.sources.get(k) if start == 0 and self.walks else None
        if indices is None:
            return super().run_from(k, start, unit, limit)
        walk = self.walks[indices[0]]
        block, walked, run = walk[1], walk[4], walk[3] // walk[1]  # block, walked, found // block
        if unit != block:
            return super().run_from(k, start, unit, limit)
        for i in indices[1:]:
            walk = self.walks[i]
            walked, run = min(walked, walk.walked), min(run, walk.found // block)
        if run >= walked:
            run = walked
            if limit > walked:  # every block the walks looked at is cached: the pool answers past them
                return run + super().run_from(k, run, unit, limit)
        n = run if run < limit else max(0, limit)
        last = (n + 1) * unit if n < limit else n * unit  # the boundary the loop would have asked last
        if last > self.max_query:
            self.max_query = last
        return n


def reference_hit_tokens(layout: Layout, speculation: Speculation) -> Callable:
    """``refimpl.hit_tokens`` under the reference policy for one layout, as a function of ``(N, cache)``:
    the spec's ``hit_tokens`` staged for the layout (``kvhit.refimpl.staging``: the layout's branches taken
    once, when the coordinator is built, leaving what depends on the request; the same operator table the
    refimpl is generated with; ``tests/properties/test_staged.py`` checks it against ``refimpl``). The
    generic ``refimpl.hit_tokens`` costs a lookup several microseconds of Python per call that the staged
    function does not (``make bench``). If the layout cannot be staged (no reference layout is known not
    to), that generic one, logged once."""
    try:
        _, staged = stage_hit_tokens(layout, speculation, "reference")
        return staged
    except SpecError as e:
        log_once(logging.WARNING, "kvhit: the reference hit of layout %s is not staged (%s); the generic "
                 "refimpl computes it", layout.name, e)
        sizes = derive_sizes(layout, speculation)
        return lambda n_tokens, cache: hit_tokens(cache, sizes, n_tokens, REFERENCE)


class _OneGroup(CacheState):
    """Spec group ``k`` of ``cache`` as the only group of a one-group layout: its queries go to ``cache``
    (and are accounted in its ``max_query``)."""

    def __init__(self, cache: CacheState, k: int) -> None:
        super().__init__(lambda _, x: cache.has(k, x))
        self.cache, self.k = cache, k

    def run_from(self, _, start, unit, limit):
        return self.cache.run_from(self.k, start, unit, limit)

    def window(self, _, x, unit, before, after):
        return self.cache.window(self.k, x, unit, before, after)

    def last_held(self, _, step, lo, hi, unit, before, after):
        return self.cache.last_held(self.k, step, lo, hi, unit, before, after)


def walk_sources(members: Sequence[Sequence[int]], spec_groups,
                 block_of: Sequence[int]) -> tuple[tuple[int, tuple[int, ...]], ...]:
    """``(k, indices)`` for each spec group ``k`` whose KV-cache groups ``members[k]`` are exactly those of
    vLLM full-attention spec groups ``spec_groups[i]`` (``i`` in ``indices``) of one block size
    (``block_of[group id]``): the spec groups whose leading run the lookup's walks give
    (:func:`_walk_full_attention`)."""
    full = [(i, set(g[1])) for i, g in enumerate(spec_groups) if isinstance(g[0], FullAttentionSpec)]
    sources = []
    for k, ids in enumerate(members):
        ids = set(ids)
        inside = [(i, gids) for i, gids in full if gids <= ids]
        if (inside and set().union(*(gids for _, gids in inside)) == ids
                and len({block_of[gid] for gid in ids}) == 1):
            sources.append((k, tuple(i for i, _ in inside)))
    return tuple(sources)


def pool_cache(coordinator: KVCacheCoordinator, block_hashes: Sequence, model: CoordinatorModel,
               walks: Sequence[_Walk | None] = ()) -> PoolCache:
    """A new :class:`PoolCache` of a request on ``model``'s spec groups, given the walks the lookup made of
    the coordinator's spec groups (:func:`_walks`)."""
    cache = PoolCache(coordinator.block_pool, model.sizes.hash_block, model.members, model.walked)
    return cache.start(block_hashes, walks)


def _block_sizes(coordinator: KVCacheCoordinator) -> list[int]:
    """Per KV-cache group id, its manager's block size (scaled by DCP when sharded)."""
    return [manager.block_size for manager in coordinator.single_type_managers]


class _Capped(_Stock):
    """A lookup capped below ``N - 1``: the hashes of ``max_cache_hit_length + 1`` tokens are not the
    request's (:func:`capped_reference`)."""


class _CapBelowReference(Exception):
    """A capped lookup whose reference hit or shared prefix passes the cap (:func:`capped_reference`)."""


def _reference(coordinator: KVCacheCoordinator, model: CoordinatorModel, block_hashes: Sequence,
               walks: Sequence[_Walk | None], max_cache_hit_length: int) -> tuple[int, int, int]:
    """``(hit, reach, longest)`` of ``refimpl.hit_tokens`` under the reference policy for a request of
    ``N = max_cache_hit_length + 1`` tokens on the model's :class:`PoolCache`, started for this lookup
    (``longest``: the shared prefix, at least the hit).

    Raises:
        _Capped: the cap is not ``N - 1`` for a request with these block hashes: the hashes of ``N`` tokens
            would not reach as far as these (:func:`capped_reference` answers it where the model is
            ``capped``).
    """
    hit, reach, longest, _ = model.hit_tokens(max_cache_hit_length + 1, model.cache.start(block_hashes, walks))
    if reach != len(block_hashes) * model.sizes.hash_block:
        raise _Capped(f"a lookup capped at {max_cache_hit_length} tokens for a request with "
                      f"{len(block_hashes)} block hashes: the cap is not N - 1, and this coordinator's "
                      "scheduler does not cap lookups (only auxiliary outputs do)")
    return hit, reach, longest


def capped_reference(coordinator: KVCacheCoordinator, model: CoordinatorModel, block_hashes: Sequence,
                     max_cache_hit_length: int, capped: _Capped) -> tuple[int, int, int, list]:
    """``(hit, reach, longest, walks)`` of the reference for a lookup capped at ``M = max_cache_hit_length``
    below ``N - 1`` (:class:`_Capped`), on a ``capped`` model (its scheduler has auxiliary outputs).

    The reference hit of ``N`` tokens is the longest multiple of ``A`` at most ``min(N - 1, |H| * h)`` that
    every group serves, and whether a group serves a length depends on the hashes, not on ``N``; its shared
    prefix is the same kind of maximum. A lookup capped at ``M < N - 1`` asks for the maximum at most
    ``min(M, |H| * h)``. This computes the reference for the longest prompt these hashes can belong to,
    whose bound is ``|H| * h`` (its walks of vLLM's full-attention groups reach the hashes' end), and
    answers it when its hit and its shared prefix are at most ``M``: the same maximum over a smaller set
    that holds it.

    Raises:
        _Stock: ``capped``, the model is not ``capped`` (a ``KVCacheManager`` built outside a scheduler,
            vLLM's unit tests: answered by vLLM's own code for that lookup).
        _CapBelowReference: the hit or the shared prefix passes the cap, so neither is the capped lookup's
            (:func:`aux_cap_reason` says why this does not happen on a layout kvhit enforces under auxiliary
            outputs; a fallback, counted).
    """
    sizes = model.sizes
    covered = len(block_hashes) * sizes.hash_block
    n_tokens = covered + sizes.hash_block + sizes.hash_lookahead - 1  # the longest prompt with these hashes
    if not model.capped or n_tokens - 1 < covered:
        raise capped
    walks = _walks(model, block_hashes, n_tokens - 1)
    hit, reach, longest, _ = model.hit_tokens(n_tokens, model.cache.start(block_hashes, walks))
    if reach != covered or longest > max_cache_hit_length:
        raise _CapBelowReference(f"a lookup capped at {max_cache_hit_length} tokens: the reference hit of its "
                                 f"{len(block_hashes)} block hashes is {hit}, its shared prefix {longest}")
    return hit, reach, longest, walks


def reference_hit(coordinator: KVCacheCoordinator, model: CoordinatorModel, block_hashes: Sequence,
                  max_cache_hit_length: int) -> tuple[int, int]:
    """``(hit, reach)`` of the reference policy for a request whose lookup vLLM capped at
    ``max_cache_hit_length``, as the enforced lookup computes it (shadow mode): vLLM's finder walks each
    full-attention prefix (:func:`_walks`).

    Raises:
        _Stock, _CapBelowReference: see :func:`_reference` and :func:`capped_reference`.
    """
    try:
        hit, reach, _ = _reference(coordinator, model, block_hashes,
                                   _walks(model, block_hashes, max_cache_hit_length), max_cache_hit_length)
    except _Capped as capped:
        hit, reach, _, _ = capped_reference(coordinator, model, block_hashes, max_cache_hit_length, capped)
    return hit, reach


def group_reference_hit(model: CoordinatorModel, cache: CacheState, k: int, bound: int, covered: int) -> int:
    """The reference hit of spec group ``k`` on its own: the longest multiple of ``A`` at most ``bound``
    that the group serves within the ``covered`` tokens the block hashes cover (``refimpl.reference_pass``
    over a layout of that one spec group)."""
    alone = dataclasses.replace(model.sizes, groups=(model.sizes.groups[k],))
    one = _OneGroup(cache, k)
    return reference_pass(one, alone, bound, group_extents(one, alone, covered), covered, REFERENCE)


def _spec_groups(coordinator: KVCacheCoordinator) -> tuple[list[tuple], int]:
    """vLLM's spec groups as its coordinator looks them up, ``(spec, group_ids, manager_cls, use_eagle)``,
    and its alignment. The Unitary coordinator's one group is looked up at the cap without the EAGLE margin
    (its ``use_eagle`` here is False: it only adds the margin, kvhit never passes vLLM's drop)."""
    if isinstance(coordinator, UnitaryKVCacheCoordinator):
        manager = coordinator.single_type_managers[0]
        return [(coordinator.kv_cache_spec, [0], type(manager), False)], coordinator.block_size
    return coordinator.attention_groups, coordinator._cache_hit_alignment_tokens


class _GroupPlan(NamedTuple):
    """What looking up one of vLLM's spec groups with its own finder needs from the coordinator; fixed when
    the coordinator is built, so a lookup does not look it up again (:func:`group_plans`).

    ``full``: a full-attention group, walked once per lookup (:func:`_walk_full_attention`); ``margin``:
    the EAGLE margin vLLM's first pass looks past the cap (an EAGLE group only); ``unit``: the alignment its
    finder is called with (a walk's: vLLM's when finer than the block, hash granularity); ``asked_as``: for
    a Mamba group whose finder would ask the pool what :class:`PoolCache` asks for spec group ``asked_as``
    (:func:`mamba_asked_as`), that index, else None.
    """

    spec: object
    group_ids: list[int]
    manager_cls: type
    block_pool: object
    dcp: int
    pcp: int
    block: int
    full: bool
    eagle: bool
    margin: int
    unit: int
    asked_as: int | None

    def find(self, block_hashes: Sequence, max_length: int, alignment: int):
        """vLLM's finder of the group, with the arguments vLLM's coordinator passes, without the drop."""
        return self.manager_cls.find_longest_cache_hit(
            block_hashes=block_hashes,
            max_length=max_length,
            kv_cache_group_ids=self.group_ids,
            block_pool=self.block_pool,
            kv_cache_spec=self.spec,
            drop_eagle_block=False,
            alignment_tokens=alignment,
            dcp_world_size=self.dcp,
            pcp_world_size=self.pcp,
        )


def mamba_asked_as(coordinator: KVCacheCoordinator, manager, spec_group: tuple,
                   members: Sequence[Sequence[int]], alignment: int) -> int | None:
    """The spec group ``k`` whose :class:`PoolCache` answers at a hit are what vLLM's
    ``MambaManager.find_longest_cache_hit`` of ``spec_group`` (``(spec, group_ids, manager_cls, use_eagle)``,
    looked up by ``manager``) finds there, or None.

    Called with ``max_length = hit``, that finder searches the group's blocks from right to left and stops at
    the first cached one whose end is a multiple of ``alignment``: with ``alignment`` a multiple of the block
    and ``hit`` of ``alignment``, its first question to the pool is ``get_cached_block`` of the request's hash
    ending at ``hit`` (at block granularity, the last hash of block ``hit // block - 1``) for ``group_ids``;
    when ``group_ids`` are exactly ``members[k]`` (in order) and it asks the coordinator's pool, that is
    :meth:`PoolCache.has` ``(k, hit)``, and a cached answer is the finder's result (:func:`_mamba_blocks`).
    Only vLLM's own ``MambaManager``, with no DCP or PCP (which it refuses), qualifies.
    """
    spec, group_ids, manager_cls, _ = spec_group
    block = spec.block_size
    if (manager_cls is not MambaManager or manager.block_pool is not coordinator.block_pool
            or manager.block_size != block or manager.dcp_world_size != 1 or manager.pcp_world_size != 1
            or alignment % block):
        return None
    return next((k for k, ids in enumerate(members) if list(ids) == list(group_ids)), None)


def group_plans(coordinator: KVCacheCoordinator, members: Sequence[Sequence[int]]) -> tuple[_GroupPlan, ...]:
    """Per vLLM spec group in lookup order, its :class:`_GroupPlan`, given the KV-cache group ids of each of
    the model's spec groups (``members``).

    Raises:
        Unmodelled: a full-attention block that is not a multiple of vLLM's alignment when the alignment is
            finer (the walk could not find the group's run of blocks).
    """
    spec_groups, alignment = _spec_groups(coordinator)
    h = coordinator.block_pool.hash_block_size
    plans = []
    for spec_group in spec_groups:
        spec, group_ids, manager_cls, use_eagle = spec_group
        manager = coordinator.single_type_managers[group_ids[0]]
        block = manager.block_size
        full = isinstance(spec, FullAttentionSpec)
        margin = 0
        if full and use_eagle:
            margin = eagle_proof_margin(
                block, h, coordinator.enable_partial_hash_hits and manager_cls.supports_fine_grained_hash_lookup)
        unit = min(alignment, block) if full else alignment
        if full and block % unit:
            raise Unmodelled(f"full-attention groups {group_ids}: block {block} is not a multiple of the "
                             f"alignment {unit}")
        plans.append(_GroupPlan(spec, group_ids, manager_cls, manager.block_pool, manager.dcp_world_size,
                                manager.pcp_world_size, block, full, full and use_eagle, margin, unit,
                                mamba_asked_as(coordinator, manager, spec_group, members, unit)))
    return tuple(plans)


def _walk_full_attention(plan: _GroupPlan, block_hashes: Sequence, max_cache_hit_length: int) -> _Walk:
    """One full-attention spec group looked up by vLLM's ``FullAttentionManager.find_longest_cache_hit``
    as vLLM's first pass bounds it (the cap; an EAGLE group the cap plus its margin, within the hashes),
    without the drop and aligned to at most its block, so that it returns the group's leading run of
    cached blocks (at hash granularity, also the highest cached boundary inside the next block, as vLLM's
    own pass finds it) with their blocks. The lookup's one walk of the prefix: the refimpl reads the run
    from it (:class:`PoolCache`) and the group's blocks are cut from it (:func:`_group_blocks`)::

        |  cached blocks (run)  | tail? |            found = run * b (+ the partial tail)
        0                              walked * b    the blocks the finder looked at
    """
    covered = len(block_hashes) * plan.block_pool.hash_block_size
    max_length = min(max_cache_hit_length + plan.margin, covered) if plan.eagle else max_cache_hit_length
    blocks, found = plan.find(block_hashes, max_length, plan.unit)
    walked = min(max_length, covered) // plan.block
    return _new_tuple(_Walk, (plan.group_ids, plan.block, blocks, found, walked))


def _mamba_blocks(plan: _GroupPlan, cached: list, hit: int) -> list[list]:
    """What vLLM's ``MambaManager.find_longest_cache_hit`` returns at ``max_length = hit`` when its first
    question to the pool, the block ending at ``hit``, gave ``cached`` (:func:`mamba_asked_as`): per
    KV-cache group, that block after ``hit // block - 1`` null blocks (vLLM's "dummy blocks at the
    beginning")."""
    nulls = [plan.block_pool.null_block] * (hit // plan.block - 1)
    blocks = []  # a loop, as in _walks
    for block in cached:
        blocks.append(nulls + [block])
    return blocks


def _group_blocks(plan: _GroupPlan, walk: _Walk | None, block_hashes: Sequence, hit: int, cache: PoolCache):
    """The blocks of one of vLLM's spec groups for a hit of ``hit`` tokens, from vLLM's finder.

    Full attention is downward-closed: its walk's blocks are cut to ``cdiv(hit, block)``, as vLLM's Hybrid
    coordinator cuts them; blocks are the pool's for the request's hashes, so they are vLLM's whenever the
    hits agree. If the walk stops short of ``hit`` (the reference may rely on a hash-granular entry past
    the cap), the group's whole cached prefix within the hashes is looked up instead. Other kinds are
    looked up at ``hit`` without the drop (a verified EAGLE group in vLLM's loop is too) and must land on it;
    a Mamba group whose state at ``hit`` the reference found in the pool (``cache``, this lookup's) gets
    the blocks vLLM's finder would return from that one answer, without asking the pool again (stock vLLM
    asks it once; :func:`_mamba_blocks`).
    """
    if walk is not None:
        blocks, found = walk.blocks, walk.found
        if found < hit:
            blocks, found = plan.find(block_hashes, len(block_hashes) * plan.block_pool.hash_block_size,
                                      plan.unit)
        if found < hit:
            raise _Inconsistent(f"full-attention groups {plan.group_ids} serve {found} < reference hit {hit}")
        keep = cdiv(hit, plan.block)
        for group_blocks in blocks:
            del group_blocks[keep:]
        return blocks
    if plan.asked_as is not None and hit % plan.unit == 0:
        cached = cache.asked.get((plan.asked_as, hit))
        if cached is not None:
            return _mamba_blocks(plan, cached, hit)
    blocks, found = plan.find(block_hashes, hit, plan.unit)
    if found != hit:
        raise _Inconsistent(f"{type(plan.spec).__name__} groups {plan.group_ids}: vLLM's finder at {hit} "
                            f"returns {found}")
    return blocks


def _walks(model: CoordinatorModel, block_hashes: Sequence, max_cache_hit_length: int) -> list[_Walk | None]:
    """Per vLLM spec group, its :func:`_walk_full_attention` (None for other kinds)."""
    walks = []  # a loop, not a comprehension: Python 3.11 calls a comprehension as a function
    for plan in model.plans:
        walks.append(_walk_full_attention(plan, block_hashes, max_cache_hit_length) if plan.full else None)
    return walks


def enforced_hit(coordinator: KVCacheCoordinator, model: CoordinatorModel, block_hashes: Sequence,
                 max_cache_hit_length: int):
    """``find_longest_cache_hit`` under the reference policy: ``(blocks per group, hit, num_uncached)``."""
    walks = _walks(model, block_hashes, max_cache_hit_length)
    try:
        hit, _, longest = _reference(coordinator, model, block_hashes, walks, max_cache_hit_length)
    except _Capped as capped:
        hit, _, longest, walks = capped_reference(coordinator, model, block_hashes, max_cache_hit_length, capped)
    out: list = [None] * len(model.spec_group_of)  # every KV-cache group is in one of the plans
    for plan, walk in zip(model.plans, walks):
        for gid, group_blocks in zip(plan.group_ids, _group_blocks(plan, walk, block_hashes, hit, model.cache)):
            out[gid] = group_blocks
    # The shared prefix past the hit (refimpl.shared_prefix_tokens; none on one group) is vLLM's uncached
    # common prefix: get_computed_blocks makes it the request's shared_prefix_boundary, where the write
    # side (the reference's and vLLM's alike) keeps the lagging groups' state for the next prompt that
    # shares it.
    return tuple(out), hit, longest - hit


def enforced_hits_per_group(coordinator: HybridKVCacheCoordinator, model: CoordinatorModel,
                            block_hashes: Sequence, max_cache_hit_length: int):
    """``find_longest_cache_hit_per_group`` under the reference policy: each spec group's own reference
    hit (at most the cap and the hashes) and vLLM's blocks for it."""
    walks = _walks(model, block_hashes, max_cache_hit_length)
    cache = pool_cache(coordinator, block_hashes, model, walks=walks)
    covered = len(block_hashes) * model.sizes.hash_block
    bound = min(max_cache_hit_length, covered)
    hits = [group_reference_hit(model, cache, k, bound, covered) for k in range(len(model.sizes.groups))]
    out_blocks: list[list] = [[] for _ in coordinator.single_type_managers]
    out_hits = [0] * len(coordinator.single_type_managers)
    for plan, walk in zip(model.plans, walks):
        hit = hits[model.spec_group_of[plan.group_ids[0]]]
        for gid, group_blocks in zip(plan.group_ids, _group_blocks(plan, walk, block_hashes, hit, cache)):
            out_blocks[gid] = group_blocks
            out_hits[gid] = hit
    return tuple(out_blocks), tuple(out_hits)


# --------------------------------------------------------------------------------------------------
# Metrics and bounded logs
# --------------------------------------------------------------------------------------------------

HIT_DIVERGENCES = Counter(
    "kvhit_hit_divergences",
    "Prefix-cache lookups (shadow mode) whose kvhit reference hit differs from vLLM's.",
    ["layout", "direction"])
HIT_DIVERGENCE_TOKENS = Counter(
    "kvhit_hit_divergence_tokens",
    "Sum over shadow-mode divergences of |reference hit - vLLM hit| in tokens.",
    ["layout", "direction"])
ENFORCE_FALLBACKS = Counter(
    "kvhit_enforce_fallbacks",
    "Enforce-mode lookups answered by vLLM's own code because kvhit could not serve them.",
    ["layout"])
UNMODELLED_LAYOUTS = Counter(
    "kvhit_unmodelled_layouts",
    "Scheduler KV-cache coordinators left wholly to vLLM: a layout, setting or argument kvhit does not model.")
# In vLLM's naming and per mode, what `kvhit status` reports: how many lookups kvhit computed, and how far
# their reference hits were from stock vLLM's (in shadow the two divergence counters above, by mode).
LOOKUPS = Counter(
    "vllm:kvhit_lookups",
    "Scheduler prefix-cache lookups whose reference hit kvhit computed (shadow: beside vLLM's; enforce: as "
    "the answer).",
    ["layout", "mode"])
MODE_DIVERGENCES = Counter(
    "vllm:kvhit_hit_divergences",
    "Those lookups whose reference hit differs from stock vLLM's on the same cache.",
    ["layout", "mode", "direction"])
MODE_DIVERGENCE_TOKENS = Counter(
    "vllm:kvhit_hit_divergence_tokens",
    "Sum of |reference hit - stock vLLM's hit| over those lookups: the prompt tokens enforce gains "
    "(reference_longer) or loses (reference_shorter) against stock; in shadow, would.",
    ["layout", "mode", "direction"])


class _LookupCounters(dict):
    """``(layout label, mode)`` -> ``LOOKUPS``' child, made the first time it is counted: a lookup counts
    itself with ``_lookups_of[label, mode].inc()``, a dict read in C, where ``Counter.labels()`` would cost it
    about 2 us."""

    def __missing__(self, key: tuple[str, str]):
        child = self[key] = LOOKUPS.labels(*key)
        return child


_lookups_of = _LookupCounters()


def count_lookup(model: CoordinatorModel, reference: int, stock: int) -> None:
    """Count one lookup, in the installed mode, whose reference hit is ``reference`` and stock vLLM's
    ``stock``."""
    _lookups_of[model.label, _mode].inc()
    if reference == stock:
        return
    direction = "reference_longer" if reference > stock else "reference_shorter"
    MODE_DIVERGENCES.labels(model.label, _mode, direction).inc()
    MODE_DIVERGENCE_TOKENS.labels(model.label, _mode, direction).inc(abs(reference - stock))
    if _mode == "shadow":
        HIT_DIVERGENCES.labels(model.label, direction).inc()
        HIT_DIVERGENCE_TOKENS.labels(model.label, direction).inc(abs(reference - stock))


COUNT_GAINS_ENV = "KVHIT_COUNT_GAINS"
COUNT_GAINS = os.environ.get(COUNT_GAINS_ENV, "") not in ("", "0")
"""Whether enforce also computes stock vLLM's hit of each lookup, to count what it gained (read at import)."""


def count_enforced(model: CoordinatorModel, hit: int, n_tokens: int, hashes: int) -> None:
    """Count an enforced lookup of ``n_tokens`` (a request with ``hashes`` block hashes) that answered
    ``hit``. With ``KVHIT_COUNT_GAINS`` set, also against what stock vLLM would have answered on the same
    cache: ``refimpl``'s read side under the release's own rules (``Release.stock_rules``: vLLM's own hit
    on every lookup tests/conformance compares) on the :class:`PoolCache` the lookup has just read, but
    for a lookup capped below ``N - 1`` (refimpl has vLLM's lookups of ``N - 1`` only), which is counted
    without it. That is opt-in because it costs what shadow's comparison does: the generic refimpl, with
    vLLM's fixed-point loop, takes longer than the staged reference hit (``make bench``). Never raises."""
    if not COUNT_GAINS or num_hashes(model.sizes, n_tokens) != hashes:
        _lookups_of[model.label, _mode].inc()
        return
    try:
        stock = hit_tokens(model.cache, model.sizes, n_tokens, model.release.stock_rules)[0]
    except Exception as e:  # noqa: BLE001 - counting must not take the scheduler down
        _fallback_log(logging.ERROR, "kvhit enforce: stock vLLM's hit on layout %s not computed, lookup not "
                      "counted: %s: %s", model.label, type(e).__name__, e)
        return
    count_lookup(model, hit, stock)


class _BoundedLog:
    """Log at most one line per ``interval`` seconds; say how many were suppressed in between."""

    def __init__(self, interval: float) -> None:
        self.interval = interval
        self.next_time = 0.0
        self.suppressed = 0

    def __call__(self, level: int, msg: str, *args: object) -> None:
        now = time.monotonic()
        if now < self.next_time:
            self.suppressed += 1
            return
        if self.suppressed:
            msg += " (%d similar lines suppressed)"
            args += (self.suppressed,)
        self.suppressed = 0
        self.next_time = now + self.interval
        logger.log(level, msg, *args)


_divergence_log = _BoundedLog(LOG_INTERVAL_S)
_fallback_log = _BoundedLog(LOG_INTERVAL_S)

# --------------------------------------------------------------------------------------------------
# The read side: the seams' bodies (each ``*_seam`` makes the replacement of one vLLM original)
# --------------------------------------------------------------------------------------------------

_mode = "off"
# What install() replaced, which uninstall() restores: a version module's SEAMS.
_installed: tuple = ()
# The scheduler's coordinators (built by KVCacheManager while kvhit was installed) -> their model, or
# None when the layout is not modelled.
_models: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


_UNSEEN = object()


def _model_for(coordinator: KVCacheCoordinator) -> CoordinatorModel | None:
    try:
        return _models[coordinator]
    except KeyError:
        log_once(logging.INFO,
                 "kvhit: a %s not built by KVCacheManager while kvhit was installed (a KV connector's own "
                 "copy, or built before kvhit was installed) keeps vLLM's lookup",
                 type(coordinator).__name__)
        return None


def _fall_back(model: CoordinatorModel, error: Exception) -> None:
    ENFORCE_FALLBACKS.labels(model.label).inc()
    _fallback_log(logging.ERROR, "kvhit enforce: lookup on layout %s answered by vLLM: %s: %s",
                  model.label, type(error).__name__, error)


def get_kv_cache_coordinator_seam(original: Callable, release: Release) -> Callable:
    """``get_kv_cache_coordinator`` of vLLM ``release`` (``original``), remembering the coordinator it builds
    as the scheduler's."""

    def get_kv_cache_coordinator(*args, **kwargs) -> KVCacheCoordinator:
        """vLLM's ``get_kv_cache_coordinator``, remembering the coordinator as the scheduler's.

        kvhit takes a layout whole or not at all: a layout whose write side the spec does not model
        (``CoordinatorModel.write_note``), or one built by a scheduler whose config leaves it to vLLM (a KV
        connector kvhit has not checked or one beside a group that is not full attention, auxiliary outputs
        capping at another kind's blocks: :func:`scheduler_init_seam`, :func:`connector_reason`,
        :func:`aux_cap_reason`; a write side the spec does not model under their cap),
        is left to vLLM in every mode, read side and write side, and reported as an unmodelled layout: the
        reference read side on vLLM's write side would not give what the reference promises (the first
        repeat hits what the second does), and shadow's counters say what enforce does.
        """
        coordinator = original(*args, **kwargs)
        if not isinstance(coordinator, (UnitaryKVCacheCoordinator, HybridKVCacheCoordinator)):
            return coordinator  # no prefix caching: nothing to look up
        try:
            model = model_coordinator(coordinator, release)
            if model.write is None:
                raise Unmodelled(f"{model.label}: the spec does not model its write side ({model.write_note}); "
                                 "kvhit does not enforce a read side without its write side")
            facts = _scheduler.get()
            reasons = (facts.stock_reason, facts.caps and aux_cap_reason(coordinator, model),
                       facts.connector and connector_reason(model, facts.connector))
            reason = next((r for r in reasons if r), None)
            if reason is not None:
                raise Unmodelled(f"{model.label}: {reason}")
            if facts.caps:
                model = dataclasses.replace(model_coordinator(coordinator, release, aux_cap_group(coordinator)),
                                            capped=True)
                if model.write is None:
                    raise Unmodelled(f"{model.label}: the spec does not model its write side under the "
                                     f"auxiliary outputs' cap ({model.write_note}); kvhit does not enforce a "
                                     "read side without its write side")
        except Exception as e:  # noqa: BLE001 - the adapter never raises inside vLLM's constructors
            why = str(e) if isinstance(e, Unmodelled) else (
                f"kvhit could not read the layout ({type(e).__name__}: {e}); this is kvhit's bug, please "
                "report it")
            _models[coordinator] = None
            UNMODELLED_LAYOUTS.inc()
            log_once(logging.WARNING, "kvhit: KV-cache layout not modelled by the spec, left to vLLM: %s", why)
            write_status(None, why)
            return coordinator
        _models[coordinator] = model
        sparse = _sparse_managers(coordinator)
        if sparse:
            _tiers[coordinator.block_pool] = EvictionTier(sparse, release)
        sizes = model.sizes
        log_once(logging.INFO, "kvhit: layout %s (S=%d, h=%d, A=%d) is modelled; mode %s; write side: "
                 "reference", model.label, sizes.scheduler_block, sizes.hash_block, sizes.alignment, _mode)
        write_status(model)
        return coordinator

    return get_kv_cache_coordinator


@dataclasses.dataclass(frozen=True)
class SchedulerFacts:
    """What a scheduler's config says about the layout it builds, known while ``Scheduler.__init__`` runs
    (:func:`scheduler_init_seam`: the scheduler makes its KV connector and its auxiliary-output connector
    before its ``KVCacheManager``).

    Attributes:
        stock_reason: Why the whole layout is left to vLLM whatever it is, or None.
        caps: Whether auxiliary outputs cap its lookups below ``N - 1`` (the layout decides:
            :func:`aux_cap_reason`).
        connector: Its KV connector (``kv_transfer_config.kv_connector``), or None (the layout decides:
            :func:`connector_reason`).
    """

    stock_reason: str | None = None
    caps: bool = False
    connector: str | None = None


# Set while Scheduler.__init__ runs (and so while it builds its KVCacheManager). Unset outside a scheduler: a
# KVCacheManager built on its own (tests, vLLM's unit tests) has no connector the adapter could know of.
_scheduler: contextvars.ContextVar[SchedulerFacts] = contextvars.ContextVar("kvhit_scheduler",
                                                                            default=SchedulerFacts())


def aux_outputs_enabled(vllm_config) -> bool:
    """Whether a scheduler built from ``vllm_config`` has auxiliary outputs (``aux_output_config.enabled``).
    Raises what reading the config raises."""
    aux = getattr(vllm_config, "aux_output_config", None)
    return aux is not None and bool(aux.enabled)


def scheduler_facts(vllm_config, aux_outputs: str | None) -> SchedulerFacts:
    """What a scheduler built from ``vllm_config`` says about its layout: its KV connector
    (``kv_transfer_config``) and whether auxiliary outputs (:func:`aux_outputs_enabled`) cap its lookups,
    which the layout then decides on, or a reason that leaves the whole layout to vLLM: auxiliary outputs
    where the release does not model them, with ``aux_outputs`` its reason (None: the release models their
    cap). A config it cannot read is a reason too (never less than stock). Never raises."""
    try:
        transfer = getattr(vllm_config, "kv_transfer_config", None)
        connector = None if transfer is None else _connector_name(transfer)
        caps = aux_outputs_enabled(vllm_config)  # read even where the release does not model them
    except Exception as e:  # noqa: BLE001 - the adapter never raises inside vLLM's constructors
        return SchedulerFacts(stock_reason=_unreadable_config(e))
    if caps and aux_outputs is not None:
        return SchedulerFacts(stock_reason=f"the scheduler has auxiliary outputs (aux_output_config): {aux_outputs}")
    return SchedulerFacts(caps=caps, connector=connector)


def _connector_name(kv_transfer_config) -> str:
    """How a KV connector is named in kvhit's reasons: its class name (``kv_connector``), with the module
    it is loaded from when that is not vLLM's registry (``kv_connector_module_path``): a class of that name
    from elsewhere is not the one kvhit checked."""
    name = str(getattr(kv_transfer_config, "kv_connector", None) or "unnamed")
    module = getattr(kv_transfer_config, "kv_connector_module_path", None)
    return name if module is None else f"{name} from {module}"


def _unreadable_config(error: Exception) -> str:
    """The reason a scheduler whose config kvhit could not read leaves its layout to vLLM."""
    return f"kvhit could not read the scheduler's config ({type(error).__name__}: {error})"


# KV connectors whose answer never shortens what a request starts with when its local hit grows: vLLM adds the
# local hit and the tokens the connector loads past it, and for these the sum is non-decreasing in the local
# hit (vLLM 0.33.0's scheduler side: ExampleConnector loads up to its stored prefix, or nothing;
# DecodeBenchConnector fills up to N - 1; SimpleCPUOffloadConnector loads the run its CPU pool holds from the
# local hit on). Each is driven through vLLM's real Scheduler by tests/adapter/test_connectors.py (the CPU
# pool's answers at every local hit too: tests/adapter/connector_probe.py). Others are
# not: OffloadingConnector loads nothing short of a whole chunk from the local hit, MultiConnector takes its
# first child that loads anything, NixlConnector's decode side loads nothing under a recompute threshold, so
# a longer local hit can end with less, and a connector kvhit has not read may do anything.
CHECKED_CONNECTORS = frozenset({"ExampleConnector", "DecodeBenchConnector", "SimpleCPUOffloadConnector"})
# Checked connectors that start every request at N - 1 whatever its local hit (DecodeBenchConnector fills all
# but the last token with dummy values at a request's first scheduling): where a request starts does not
# depend on the pool, so they are enforced beside any group (:func:`connector_reason`).
FILLING_CONNECTORS = frozenset({"DecodeBenchConnector"})


def connector_reason(model: CoordinatorModel, connector: str) -> str | None:
    """Why a KV connector (``SchedulerFacts.connector``) leaves ``model``'s layout to vLLM, or None: a
    connector of :data:`CHECKED_CONNECTORS` where every group is full attention looked up at its block, or
    one of :data:`FILLING_CONNECTORS` beside any group.

    vLLM's scheduler hands the connector the local hit (the reference's, under enforce: at least stock's
    on the same cache) and starts the request at the local hit plus the tokens the connector loads past
    it, which for a checked connector is never less than with stock's local hit. On full attention the
    write side caches every whole block a request has, computed or loaded, wherever it started, and kvhit
    changes nothing of it: the first repeat's local hit is the reference's on a cache holding the prompt's
    blocks, as without a connector (full attention alone is always looked up at its block: partial hits
    need a Mamba group). Beside a sliding-window, chunked-local or Mamba group, where the request starts
    decides which window blocks and Mamba states it leaves, while the spec's write side starts every
    request at its local hit: the spec models no connector there, and the layout is left to vLLM. Except
    where the connector starts every request at ``N - 1`` whatever its local hit: there no policy decides
    where a request starts, the reference's local hit asks the pool for each state it relies on as ever,
    and the write side keeps, of the blocks vLLM computed or the connector filled, those at the reference's
    boundaries (it names positions; it creates no state)."""
    if connector not in CHECKED_CONNECTORS:
        return (f"the scheduler has a KV connector ({connector}) kvhit has not checked: a longer local hit "
                "may make it load less, and the total less than stock's")
    lagging = sorted({g.kind.prose for g in model.sizes.groups if g.kind is not Kind.FULL})
    if not lagging or connector in FILLING_CONNECTORS:
        return None
    kinds = f"a {lagging[0]} group" if len(lagging) == 1 else f"{' and '.join(lagging)} groups"
    return (f"the scheduler has a KV connector ({connector}) beside {kinds}, where the tokens it loads decide "
            "which states exist: the spec's write side starts every request at its local hit and models no "
            "connector")


def aux_cap_group(coordinator: KVCacheCoordinator) -> int:
    """The KV-cache group whose leading blocks cap every lookup of a scheduler with auxiliary outputs (vLLM
    0.33 ``AuxOutputSchedulerConnector``: its coordinator's ``full_attention_group_id``, else 0)."""
    return getattr(coordinator, "full_attention_group_id", None) or 0


def aux_cap_reason(coordinator: KVCacheCoordinator, model: CoordinatorModel) -> str | None:
    """Why auxiliary outputs leave ``model``'s layout to vLLM, or None: where the spec models their cap.

    vLLM 0.33's ``AuxOutputSchedulerConnector.max_cache_hit`` caps each lookup at
    ``M = min(k * b, N - 1)``, ``k`` the leading blocks of KV-cache group ``g`` (:func:`aux_cap_group`;
    block ``b``) that its own store or that group's pool holds. The spec models that cap where ``g`` is full
    attention (``Layout.aux_cap_group``, ``refimpl.lookup_cap``), and the layout is modelled with it (a
    capped lookup is answered by :func:`capped_reference`). Where ``g`` is read at its block its extent is
    its run, so the cap never binds below what the group serves: the capped reference is the uncapped one.
    Where ``g`` is read at hash granularity the cap binds inside a block, and the reference's write side keeps
    the prompt's Mamba tail where vLLM keeps its checkpoint unless a resend resumes inside a block
    (``refimpl.resume_tail``); the capped layout's write side is then modelled or not as any other
    (:func:`_write_side`). A cap by another kind's leading blocks is not modelled."""
    gid = aux_cap_group(coordinator)
    sg = model.sizes.groups[model.spec_group_of[gid]]
    if sg.kind is Kind.FULL:
        return None
    return (f"the scheduler has auxiliary outputs (aux_output_config), whose cap on each lookup "
            f"(max_cache_hit) is the leading blocks of KV-cache group {gid}, {sg.kind.value} here: the spec "
            "models the cap of a full-attention group")


def scheduler_init_seam(original: Callable, facts_of: Callable[[object], SchedulerFacts]) -> Callable:
    """``Scheduler.__init__`` (``original``), with ``facts_of(vllm_config)`` (what a scheduler built from
    that config says about its layout; it never raises) known to :func:`get_kv_cache_coordinator_seam`'s
    replacement while the scheduler builds its KV cache manager."""

    def scheduler_init(self, *args, **kwargs) -> None:
        """``Scheduler.__init__``, with what its config says about the layout known while it builds the KV
        cache manager."""
        vllm_config = kwargs["vllm_config"] if "vllm_config" in kwargs else (args[0] if args else None)
        token = _scheduler.set(facts_of(vllm_config))
        try:
            original(self, *args, **kwargs)
        finally:
            _scheduler.reset(token)

    scheduler_init.__wrapped__ = original  # inspect.signature shows vLLM's
    return scheduler_init


STATUS_FILE_ENV = "KVHIT_STATUS_FILE"


def write_status(model: CoordinatorModel | None, unmodelled: str | None = None) -> None:
    """Write the scheduler's layout as kvhit saw it to the JSON file ``KVHIT_STATUS_FILE`` names, if set.

    For tools outside the engine-core process (``kvhit status``; the end-to-end test predicts hits from it).
    The layout and speculation are the arguments of ``refimpl.Layout`` / ``refimpl.Speculation``;
    ``unmodelled`` is the reason a layout is left to vLLM (read side and write side), ``write_side`` whose
    write side a modelled layout has (always the reference's); ``kvhit``
    and ``kvhit_path`` the version and folder of the kvhit this process imported; and
    ``prometheus_multiproc_dir`` whether vLLM's ``/metrics`` can show this process's counters;
    ``count_gains`` whether enforce counts what it gains (``KVHIT_COUNT_GAINS``). Written atomically; never
    raises.
    """
    path = os.environ.get(STATUS_FILE_ENV)
    if not path:
        return
    status: dict = {"pid": os.getpid(), "vllm": VLLM_VERSION, "kvhit": kvhit.__version__,
                    "kvhit_path": os.path.dirname(kvhit.__file__), "mode": _mode, "modelled": model is not None,
                    "prometheus_multiproc_dir": bool(os.environ.get("PROMETHEUS_MULTIPROC_DIR")),
                    "count_gains": COUNT_GAINS}
    if model is None:
        status["unmodelled"] = unmodelled
    else:
        groups = []
        for g in model.layout.groups:
            group = dataclasses.asdict(g)
            group["kind"] = g.kind.value
            groups.append(group)
        status.update(
            label=model.label,
            layout={"groups": groups, "dcp": model.layout.dcp,
                    "prefix_match_unit": model.layout.prefix_match_unit,
                    "aux_cap_group": model.layout.aux_cap_group},
            speculation={"mode": model.speculation.mode.value,
                         "num_speculative_tokens": model.speculation.num_speculative_tokens,
                         "multi_module_mtp": model.speculation.multi_module_mtp},
            sizes={"scheduler_block": model.sizes.scheduler_block, "hash_block": model.sizes.hash_block,
                   "alignment": model.sizes.alignment},
            write_side="reference")  # a layout whose write side the spec does not model is unmodelled
    try:
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump(status, f, indent=1)
        os.replace(tmp, path)
    except (OSError, TypeError, ValueError) as e:  # a status file must not take the scheduler down
        log_once(logging.ERROR, "kvhit: cannot write %s=%s: %s", STATUS_FILE_ENV, path, e)


def find_longest_cache_hit_seam(original: Callable, owner: str) -> Callable:
    """``owner.find_longest_cache_hit`` under kvhit's mode: one function per coordinator class (a lookup
    pays one Python call for the seam)."""

    def find_longest_cache_hit(coordinator, block_hashes, max_cache_hit_length):
        model = _models.get(coordinator, _UNSEEN)
        if model is _UNSEEN:
            model = _model_for(coordinator)
        if model is None:
            return original(coordinator, block_hashes, max_cache_hit_length)
        if _mode == "shadow":
            result = original(coordinator, block_hashes, max_cache_hit_length)
            try:
                reference, _ = reference_hit(coordinator, model, block_hashes, max_cache_hit_length)
            except _Stock as e:
                log_once(logging.INFO, "kvhit shadow: not compared: %s", e)
                return result
            except Exception as e:  # noqa: BLE001 - shadow mode never disturbs vLLM
                _fallback_log(logging.ERROR, "kvhit shadow: reference hit failed on layout %s: %s: %s",
                              model.label, type(e).__name__, e)
                return result
            stock = result[1]
            count_lookup(model, reference, stock)
            if reference != stock:
                _divergence_log(logging.WARNING,
                                "kvhit shadow: hit differs on layout %s: N=%d vLLM=%d reference=%d",
                                model.label, max_cache_hit_length + 1, stock, reference)
            return result
        try:
            result = enforced_hit(coordinator, model, block_hashes, max_cache_hit_length)
        except _Stock as e:
            log_once(logging.INFO, "kvhit enforce: left to vLLM: %s", e)
        except Exception as e:  # noqa: BLE001 - a failure must not take the scheduler down; counted and logged
            _fall_back(model, e)
        else:
            count_enforced(model, result[1], max_cache_hit_length + 1, len(block_hashes))
            return result
        return original(coordinator, block_hashes, max_cache_hit_length)

    find_longest_cache_hit.__qualname__ = f"{owner}.find_longest_cache_hit"
    find_longest_cache_hit.__doc__ = f"``{owner}.find_longest_cache_hit`` under kvhit's mode."
    return find_longest_cache_hit


def hybrid_find_longest_cache_hit_per_group_seam(original: Callable) -> Callable:
    """``HybridKVCacheCoordinator.find_longest_cache_hit_per_group`` (``original``) under kvhit's mode."""

    def hybrid_find_longest_cache_hit_per_group(self: HybridKVCacheCoordinator, block_hashes,
                                                max_cache_hit_length):
        """``HybridKVCacheCoordinator.find_longest_cache_hit_per_group``: enforced; stock in shadow mode."""
        model = _model_for(self)
        if model is None or _mode != "enforce":
            return original(self, block_hashes, max_cache_hit_length)
        try:
            return enforced_hits_per_group(self, model, block_hashes, max_cache_hit_length)
        except Exception as e:  # noqa: BLE001 - see find_longest_cache_hit_seam
            _fall_back(model, e)
        return original(self, block_hashes, max_cache_hit_length)

    return hybrid_find_longest_cache_hit_per_group


# --------------------------------------------------------------------------------------------------
# The write side
# --------------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class _Writing:
    """The request whose state vLLM is placing: its layout's write model and prompt length."""

    write: WriteModel
    num_prompt_tokens: int
    junction: int = 0


# Set while KVCacheCoordinator.cache_blocks runs for a request of a coordinator whose write side kvhit
# enforces; the module functions vLLM calls by name inside it read it.
# Outside (KV connectors' copies, other callers) they are vLLM's.
_writing: contextvars.ContextVar[_Writing | None] = contextvars.ContextVar("kvhit_writing", default=None)


def _write_model(coordinator) -> WriteModel | None:
    if _mode != "enforce" or coordinator is None:
        return None
    model = _models.get(coordinator)
    return None if model is None else model.write


def coordinator_cache_blocks_seam(original: Callable) -> Callable:
    """``KVCacheCoordinator.cache_blocks`` (``original``) under kvhit's mode."""

    def coordinator_cache_blocks(self: KVCacheCoordinator, request, num_computed_tokens: int) -> None:
        """``KVCacheCoordinator.cache_blocks`` with the reference replay boundaries and Mamba checkpoint; the
        blocks vLLM's own write side would not have cached are marked extra (:meth:`EvictionTier.mark`)."""
        write = _write_model(self)
        if write is None:
            return original(self, request, num_computed_tokens)
        tier = _tiers.get(self.block_pool)
        before = tier.cached_counts(self, request.request_id) if tier is not None else None
        token = _writing.set(_Writing(write, request.num_prompt_tokens, request.shared_prefix_boundary or 0))
        try:
            original(self, request, num_computed_tokens)
        finally:
            _writing.reset(token)
        if tier is not None:
            try:
                tier.mark(self, request, before)
            except Exception as e:  # noqa: BLE001 - a failure must not take the scheduler down
                _write_fall_back(write, e)

    return coordinator_cache_blocks


def coordinator_replay_boundaries_seam(original: Callable) -> Callable:
    """``kv_cache_coordinator.replay_boundaries`` (``original``) under kvhit's mode."""

    def coordinator_replay_boundaries(num_prompt_tokens: int, scheduler_block_size: int,
                                      use_eagle: bool) -> tuple[int, ...]:
        """``kv_cache_coordinator.replay_boundaries``: the reference's resume points inside an enforced
        ``cache_blocks`` (``refimpl.replay_boundaries(sizes, N, REFERENCE)``) and the request's junctions
        (``WriteModel.junctions``; vLLM's managers add the junction itself again), vLLM's elsewhere."""
        writing = _writing.get()
        if writing is not None:
            try:
                return writing.write.boundaries(num_prompt_tokens) + writing.write.junctions(writing.junction)
            except Exception as e:  # noqa: BLE001 - a failure must not take the scheduler down
                _write_fall_back(writing.write, e)
        return original(num_prompt_tokens, scheduler_block_size, use_eagle)

    return coordinator_replay_boundaries


def _write_fall_back(write: WriteModel, error: Exception) -> None:
    ENFORCE_FALLBACKS.labels(write.label).inc()
    _fallback_log(logging.ERROR, "kvhit enforce: write side on layout %s answered by vLLM: %s: %s",
                  write.label, type(error).__name__, error)


def enforced_writing() -> bool:
    """Whether vLLM is placing state for a request whose write side kvhit enforces (inside an enforced
    ``KVCacheCoordinator.cache_blocks``): a version module's own
    write-side seam (``v0_32.manager_cache_blocks``) asks this first."""
    return _writing.get() is not None


def enforced_resend_boundary() -> int | None:
    """What ``get_mamba_prefill_checkpoint_position`` answers, as the Mamba manager sees it, inside an
    enforced write: the reference resend boundary (where the prompt's Mamba state is kept). None
    outside one, or if it fails (counted and logged): vLLM's answer. A version module's replacement of that
    function, whose signature is the release's, asks this first."""
    writing = _writing.get()
    if writing is not None:
        try:
            return writing.write.resend_boundary(writing.num_prompt_tokens)
        except Exception as e:  # noqa: BLE001 - a failure must not take the scheduler down
            _write_fall_back(writing.write, e)
    return None


def _checkpoint_position(num_tokens: int, unit: int, drop: bool, lookahead: int) -> int:
    """vLLM's ``get_mamba_prefill_checkpoint_position`` (the scheduler module's, which kvhit does not
    replace); vLLM 0.32's has no hash lookahead, nor the parameter."""
    return scheduler.get_mamba_prefill_checkpoint_position(num_tokens, unit, drop, *((lookahead,) if lookahead else ()))


def backend_checkpoint(sched: scheduler.Scheduler, request, start: int, end: int) -> int | None:
    """Where the backend saves the prompt's Mamba state inside the prefill chunk ``[start, end)``, or None:
    where vLLM's ``Scheduler._mamba_block_aligned_split`` lets it (``use_internal_checkpoint``) and every
    Mamba manager reserves the block for it at the same position (``MambaManager._needs_internal_checkpoint``),
    each decided by vLLM's own functions on its own fields.

    A backend-internal prefill checkpoint (every Mamba group's spec has ``num_prefill_checkpoint_blocks``;
    vLLM's ``MambaMixer2`` layers declare one) saves the state at the checkpoint inside the forward pass of
    the chunk that reaches the prompt end, so that the scheduler need not end a chunk there::

        | hit | chunk                        |     one chunk to the prompt end; the backend saves the
        0    start        checkpoint         N     state at the checkpoint inside it, in the block the
                                                   Mamba manager reserved (cache_blocks keys it there)

    The scheduler and the manager decide apart, on different block sizes (the config's smallest block; the
    Mamba group's): where only the scheduler says yes, no state is saved there (docs/findings.md, C2).
    """
    prefill_end = max(request.num_prompt_tokens, request.num_tokens - 1)
    if not sched.mamba_has_prefill_checkpoint_blocks or end < prefill_end:
        return None
    # After the split, schedule() may still cut the chunk below the prompt end, and the manager would then
    # reserve nothing: the prefill lookahead (a chunk ending short of the request's last token), encoder
    # inputs, and a replayed prefix (whose chunk starts below the split's start). None of that is taken on
    # trust: the scheduler seam then ends the chunk at the state itself.
    if end < request.num_tokens or request.has_encoder_inputs or getattr(sched, "prefix_replay_tokens", 0):
        return None
    unit = sched.hash_block_size if sched.mamba_partial_cache_hit else sched.block_size
    position = _checkpoint_position(prefill_end, unit, sched.use_eagle_block_drop,
                                    getattr(sched, "num_hash_lookahead_tokens", 0))
    if not scheduler.is_mamba_prefill_checkpoint_valid(
            query_start=start, query_end=end, checkpoint_position=position, hash_block_size=sched.hash_block_size,
            mamba_block_size=sched.cache_config.block_size,
            checkpoint_alignment=sched.mamba_prefill_checkpoint_alignment):
        return None
    # The manager's own predicate, read before it allocates (it looks the request's blocks up as
    # get_num_blocks_to_allocate is about to).
    for manager in sched.kv_cache_manager.coordinator.single_type_managers:
        if type(manager) is MambaManager:
            at = _checkpoint_position(end, manager.cache_hit_alignment_tokens, manager.drop_eagle_checkpoint_block,
                                      getattr(manager.block_pool, "num_hash_lookahead_tokens", 0))
            if at != position or not manager._needs_internal_checkpoint(request.request_id, start, end, at,
                                                                        prefill_end):
                return None
    return position


def mamba_block_aligned_split_seam(original: Callable) -> Callable:
    """``Scheduler._mamba_block_aligned_split`` (``original``) under kvhit's mode."""

    def mamba_block_aligned_split(self, request, num_new_tokens: int, num_new_local_computed_tokens: int = 0,
                                  num_external_computed_tokens: int = 0) -> int:
        """``Scheduler._mamba_block_aligned_split``: vLLM's clipping, its own stops included (the last
        cacheable block boundary, vLLM's prompt checkpoints, the junction), as the spec's ``chunk_stops``
        models them; then the chunk also ends at the first reference Mamba state inside it
        (``WriteModel.next_mamba_stop``), so a state exists at every point the reference retains (vLLM,
        patched: ``next_mamba_state_boundary``, one more of the scheduler's stops), but where the backend
        saves that state inside this chunk (:func:`backend_checkpoint`), it is the prompt's checkpoint
        (where a resend resumes: ``MambaManager._cache_partial_tail_block`` keeps it there, asking
        :func:`enforced_resend_boundary`) and the reference keeps no later state in the chunk. So the
        chunks are stock's wherever the reference keeps no state vLLM would not."""
        manager = getattr(self, "kv_cache_manager", None)
        write = _write_model(getattr(manager, "coordinator", None))
        num_new_tokens = original(self, request, num_new_tokens, num_new_local_computed_tokens,
                                  num_external_computed_tokens)
        if write is None:
            return num_new_tokens
        try:
            start = request.num_computed_tokens + num_new_local_computed_tokens + num_external_computed_tokens
            if start >= max(request.num_prompt_tokens, request.num_tokens - 1):
                return num_new_tokens
            end, junction = start + num_new_tokens, request.shared_prefix_boundary or 0
            stop = write.next_mamba_stop(request.num_prompt_tokens, start, end, junction)
            if (stop is not None and stop == write.resend_boundary(request.num_prompt_tokens)
                    and stop == backend_checkpoint(self, request, start, end)
                    and write.next_mamba_stop(request.num_prompt_tokens, stop, end, junction) is None):
                stop = None  # the backend saves it, and the manager keeps it: the prompt's checkpoint
        except Exception as e:  # noqa: BLE001 - a failure must not take the scheduler down
            _write_fall_back(write, e)
            return num_new_tokens
        return num_new_tokens if stop is None else stop - start

    return mamba_block_aligned_split


# --------------------------------------------------------------------------------------------------
# The eviction order: the reference's extra blocks go first
# --------------------------------------------------------------------------------------------------

class EvictionTier:
    """The cached blocks of one block pool that the reference write side keeps and vLLM's own would not
    (*extra* blocks), which the pool evicts before any other cached block (enforce).

    The reference keeps state at its own resume points beside vLLM's replay boundaries (:class:`WriteModel`),
    so under enforce a request leaves more sliding-window blocks and Mamba states cached than under stock.
    vLLM's ``get_new_blocks`` takes the blocks at the front of its free queue and evicts the cached ones
    among them; a freed block joins the front when uncached and the back when cached, so cached blocks are
    evicted in the order they were freed, and a sliding-window block is freed when the window passes it,
    before the request's full-attention blocks. On a pool that evicts, the extra blocks would therefore make
    a later prefill evict blocks stock keeps, vLLM's own tails among them, and a later request hit less
    than under stock (``tests/adapter/test_eviction_under_enforce.py``). Here an allocation takes the
    uncached blocks vLLM's takes, then extra blocks (the oldest marked first) in place of the other cached
    blocks it would evict, which stay cached; so the pool holds at least what stock's would::

        vLLM takes:   | u  c1 u  u  c2 u | ... x ...     the first num_blocks; c1, c2 cached, x extra
        kvhit's:      | x  u  u  u  c1 u | c2 ...        x is evicted in place of c2, the latest freed

    A block is extra when the request caching it would not have cached it under vLLM's write side: vLLM's
    ``reachable_block_mask`` on vLLM's ``replay_boundaries`` and the request's junction, with the request's
    hit counted as a junction too (vLLM's lookup, shorter where the reference's hit is longer, records the
    shared prefix as its junction): ``Release.stock_reachable_boundaries``. A block a later lookup hits
    (``touch``) is no longer extra: it serves hits, as the blocks stock keeps do.

    Holds block ids and request ids only, never a block: a block refers to its pool, and the tier is the
    value of a weak mapping keyed by the pool.

    Attributes:
        sparse: the KV-cache group ids whose manager caches through a sparse mask (:func:`_sparse_managers`).
        release: the vLLM release of the pool's coordinator.
        extra: block id -> the block hash it was marked with, oldest marked first. A block whose hash is no
            longer that one was evicted (and maybe cached again by another request); it is dropped when met.
        hits: request id -> the hit its last lookup gave it (``allocate_new_computed_blocks``).
    """

    def __init__(self, sparse: tuple[int, ...], release: Release) -> None:
        self.sparse = sparse
        self.release = release
        self.extra: dict[int, object] = {}
        self.hits: dict[str, int] = {}

    def record_hit(self, request_id: str, hit: int, tracked: dict[str, int]) -> None:
        """Remember ``request_id``'s hit; forget those of requests the managers no longer track
        (``tracked``: a manager's ``num_cached_block``), once they outnumber the tracked ones."""
        self.hits[request_id] = hit
        if len(self.hits) > 2 * len(tracked) + 64:
            self.hits = {r: h for r, h in self.hits.items() if r in tracked or r == request_id}

    def cached_counts(self, coordinator: KVCacheCoordinator, request_id: str) -> list[int]:
        """Per sparse group, how many of the request's blocks its manager has cached so far."""
        managers = coordinator.single_type_managers
        return [managers[gid].num_cached_block.get(request_id, 0) for gid in self.sparse]

    def mark(self, coordinator: KVCacheCoordinator, request, before: Sequence[int]) -> None:
        """Mark the request's blocks its last ``cache_blocks`` cached (past ``before``, per sparse group)
        that vLLM's own mask would not have cached."""
        request_id = request.request_id
        managers = coordinator.single_type_managers
        cached = [(managers[gid], start, managers[gid].num_cached_block.get(request_id, 0))
                  for gid, start in zip(self.sparse, before)]
        cached = [(manager, start, end) for manager, start, end in cached if end > start]
        if not cached:
            return
        junctions = [x for x in (request.shared_prefix_boundary, self.hits.get(request_id, 0)) if x]
        for manager, start, end in cached:
            reachable = self.release.stock_reachable_boundaries(coordinator, manager, request, junctions)
            mask = manager.reachable_block_mask(
                start_block=start,
                end_block=end,
                alignment_tokens=manager.cache_hit_alignment_tokens,
                kv_cache_spec=manager.kv_cache_spec,
                use_eagle=manager.use_eagle,
                retention_interval=coordinator.retention_interval,
                reachable_boundaries=reachable,
                dcp_world_size=manager.dcp_world_size,
            )
            if mask is None:  # vLLM caches every block there too
                continue
            # A Mamba block keyed inside itself holds a state the backend saved at a checkpoint (re-keyed
            # there by _cache_partial_tail_block after the mask cached the block at its end), kept by vLLM's
            # own checkpoint rule: the prompt's checkpoint (the scheduler seam lets the backend save the
            # reference's resume point only where it is vLLM's checkpoint too), a retained boundary or the
            # junction. Not extra.
            checkpoint = type(manager) is MambaManager
            for i, (block, vllm_keeps) in enumerate(zip(manager.req_to_blocks[request_id][start:end], mask),
                                                    start + 1):
                if checkpoint and block.block_hash_num_tokens != i * manager.block_size:
                    continue
                if not vllm_keeps and block.block_hash is not None and not block.is_null:
                    self.extra.pop(block.block_id, None)
                    self.extra[block.block_id] = block.block_hash

    def unmark(self, blocks) -> None:
        """A lookup hit ``blocks``: none of them is extra any more."""
        pop = self.extra.pop
        for block in blocks:
            pop(block.block_id, None)

    def evict_extra_first(self, pool: BlockPool, num_blocks: int) -> None:
        """Before ``pool.get_new_blocks(num_blocks)``, which takes the first ``num_blocks`` blocks of the free
        queue and evicts the cached ones among them: if some of those are not extra, move free extra blocks
        from further back (oldest marked first) to the front in place of as many of them, the latest freed
        first, which stay in the queue. The uncached blocks vLLM takes are the same. Blocks are moved with
        the free queue's own ``remove`` and ``prepend_n``; the queue is walked ``num_blocks`` far, as
        ``popleft_n`` walks it."""
        queue = pool.free_block_queue
        if num_blocks > queue.num_free_blocks:
            return  # vLLM raises
        extra = self.extra
        window, victims = [], []  # the blocks vLLM takes; the cached ones among them that are not extra
        block = queue.fake_free_list_head.next_free_block
        for _ in range(num_blocks):
            window.append(block)
            block_hash = block.block_hash
            if block_hash is not None and extra.get(block.block_id) is not block_hash:
                victims.append(block)
            block = block.next_free_block
        if not victims:
            return
        in_window = {b.block_id for b in window}
        chosen, gone = [], []
        blocks = pool.blocks
        for block_id, block_hash in extra.items():
            block = blocks[block_id]
            if block.block_hash is not block_hash:
                gone.append(block_id)  # evicted since it was marked
            elif block.ref_cnt == 0 and block.prev_free_block is not None and block_id not in in_window:
                chosen.append(block)
                if len(chosen) == len(victims):
                    break
        for block_id in gone:
            del extra[block_id]
        if not chosen:
            return
        spared = victims[len(victims) - len(chosen):]
        first = window.index(spared[0])
        spared_ids = {b.block_id for b in spared}
        moved = [b for b in window[first:] if b.block_id not in spared_ids]
        for block in chosen:
            del extra[block.block_id]
        for block in chosen + moved:
            queue.remove(block)
        queue.prepend_n(chosen + moved)


# The eviction tier of each block pool of a modelled coordinator with sparse groups (see EvictionTier).
_tiers: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _drop_tier(pool: BlockPool, step: str, e: Exception) -> None:
    """An eviction-tier step failed: the pool keeps vLLM's own eviction order from now on (logged once).
    The adapter never raises inside vLLM's allocator."""
    _tiers.pop(pool, None)
    log_once(logging.ERROR, "kvhit enforce: eviction order %s failed (%s: %s); this block pool keeps vLLM's "
             "order; this is kvhit's bug, please report it", step, type(e).__name__, e)


def block_pool_get_new_blocks_seam(original: Callable) -> Callable:
    """``BlockPool.get_new_blocks`` (``original``) under kvhit's mode."""

    def block_pool_get_new_blocks(self: BlockPool, num_blocks: int):
        """``BlockPool.get_new_blocks``; under enforce, the extra blocks of :class:`EvictionTier` are evicted
        before any other cached block."""
        tier = _tiers.get(self)
        if tier is not None and tier.extra and _mode == "enforce":
            try:  # computes every move before the free queue's own remove / prepend_n make them
                tier.evict_extra_first(self, num_blocks)
            except Exception as e:  # noqa: BLE001 - see _drop_tier
                _drop_tier(self, "evict_extra_first", e)
        return original(self, num_blocks)

    return block_pool_get_new_blocks


def block_pool_touch_seam(original: Callable) -> Callable:
    """``BlockPool.touch`` (``original``) under kvhit's mode."""

    def block_pool_touch(self: BlockPool, blocks) -> None:
        """``BlockPool.touch``: a block a lookup hits is no longer one of :class:`EvictionTier`'s extra
        blocks."""
        tier = _tiers.get(self)
        if tier is not None and tier.extra:
            try:
                tier.unmark(blocks)
            except Exception as e:  # noqa: BLE001 - see _drop_tier
                _drop_tier(self, "unmark", e)
        return original(self, blocks)

    return block_pool_touch


def coordinator_allocate_new_computed_blocks_seam(original: Callable) -> Callable:
    """``KVCacheCoordinator.allocate_new_computed_blocks`` (``original``) under kvhit's mode."""

    def coordinator_allocate_new_computed_blocks(self: KVCacheCoordinator, request_id: str, new_computed_blocks,
                                                 num_local_computed_tokens: int, *args, **kwargs) -> None:
        """``KVCacheCoordinator.allocate_new_computed_blocks``: under enforce, the request's hit (for a
        request the managers do not track yet: vLLM's no-op for a running one) is remembered for
        :meth:`EvictionTier.mark`."""
        tier = _tiers.get(self.block_pool) if _mode == "enforce" else None
        if tier is not None:
            try:
                tracked = self.single_type_managers[0].num_cached_block
                if request_id not in tracked:
                    tier.record_hit(request_id, num_local_computed_tokens, tracked)
            except Exception as e:  # noqa: BLE001 - see _drop_tier
                _drop_tier(self.block_pool, "record_hit", e)
        return original(self, request_id, new_computed_blocks, num_local_computed_tokens, *args, **kwargs)

    return coordinator_allocate_new_computed_blocks


# --------------------------------------------------------------------------------------------------
# The seams every supported release shares
# --------------------------------------------------------------------------------------------------

class Originals(NamedTuple):
    """vLLM's originals of the attributes kvhit replaces in every supported release: the same owners and
    names in 0.32.0 and 0.33.0 (read in both releases' sources, ``docs/notes/vllm-0.32-policy.md``
    section 3), captured by :func:`capture_originals` when a release module is imported."""

    get_coordinator: Callable
    scheduler_init: Callable
    unitary_find: Callable
    hybrid_find: Callable
    hybrid_per_group: Callable
    cache_blocks: Callable
    replay_boundaries: Callable
    manager_checkpoint: Callable
    mamba_split: Callable
    get_new_blocks: Callable
    touch: Callable
    allocate_computed: Callable


def _shared_owners() -> Originals:
    """``(owner, attribute)`` of each field of :class:`Originals`."""
    return Originals(
        (kv_cache_manager, "get_kv_cache_coordinator"), (scheduler.Scheduler, "__init__"),
        (UnitaryKVCacheCoordinator, "find_longest_cache_hit"), (HybridKVCacheCoordinator, "find_longest_cache_hit"),
        (HybridKVCacheCoordinator, "find_longest_cache_hit_per_group"), (KVCacheCoordinator, "cache_blocks"),
        (kv_cache_coordinator, "replay_boundaries"),
        (single_type_kv_cache_manager, "get_mamba_prefill_checkpoint_position"),
        (scheduler.Scheduler, "_mamba_block_aligned_split"),
        (BlockPool, "get_new_blocks"), (BlockPool, "touch"), (KVCacheCoordinator, "allocate_new_computed_blocks"))


def capture_originals() -> Originals:
    """vLLM's attributes of :class:`Originals` as the installed vLLM has them now (a release module calls
    this when it is imported, before anything is installed)."""
    return Originals(*(vars(owner)[name] for owner, name in _shared_owners()))


def shared_seams(original: Originals, release: Release, facts_of: Callable[[object], SchedulerFacts],
                 checkpoint_position: Callable[[Callable], Callable]) -> tuple:
    """``(owner, attribute, vLLM's original, kvhit's replacement)`` of every seam of :class:`Originals`, made
    by this module's factories for ``release``: ``facts_of`` is the release's :func:`scheduler_init_seam`
    reading of a scheduler's config and ``checkpoint_position(original)`` its wrapper of
    ``get_mamba_prefill_checkpoint_position`` (whose parameters differ between releases)."""
    replacements = Originals(
        get_coordinator=get_kv_cache_coordinator_seam(original.get_coordinator, release),
        scheduler_init=scheduler_init_seam(original.scheduler_init, facts_of),
        unitary_find=find_longest_cache_hit_seam(original.unitary_find, "UnitaryKVCacheCoordinator"),
        hybrid_find=find_longest_cache_hit_seam(original.hybrid_find, "HybridKVCacheCoordinator"),
        hybrid_per_group=hybrid_find_longest_cache_hit_per_group_seam(original.hybrid_per_group),
        cache_blocks=coordinator_cache_blocks_seam(original.cache_blocks),
        replay_boundaries=coordinator_replay_boundaries_seam(original.replay_boundaries),
        manager_checkpoint=checkpoint_position(original.manager_checkpoint),
        mamba_split=mamba_block_aligned_split_seam(original.mamba_split),
        get_new_blocks=block_pool_get_new_blocks_seam(original.get_new_blocks),
        touch=block_pool_touch_seam(original.touch),
        allocate_computed=coordinator_allocate_new_computed_blocks_seam(original.allocate_computed))
    return tuple((owner, name, was, now)
                 for (owner, name), was, now in zip(_shared_owners(), original, replacements))


# --------------------------------------------------------------------------------------------------
# install / uninstall
# --------------------------------------------------------------------------------------------------

def _seam_name(owner: object, name: str) -> str:
    prefix = owner.__name__ if isinstance(owner, types.ModuleType) else f"{owner.__module__}.{owner.__name__}"
    return f"{prefix}.{name}"


def current_mode() -> str:
    return _mode


def install(mode: str, seams: Sequence[tuple[object, str, object, Callable]]) -> bool:
    """Patch every seam (once) and set the mode (``shadow`` or ``enforce``).

    Args:
        seams: ``(owner, attribute, vLLM's original, kvhit's replacement)`` for every attribute kvhit
            replaces in the installed vLLM (its version module's ``SEAMS``).

    Returns:
        False, with one error log line and nothing patched, if another plugin already replaced a seam.
    """
    global _mode, _installed
    assert mode in ("shadow", "enforce"), mode
    if _mode == mode:
        return True
    for owner, name, original, replacement in seams:
        current = vars(owner)[name]
        if current is not original and current is not replacement:
            log_once(logging.ERROR, "kvhit: %s was already replaced by %r; vLLM is left as it is",
                     _seam_name(owner, name), current)
            return False
    for owner, name, _, replacement in seams:
        setattr(owner, name, replacement)
    _mode, _installed = mode, tuple(seams)
    log_once(logging.INFO, "kvhit: mode %s on vLLM %s: replaced %s", mode, VLLM_VERSION,
             ", ".join(_seam_name(owner, name) for owner, name, _, _ in seams))
    return True


def uninstall() -> None:
    """Restore every original attribute."""
    global _mode, _installed
    if _mode == "off":
        return
    for owner, name, original, _ in _installed:
        setattr(owner, name, original)
    _mode, _installed = "off", ()
    log_once(logging.INFO, "kvhit: uninstalled; vLLM's originals restored")
