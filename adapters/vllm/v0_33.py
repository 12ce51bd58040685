# SPDX-License-Identifier: Apache-2.0
"""kvhit's seams in vLLM 0.33.0, and what the engine (:mod:`kvhit.adapters.vllm.engine`) needs to know of
that release.

Imported by :func:`kvhit.adapters.vllm.install` only after it checked that vLLM is 0.33.0 (the registry
``kvhit.adapters.vllm.RELEASES``); it imports the engine, which does everything that does not depend on
the release. This module captures vLLM's originals, makes their replacements (most with the engine's
``*_seam`` factories), lists them in :data:`SEAMS` and describes the release in :data:`RELEASE`.

Seams (each restored by :func:`kvhit.adapters.vllm.uninstall`):

* ``vllm.v1.core.kv_cache_manager.get_kv_cache_coordinator``, the name ``KVCacheManager.__init__`` calls:
  remembers the coordinator it builds as the scheduler's and maps its layout to kvhit's (once, logged).
  Coordinators built anywhere else (the CPU coordinator of ``SimpleCPUOffload``, UMBP's scheduler copy)
  are KV connectors' own copies of the policy and stay stock. A layout is taken whole or not at all: one
  whose write side the spec does not model is left to vLLM entirely, reported once as unmodelled.
* ``Scheduler.__init__``: tells the coordinator it builds whether the scheduler has a KV connector or
  auxiliary outputs (a lookup capped below ``N - 1``), which leave the whole layout to vLLM too
  (:func:`scheduler_stock_reason`).
* ``UnitaryKVCacheCoordinator.find_longest_cache_hit`` and ``HybridKVCacheCoordinator.find_longest_cache_hit``:
  the hit of ``KVCacheManager.get_computed_blocks``.
* ``HybridKVCacheCoordinator.find_longest_cache_hit_per_group``: the per-group hits of
  ``KVCacheManager.get_computed_blocks_for_connector``.
* Write side (enforce, layouts with a ``WriteModel``): ``KVCacheCoordinator.cache_blocks`` (a wrapper
  marking the request being cached), the names it and ``MambaManager._cache_partial_tail_block`` call,
  ``kv_cache_coordinator.replay_boundaries`` and ``single_type_kv_cache_manager.
  get_mamba_prefill_checkpoint_position``, and ``Scheduler._mamba_block_aligned_split`` with the
  scheduler module's ``get_mamba_prefill_checkpoint_position``: state is kept at the reference's replay
  boundaries and the scheduler ends a chunk at each Mamba state the reference keeps.
* Eviction order (enforce, layouts with sliding-window or Mamba groups):
  ``BlockPool.get_new_blocks``, ``BlockPool.touch`` and ``KVCacheCoordinator.allocate_new_computed_blocks``:
  a block the reference write side caches beyond what vLLM's own would is evicted before any other cached
  block; the uncached blocks an allocation takes are vLLM's (``EvictionTier``).

What is 0.33.0's own here, read against vLLM 0.32.0's source (``docs/notes/vllm-0.32-policy.md``): the
drop set is ``coordinator.drop_eagle_group_ids`` (lookahead block hashes clear the drop and leave the groups
flagged), the block pool holds ``num_hash_lookahead_tokens``, vLLM's own write side also keeps a dropping
group's state one block below the shared-prefix junction, ``get_mamba_prefill_checkpoint_position`` takes
the hash lookahead, auxiliary outputs cap a lookup below ``N - 1``, and stock's policy is refimpl's
``vllm_0_33``. Every other name the seams touch is the same in both releases.
"""

from __future__ import annotations

from collections.abc import Callable

from vllm.v1.core import kv_cache_coordinator as _coordinator_module
from vllm.v1.core import kv_cache_manager as _manager_module
from vllm.v1.core import single_type_kv_cache_manager as _single_type_module
from vllm.v1.core.block_pool import BlockPool
from vllm.v1.core.kv_cache_coordinator import (
    HybridKVCacheCoordinator,
    KVCacheCoordinator,
    UnitaryKVCacheCoordinator,
)
from vllm.v1.core.sched import scheduler as _scheduler_module

from kvhit.refimpl import VLLM_0_33

from . import engine

# --------------------------------------------------------------------------------------------------
# vLLM 0.33.0's originals
# --------------------------------------------------------------------------------------------------

_ORIGINAL_GET_COORDINATOR = _manager_module.get_kv_cache_coordinator
_ORIGINAL_SCHEDULER_INIT = _scheduler_module.Scheduler.__dict__["__init__"]
_ORIGINAL_UNITARY_FIND = UnitaryKVCacheCoordinator.__dict__["find_longest_cache_hit"]
_ORIGINAL_HYBRID_FIND = HybridKVCacheCoordinator.__dict__["find_longest_cache_hit"]
_ORIGINAL_HYBRID_PER_GROUP = HybridKVCacheCoordinator.__dict__["find_longest_cache_hit_per_group"]
_ORIGINAL_CACHE_BLOCKS = KVCacheCoordinator.__dict__["cache_blocks"]
_ORIGINAL_REPLAY_BOUNDARIES = _coordinator_module.replay_boundaries
_ORIGINAL_MANAGER_CHECKPOINT = _single_type_module.get_mamba_prefill_checkpoint_position
_ORIGINAL_SCHEDULER_CHECKPOINT = _scheduler_module.get_mamba_prefill_checkpoint_position
_ORIGINAL_MAMBA_SPLIT = _scheduler_module.Scheduler.__dict__["_mamba_block_aligned_split"]
_ORIGINAL_GET_NEW_BLOCKS = BlockPool.__dict__["get_new_blocks"]
_ORIGINAL_TOUCH = BlockPool.__dict__["touch"]
_ORIGINAL_ALLOCATE_COMPUTED = KVCacheCoordinator.__dict__["allocate_new_computed_blocks"]

# --------------------------------------------------------------------------------------------------
# What differs in this release
# --------------------------------------------------------------------------------------------------


def drop_group_ids(coordinator: KVCacheCoordinator) -> set[int]:
    """The KV-cache groups in which the coordinator drops the EAGLE block: ``drop_eagle_group_ids``, which
    is empty when the scheduler hashes ahead (``eagle_group_ids`` stays flagged)."""
    return coordinator.drop_eagle_group_ids


def hash_lookahead_tokens(coordinator: KVCacheCoordinator):
    """The tokens past each block that its block hash covers: the block pool's ``num_hash_lookahead_tokens``."""
    return coordinator.block_pool.num_hash_lookahead_tokens


def stock_reachable_boundaries(coordinator: KVCacheCoordinator, manager, request,
                               junctions: list[int]) -> list[int]:
    """The boundaries vLLM 0.33's ``SingleTypeKVCacheManager.cache_blocks`` gives
    ``manager.reachable_block_mask`` for ``request`` with shared-prefix boundaries ``junctions``: vLLM's
    ``replay_boundaries`` (as ``KVCacheCoordinator.cache_blocks`` computes them), each junction, and for a
    manager that drops the EAGLE block each junction less one block (a sibling that diverges right after
    the junction hits one block lower)."""
    reachable = [*_ORIGINAL_REPLAY_BOUNDARIES(request.num_prompt_tokens, coordinator.scheduler_block_size,
                                              bool(coordinator.drop_eagle_group_ids)), *junctions]
    if manager.use_eagle:
        reachable += [x - manager.block_size for x in junctions]
    return reachable


def scheduler_stock_reason(vllm_config) -> str | None:
    """Why a vLLM 0.33 scheduler built from ``vllm_config`` leaves its whole layout to vLLM, or None.

    * A KV connector (``kv_transfer_config``; the scheduler builds it before its KV cache manager): the
      tokens it loads past the local hit, and ``get_computed_blocks_for_connector``'s per-group lookup, are
      not modelled.
    * Auxiliary outputs (``aux_output_config.enabled``): ``AuxOutputSchedulerConnector.max_cache_hit``
      caps lookups below ``N - 1``; the spec models only ``N - 1``.

    A config it cannot read is a reason too (never less than stock). Never raises.
    """
    try:
        if getattr(vllm_config, "kv_transfer_config", None) is not None:
            return ("the scheduler has a KV connector (kv_transfer_config): the tokens it loads and its "
                    "per-group local lookup are not modelled")
        aux = getattr(vllm_config, "aux_output_config", None)
        if aux is not None and aux.enabled:
            return ("the scheduler has auxiliary outputs (aux_output_config): their connector caps lookups "
                    "below N - 1 (max_cache_hit); the spec models only N - 1")
    except Exception as e:  # noqa: BLE001 - the adapter never raises inside vLLM's constructors
        return f"kvhit could not read the scheduler's config ({type(e).__name__}: {e})"
    return None


RELEASE = engine.Release(
    stock_rules=VLLM_0_33,
    drop_group_ids=drop_group_ids,
    hash_lookahead_tokens=hash_lookahead_tokens,
    stock_reachable_boundaries=stock_reachable_boundaries,
)
"""vLLM 0.33.0 as the engine sees it."""


def _checkpoint_position(original: Callable) -> Callable:
    def get_mamba_prefill_checkpoint_position(num_tokens, hash_block_size, drop_eagle_block,
                                              num_hash_lookahead_tokens=0):
        """``get_mamba_prefill_checkpoint_position`` as the Mamba manager and the scheduler see it: inside
        an enforced write, the reference resend boundary (where the prompt's Mamba state is kept), else
        vLLM's."""
        resend = engine.enforced_resend_boundary()
        if resend is not None:
            return resend
        return original(num_tokens, hash_block_size, drop_eagle_block,
                        num_hash_lookahead_tokens=num_hash_lookahead_tokens)

    return get_mamba_prefill_checkpoint_position


# --------------------------------------------------------------------------------------------------
# The replacements
# --------------------------------------------------------------------------------------------------

get_kv_cache_coordinator = engine.get_kv_cache_coordinator_seam(_ORIGINAL_GET_COORDINATOR, RELEASE)
scheduler_init = engine.scheduler_init_seam(_ORIGINAL_SCHEDULER_INIT, scheduler_stock_reason)
unitary_find_longest_cache_hit = engine.find_longest_cache_hit_seam(_ORIGINAL_UNITARY_FIND,
                                                                    "UnitaryKVCacheCoordinator")
hybrid_find_longest_cache_hit = engine.find_longest_cache_hit_seam(_ORIGINAL_HYBRID_FIND,
                                                                   "HybridKVCacheCoordinator")
hybrid_find_longest_cache_hit_per_group = engine.hybrid_find_longest_cache_hit_per_group_seam(
    _ORIGINAL_HYBRID_PER_GROUP)
coordinator_cache_blocks = engine.coordinator_cache_blocks_seam(_ORIGINAL_CACHE_BLOCKS)
coordinator_replay_boundaries = engine.coordinator_replay_boundaries_seam(_ORIGINAL_REPLAY_BOUNDARIES)
manager_checkpoint_position = _checkpoint_position(_ORIGINAL_MANAGER_CHECKPOINT)
scheduler_checkpoint_position = _checkpoint_position(_ORIGINAL_SCHEDULER_CHECKPOINT)
mamba_block_aligned_split = engine.mamba_block_aligned_split_seam(_ORIGINAL_MAMBA_SPLIT)
block_pool_get_new_blocks = engine.block_pool_get_new_blocks_seam(_ORIGINAL_GET_NEW_BLOCKS)
block_pool_touch = engine.block_pool_touch_seam(_ORIGINAL_TOUCH)
coordinator_allocate_new_computed_blocks = engine.coordinator_allocate_new_computed_blocks_seam(
    _ORIGINAL_ALLOCATE_COMPUTED)

SEAMS: tuple[tuple[object, str, object, Callable], ...] = (
    (_manager_module, "get_kv_cache_coordinator", _ORIGINAL_GET_COORDINATOR, get_kv_cache_coordinator),
    (_scheduler_module.Scheduler, "__init__", _ORIGINAL_SCHEDULER_INIT, scheduler_init),
    (UnitaryKVCacheCoordinator, "find_longest_cache_hit", _ORIGINAL_UNITARY_FIND,
     unitary_find_longest_cache_hit),
    (HybridKVCacheCoordinator, "find_longest_cache_hit", _ORIGINAL_HYBRID_FIND,
     hybrid_find_longest_cache_hit),
    (HybridKVCacheCoordinator, "find_longest_cache_hit_per_group", _ORIGINAL_HYBRID_PER_GROUP,
     hybrid_find_longest_cache_hit_per_group),
    # The write side (enforce only, layouts with a WriteModel).
    (KVCacheCoordinator, "cache_blocks", _ORIGINAL_CACHE_BLOCKS, coordinator_cache_blocks),
    (_coordinator_module, "replay_boundaries", _ORIGINAL_REPLAY_BOUNDARIES, coordinator_replay_boundaries),
    (_single_type_module, "get_mamba_prefill_checkpoint_position", _ORIGINAL_MANAGER_CHECKPOINT,
     manager_checkpoint_position),
    (_scheduler_module, "get_mamba_prefill_checkpoint_position", _ORIGINAL_SCHEDULER_CHECKPOINT,
     scheduler_checkpoint_position),
    (_scheduler_module.Scheduler, "_mamba_block_aligned_split", _ORIGINAL_MAMBA_SPLIT,
     mamba_block_aligned_split),
    # The eviction order (enforce only, the block pools of modelled coordinators with sliding-window or
    # Mamba groups: EvictionTier).
    (BlockPool, "get_new_blocks", _ORIGINAL_GET_NEW_BLOCKS, block_pool_get_new_blocks),
    (BlockPool, "touch", _ORIGINAL_TOUCH, block_pool_touch),
    (KVCacheCoordinator, "allocate_new_computed_blocks", _ORIGINAL_ALLOCATE_COMPUTED,
     coordinator_allocate_new_computed_blocks),
)
"""(owner, attribute, vLLM's original, kvhit's replacement) for every attribute kvhit replaces."""
