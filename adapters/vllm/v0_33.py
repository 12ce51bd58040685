# SPDX-License-Identifier: Apache-2.0
"""kvhit's seams in vLLM 0.33.0, and what the engine (:mod:`kvhit.adapters.vllm.engine`) needs to know of
that release.

Imported by :func:`kvhit.adapters.vllm.install` only after it checked that vLLM is 0.33.0 (the registry
``kvhit.adapters.vllm.RELEASES``); it imports the engine, which does everything that does not depend on
the release. This module captures vLLM's originals (:data:`ORIGINAL`, :func:`engine.capture_originals`),
describes the release in :data:`RELEASE` and lists the seams in :data:`SEAMS`, made by the engine's
factories (:func:`engine.shared_seams`) but for the Mamba checkpoint position, whose signature is this
release's own.

Seams (each restored by :func:`kvhit.adapters.vllm.uninstall`):

* ``vllm.v1.core.kv_cache_manager.get_kv_cache_coordinator``, the name ``KVCacheManager.__init__`` calls:
  remembers the coordinator it builds as the scheduler's and maps its layout to kvhit's (once, logged).
  Coordinators built anywhere else (the CPU coordinator of ``SimpleCPUOffload``, UMBP's scheduler copy)
  are KV connectors' own copies of the policy and stay stock. A layout is taken whole or not at all: one
  whose write side the spec does not model is left to vLLM entirely, reported once as unmodelled.
* ``Scheduler.__init__``: tells the coordinator it builds whether the scheduler has a KV connector
  (enforced where every group is full attention read at its block, or where it starts every request at
  ``N - 1``: :func:`engine.connector_reason`) or
  auxiliary outputs (lookups capped below ``N - 1``: enforced where they cap at full attention's blocks and
  the spec models the write side under the cap, :func:`engine.aux_cap_reason`); elsewhere the whole layout is
  left to vLLM (:func:`scheduler_facts`).
* ``UnitaryKVCacheCoordinator.find_longest_cache_hit`` and ``HybridKVCacheCoordinator.find_longest_cache_hit``:
  the hit of ``KVCacheManager.get_computed_blocks``.
* ``HybridKVCacheCoordinator.find_longest_cache_hit_per_group``: the per-group hits of
  ``KVCacheManager.get_computed_blocks_for_connector``.
* Write side (enforce, layouts with a ``WriteModel``): ``KVCacheCoordinator.cache_blocks`` (a wrapper
  marking the request being cached), the names it and ``MambaManager._cache_partial_tail_block`` call,
  ``kv_cache_coordinator.replay_boundaries`` and ``single_type_kv_cache_manager.
  get_mamba_prefill_checkpoint_position`` (the Mamba prompt checkpoint, a partial tail when it lies inside a
  block, is the reference's resume point), and ``Scheduler._mamba_block_aligned_split``, whose chunk also
  ends at each Mamba state the reference keeps (vLLM's own stops, which the spec models, are kept): state is
  kept at the reference's replay boundaries.
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

from vllm.v1.core.kv_cache_coordinator import KVCacheCoordinator

from kvhit.refimpl import VLLM_0_33

from . import engine

# --------------------------------------------------------------------------------------------------
# vLLM 0.33.0's originals
# --------------------------------------------------------------------------------------------------

ORIGINAL = engine.capture_originals()
"""vLLM 0.33.0's originals of every attribute kvhit replaces, captured before any is replaced."""

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
    reachable = [*ORIGINAL.replay_boundaries(request.num_prompt_tokens, coordinator.scheduler_block_size,
                                              bool(coordinator.drop_eagle_group_ids)), *junctions]
    if manager.use_eagle:
        reachable += [x - manager.block_size for x in junctions]
    return reachable


def scheduler_facts(vllm_config) -> engine.SchedulerFacts:
    """What a vLLM 0.33 scheduler built from ``vllm_config`` says about its layout
    (:func:`engine.scheduler_facts`).

    Neither a KV connector nor auxiliary outputs leave a layout to vLLM by themselves; the layout decides.
    A connector is handed the local hit and loads past it, which leaves full attention's write side as it
    is (:func:`engine.connector_reason`); the auxiliary-output connector's cap
    (``AuxOutputSchedulerConnector.max_cache_hit``) never binds on a layout whose full-attention group it
    reads at its block, and where it reads it at hash granularity the spec models the write side under it
    (:func:`engine.aux_cap_reason`). A config it cannot read is a reason (never less than stock). Never
    raises.
    """
    return engine.scheduler_facts(vllm_config, None)


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
        """``get_mamba_prefill_checkpoint_position`` as the Mamba manager sees it: inside an enforced write,
        the reference resend boundary (where the prompt's Mamba state is kept), else vLLM's."""
        resend = engine.enforced_resend_boundary()
        if resend is not None:
            return resend
        return original(num_tokens, hash_block_size, drop_eagle_block,
                        num_hash_lookahead_tokens=num_hash_lookahead_tokens)

    return get_mamba_prefill_checkpoint_position


# --------------------------------------------------------------------------------------------------
# The replacements
# --------------------------------------------------------------------------------------------------

SEAMS: tuple[tuple[object, str, object, Callable], ...] = engine.shared_seams(
    ORIGINAL, RELEASE, scheduler_facts, _checkpoint_position)
"""(owner, attribute, vLLM's original, kvhit's replacement) for every attribute kvhit replaces."""
