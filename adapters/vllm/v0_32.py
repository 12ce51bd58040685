# SPDX-License-Identifier: Apache-2.0
"""kvhit's seams in vLLM 0.32.0, and what the engine (:mod:`kvhit.adapters.vllm.engine`) needs to know of
that release.

Imported by :func:`kvhit.adapters.vllm.install` only after it checked that vLLM is 0.32.0 (the registry
``kvhit.adapters.vllm.RELEASES``). The seams are 0.33.0's (``v0_33``: the same owners, names and
signatures, read in both releases' sources, ``docs/notes/vllm-0.32-policy.md`` section 3), made with the
same engine factories, plus one write-side seam of this release's own. What differs:

* **No lookahead block hashes** (0.32 has no ``num_hash_lookahead_tokens``; ``BlockPool.__init__`` has no
  such parameter): every EAGLE-family drafter with prefix caching drops, so the drop set is the
  coordinator's ``eagle_group_ids`` (``kv_cache_coordinator.py:128-133``, read at ``:367``, ``:572``,
  ``:585``, ``:723``), and the hash lookahead is 0.
* **The junction without the block below it.** 0.32's ``SingleTypeKVCacheManager.cache_blocks``
  (``single_type_kv_cache_manager.py:509-511``) keeps a sparse group's state at the request's
  ``shared_prefix_boundary`` only; 0.33's also one block below it for a dropping group (a sibling that
  diverges right after the junction hits one block lower). The reference write side keeps both
  (``refimpl.junction_boundaries`` under ``REFERENCE``), so inside an enforced write this module adds that
  boundary as 0.33's line does (``manager_cache_blocks``); stock 0.32's boundaries, which the eviction tier
  compares with, do not have it (:func:`stock_reachable_boundaries`).
* **``get_mamba_prefill_checkpoint_position(num_tokens, hash_block_size, drop_eagle_block)``**: three
  parameters (``kv_cache_interface.py:1110``), imported by name at ``single_type_kv_cache_manager.py:38``
  (the Mamba manager's, which the seam replaces) and ``sched/scheduler.py:60`` (the scheduler's, left alone).
* **No lookup cap below ``N - 1``**: ``KVCacheManager.get_computed_blocks(request)`` always looks up at
  ``request.num_tokens - 1`` (``kv_cache_manager.py:264``, ``:295``); 0.32's ``AuxOutputSchedulerConnector``
  has no ``max_cache_hit``. Auxiliary outputs still leave the layout to vLLM (:func:`scheduler_facts`).
* Stock's policy is refimpl's ``vllm_0_32``.
"""

from __future__ import annotations

from collections.abc import Callable

from vllm.v1.core.kv_cache_coordinator import KVCacheCoordinator
from vllm.v1.core.single_type_kv_cache_manager import SingleTypeKVCacheManager

from kvhit.refimpl import VLLM_0_32

from . import engine

# --------------------------------------------------------------------------------------------------
# vLLM 0.32.0's originals
# --------------------------------------------------------------------------------------------------

ORIGINAL = engine.capture_originals()
"""vLLM 0.32.0's originals of the attributes every release's seams replace, captured before any is."""
_ORIGINAL_MANAGER_CACHE_BLOCKS = SingleTypeKVCacheManager.__dict__["cache_blocks"]

# --------------------------------------------------------------------------------------------------
# What differs in this release
# --------------------------------------------------------------------------------------------------


def drop_group_ids(coordinator: KVCacheCoordinator) -> set[int]:
    """The KV-cache groups in which the coordinator drops the EAGLE block: ``eagle_group_ids`` (0.32 has no
    lookahead hashes to clear it; flagged groups drop even when the scheduler passed ``use_eagle=False``)."""
    return coordinator.eagle_group_ids


def hash_lookahead_tokens(coordinator: KVCacheCoordinator) -> int:
    """0: vLLM 0.32's block hashes cover their block only."""
    return 0


def stock_reachable_boundaries(coordinator: KVCacheCoordinator, manager, request,
                               junctions: list[int]) -> list[int]:
    """The boundaries vLLM 0.32's ``SingleTypeKVCacheManager.cache_blocks`` gives
    ``manager.reachable_block_mask`` for ``request`` with shared-prefix boundaries ``junctions``: vLLM's
    ``replay_boundaries`` (as ``KVCacheCoordinator.cache_blocks`` computes them, ``use_eagle=
    bool(self.eagle_group_ids)``) and each junction; not the block below it (0.33's)."""
    return [*ORIGINAL.replay_boundaries(request.num_prompt_tokens, coordinator.scheduler_block_size,
                                         bool(coordinator.eagle_group_ids)), *junctions]


def scheduler_facts(vllm_config) -> engine.SchedulerFacts:
    """What a vLLM 0.32 scheduler built from ``vllm_config`` says about its layout
    (:func:`engine.scheduler_facts`).

    * A KV connector: the layout decides, as on 0.33 (0.32's scheduler hands it the local hit the same
      way): :func:`engine.connector_reason`.
    * Auxiliary outputs (``aux_output_config.enabled``) leave the whole layout to vLLM: 0.32's connector
      does not cap lookups, but the routed-experts rows it replays for a cached prefix come from a
      worker-side store kvhit has not read against a hit longer than stock's (never less than stock).

    A config it cannot read is a reason too. Never raises.
    """
    return engine.scheduler_facts(vllm_config, "their rows for a cached prefix are not modelled on vLLM 0.32")


RELEASE = engine.Release(
    stock_rules=VLLM_0_32,
    drop_group_ids=drop_group_ids,
    hash_lookahead_tokens=hash_lookahead_tokens,
    stock_reachable_boundaries=stock_reachable_boundaries,
)
"""vLLM 0.32.0 as the engine sees it."""


def _checkpoint_position(original: Callable) -> Callable:
    def get_mamba_prefill_checkpoint_position(num_tokens, hash_block_size, drop_eagle_block):
        """``get_mamba_prefill_checkpoint_position`` (0.32's three parameters) as the Mamba manager sees it:
        inside an enforced write, the reference resend boundary, else vLLM's."""
        resend = engine.enforced_resend_boundary()
        if resend is not None:
            return resend
        return original(num_tokens, hash_block_size, drop_eagle_block)

    return get_mamba_prefill_checkpoint_position


def manager_cache_blocks(self: SingleTypeKVCacheManager, request, num_tokens: int,
                         retention_interval: int | None = None, *, replay_boundaries) -> None:
    """``SingleTypeKVCacheManager.cache_blocks``; inside an enforced write, a manager that drops the
    EAGLE block also keeps its state one block below the request's shared-prefix junction, as the
    reference write side does (and vLLM 0.33's own line: a sibling that diverges right after the
    junction cannot use the block past it as the EAGLE peek, so its hit lands one block lower)."""
    junction = request.shared_prefix_boundary
    if junction and self.use_eagle and engine.enforced_writing():
        replay_boundaries = [*replay_boundaries, junction - self.block_size]
    return _ORIGINAL_MANAGER_CACHE_BLOCKS(self, request, num_tokens, retention_interval,
                                          replay_boundaries=replay_boundaries)


# --------------------------------------------------------------------------------------------------
# The replacements
# --------------------------------------------------------------------------------------------------

SEAMS: tuple[tuple[object, str, object, Callable], ...] = engine.shared_seams(
    ORIGINAL, RELEASE, scheduler_facts, _checkpoint_position) + (
    (SingleTypeKVCacheManager, "cache_blocks", _ORIGINAL_MANAGER_CACHE_BLOCKS, manager_cache_blocks),
)
"""(owner, attribute, vLLM's original, kvhit's replacement) for every attribute kvhit replaces."""
