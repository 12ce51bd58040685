"""Serving conditions through vLLM 0.33's real ``Scheduler``: token budgets that cut prefill chunks, several
requests in flight sharing a prefix, a KV pool small enough to evict and preempt, several decode steps.

``tests/adapter/scheduler_run.py`` builds the scheduler (vLLM's planner, block-size resolution, block hasher
and ``Scheduler``) and stands in for the model runner; this module adds

* :data:`CASES`: the catalogue layouts kvhit's adapter models (``kvhit.spec.catalogue``), each as the layer
  specs a model's workers would report, with the speculative setting and the prompt lengths that exercise it;
* :class:`Observer`: wraps the coordinators' ``find_longest_cache_hit`` (whatever is installed: vLLM's, or
  kvhit's seam under ``KVHIT_MODE``) and checks every lookup the scheduler makes (:func:`lookup_problems`),
  optionally recording the cache the block pool held for the request at that lookup;
* :func:`serve_stream`: arrivals while others are in flight, stepped until every request finished;
* :data:`CONDITIONS` and ``python -m tests.adapter.serving OUT.json MODELS_DIR``: the fixed streams of
  ``tests/adapter/test_serving_conditions.py`` in one process, under the mode ``KVHIT_MODE`` names (loaded
  through vLLM's plugin loader, as ``EngineCore`` does; unset: stock vLLM, kvhit never imported).
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import math
import os
import random
import sys
from collections.abc import Callable, Sequence

from tests.adapter import scheduler_run
from tests.adapter.scheduler_run import SchedulerSetup

BUDGETS = (2048, 8192)
_EAGLE1_DROP = {"method": "eagle", "model": "llama_eagle_draft", "num_speculative_tokens": 1,
                "disable_lookahead_block_hashes": True}
_MTP2 = {"method": "mtp", "num_speculative_tokens": 2}
_MTP1_DROP = {"method": "mtp", "num_speculative_tokens": 1, "disable_lookahead_block_hashes": True}
_MTP2_DROP = {**_MTP2, "disable_lookahead_block_hashes": True}


def catalogue_layers(name: str) -> Callable:
    """``vllm_config -> layer specs`` for the catalogue layout ``name``: one layer per group, built as the
    conformance harness builds the group's spec (``build_kv_cache_spec``; DeepSeek-V4's as MLA / SWA-MLA),
    the catalogue's EAGLE group holding the draft layer when the config has a drafter, and every page padded
    to the largest so that vLLM's planner keeps each group's block size (it would otherwise grow the blocks
    of smaller pages)."""

    def layers_of(vllm_config) -> dict:
        from kvhit.spec.catalogue import CATALOGUE
        from tests.conformance.differential import to_harness
        from tests.conformance.vllm_harness import build_kv_cache_spec

        drafting = vllm_config.speculative_config is not None
        specs = [build_kv_cache_spec({**g, "eagle": g["eagle"] and drafting},
                                     num_speculative_blocks=vllm_config.num_speculative_tokens or 0)
                 for g in to_harness(CATALOGUE[name])["groups"]]
        page = max(spec.page_size_bytes for spec in specs)
        return {f"{'draft' if spec.is_draft else 'model'}.layers.{i}.attn":
                spec if spec.page_size_bytes == page else dataclasses.replace(spec, page_size_padded=page)
                for i, spec in enumerate(specs)}

    return layers_of


def with_backend_checkpoints(layers_of: Callable) -> Callable:
    """``layers_of`` with every Mamba layer declaring a backend-internal prefill checkpoint, as vLLM's
    ``MambaMixer2.get_kv_cache_spec`` does for every Mamba-2 layer (``vllm_harness.MAMBA2_PREFILL_CHECKPOINT``):
    the scheduler then lets the prompt's last chunk run past the Mamba checkpoint, which the backend saves
    inside the forward pass."""

    def layers(vllm_config) -> dict:
        from vllm.v1.kv_cache_interface import MambaSpec

        from tests.conformance.vllm_harness import MAMBA2_PREFILL_CHECKPOINT

        return {name: dataclasses.replace(spec, **MAMBA2_PREFILL_CHECKPOINT) if isinstance(spec, MambaSpec)
                else spec for name, spec in layers_of(vllm_config).items()}

    return layers


@dataclasses.dataclass(frozen=True)
class Case:
    """One modelled catalogue layout served through the scheduler.

    Attributes:
        catalogue: the ``kvhit.spec.catalogue`` layout the planner's groups are (checked by the tests).
        mode, num_speculative_tokens, multi_module_mtp: the speculative setting (``refimpl.Speculation``).
        setup: how the scheduler is built (budget, pool and model length are set per run).
        system: tokens of the streams' shared system prompt.
        suffix: ``(lo, hi)``, the lengths of what follows it.
        soak_streams: streams the soak runs through one scheduler of this case (0: not soaked).
        soak_requests: ``(lo, hi)``, the requests of one soak stream.
        preempts: whether the preempting streams can preempt on this layout (see :func:`conditions_of`).
    """

    catalogue: str
    mode: str
    num_speculative_tokens: int
    multi_module_mtp: bool
    setup: SchedulerSetup
    system: int
    suffix: tuple[int, int]
    soak_streams: int = 6
    soak_requests: tuple[int, int] = (6, 14)
    preempts: bool = True

    @property
    def largest_block(self) -> int:
        """The largest block of the catalogue layout, in tokens (DCP included)."""
        from kvhit.spec.catalogue import CATALOGUE

        dcp = self.setup.parallel.get("decode_context_parallel_size", 1)
        return max(g.block_size * (dcp if g.dcp_sharded else 1) for g in CATALOGUE[self.catalogue].groups)

    @property
    def max_prompt(self) -> int:
        return self.system + self.suffix[1] + LONGER_SIBLING


LONGER_SIBLING = 700  # tokens a longer sibling adds to a prompt
MAX_DECODE = 8

CASES = {
    # plain full attention, one group (Unitary coordinator)
    "full16": Case("full16", "none", 0, False, SchedulerSetup("llama", None, scheduler_run.llama_layers, 16),
                   3000, (300, 2600)),
    # the same with an EAGLE-1 draft in its group, drop mode (F2's case)
    "full16-eagle-drop": Case("full16", "drop", 1, False,
                              SchedulerSetup("llama", _EAGLE1_DROP, scheduler_run.llama_eagle_layers, 16),
                              3000, (300, 2600)),
    # the catalogue's llama_eagle: a sharded target group and a replicated EAGLE draft group, DCP 2
    "llama_eagle-dcp2-drop": Case(
        "llama_eagle", "drop", 1, False,
        SchedulerSetup("llama_mqa", {**_EAGLE1_DROP, "model": "llama_mqa_eagle_draft"},
                       scheduler_run.llama_mqa_replicated_draft_layers, 16,
                       parallel={"tensor_parallel_size": 2, "decode_context_parallel_size": 2}),
        3000, (300, 2600)),
    # Gemma-like: full attention 64 + sliding window 32 (window 512)
    "gemma": Case("gemma", "none", 0, False, SchedulerSetup("llama", None, catalogue_layers("gemma"), 32),
                  3000, (300, 2600)),
    # Llama-4-like chunked local attention, alone (block 16, chunk 64): every hit lies in the chunk of N - 1
    # vLLM frees a chunked-local group's blocks before the current chunk, so its smallest pool (one request of
    # the model length: a chunk and a budget) holds both requests of the preempting stream at their peak:
    # served on it, nothing is preempted (measured), and the case runs the concurrent streams only.
    "chunked64": Case("chunked64", "none", 0, False, SchedulerSetup("llama", None, catalogue_layers("chunked64"),
                                                                    16), 3000, (300, 2600), preempts=False),
    # Llama 4 as vLLM 0.33 plans it: full attention (the NoPE layers) beside chunked local attention
    "llama4": Case("llama4", "none", 0, False, SchedulerSetup("llama", None, catalogue_layers("llama4"), 16),
                   3000, (300, 2600)),
    # Qwen3-Next-like: full attention 1600 (holding the MTP layers) + Mamba 1600, two MTP modules
    "qwen3next-mtp2-drop": Case("qwen3next", "drop", 2, True, SchedulerSetup(
        "nemotron_h_mtp", _MTP2_DROP, scheduler_run.nemotron_h_mtp_layers,
        1600), 4800, (1000, 6500)),
    "qwen3next-mtp2-lookahead": Case("qwen3next", "lookahead", 2, True, SchedulerSetup(
        "nemotron_h_mtp", _MTP2, scheduler_run.nemotron_h_mtp_layers, 1600), 4800, (1000, 6500)),
    # The same read at hash granularity (the catalogue's qwen3next_pmu160: prefix_match_unit 160), and with a
    # sliding window of block 160 beside it (three_kind): Mamba states inside a block are partial tails. One
    # MTP module in drop mode, two in drop mode, two with lookahead hashes.
    "qwen3next_pmu160-mtp1-drop": Case("qwen3next_pmu160", "drop", 1, False, SchedulerSetup(
        "nemotron_h_mtp", _MTP1_DROP, scheduler_run.nemotron_h_mtp_layers, 1600, prefix_match_unit=160),
        4800, (1000, 6500), soak_streams=3),
    "qwen3next_pmu160-mtp2-lookahead": Case("qwen3next_pmu160", "lookahead", 2, True, SchedulerSetup(
        "nemotron_h_mtp", _MTP2, scheduler_run.nemotron_h_mtp_layers, 1600, prefix_match_unit=160),
        4800, (1000, 6500), soak_streams=3),
    "three_kind-mtp1-drop": Case("three_kind", "drop", 1, False, SchedulerSetup(
        "nemotron_h_mtp", _MTP1_DROP, scheduler_run.nemotron_h_mtp_swa_layers, 1600), 4800, (1000, 6500),
        soak_streams=3),
    "three_kind-mtp2-lookahead": Case("three_kind", "lookahead", 2, True, SchedulerSetup(
        "nemotron_h_mtp", _MTP2, scheduler_run.nemotron_h_mtp_swa_layers, 1600), 4800, (1000, 6500),
        soak_streams=3),
    "qwen3next_pmu160-mtp2-drop": Case("qwen3next_pmu160", "drop", 2, True, SchedulerSetup(
        "nemotron_h_mtp", _MTP2_DROP, scheduler_run.nemotron_h_mtp_layers, 1600, prefix_match_unit=160),
        4800, (1000, 6500), soak_streams=3),
    "three_kind-mtp2-drop": Case("three_kind", "drop", 2, True, SchedulerSetup(
        "nemotron_h_mtp", _MTP2_DROP, scheduler_run.nemotron_h_mtp_swa_layers, 1600), 4800, (1000, 6500),
        soak_streams=3),
    # The same three with every Mamba layer declaring a backend-internal prefill checkpoint, as vLLM's
    # Mamba-2 layers do (Nemotron-H, Granite 4): the backend saves the prompt's state inside its last chunk,
    # and enforce relies on that only where vLLM's scheduler and Mamba manager both take it
    "qwen3next-mtp2-drop-ckpt": Case("qwen3next", "drop", 2, True, SchedulerSetup(
        "nemotron_h_mtp", _MTP2_DROP,
        with_backend_checkpoints(scheduler_run.nemotron_h_mtp_layers), 1600), 4800, (1000, 6500), soak_streams=3),
    "qwen3next_pmu160-mtp1-drop-ckpt": Case("qwen3next_pmu160", "drop", 1, False, SchedulerSetup(
        "nemotron_h_mtp", _MTP1_DROP, with_backend_checkpoints(scheduler_run.nemotron_h_mtp_layers), 1600,
        prefix_match_unit=160), 4800, (1000, 6500), soak_streams=3),
    "three_kind-mtp2-lookahead-ckpt": Case("three_kind", "lookahead", 2, True, SchedulerSetup(
        "nemotron_h_mtp", _MTP2, with_backend_checkpoints(scheduler_run.nemotron_h_mtp_swa_layers), 1600),
        4800, (1000, 6500), soak_streams=3),
    # DeepSeek-V4 as vLLM 0.33 builds it on CUDA: MLA 256 (three compressions), SWA-MLA 64 holding the MTP
    # layer (the EAGLE group), SWA-MLA 8 and 4; one draft token, drop mode
    "dsv4_cuda-drop": Case("dsv4_cuda", "drop", 1, False,
                           SchedulerSetup("llama", _EAGLE1_DROP, catalogue_layers("dsv4_cuda"), 4),
                           3000, (300, 2600)),
    # DeepSeek-V4 as in the report: MLA 16384 / 512 / 512, SWA-MLA 128 (EAGLE), 8 and 4; hits align to 16384
    "dsv4_report-drop": Case("dsv4_report", "drop", 1, False,
                             SchedulerSetup("llama_long", {**_EAGLE1_DROP, "model": "llama_long_eagle_draft"},
                                            catalogue_layers("dsv4_report"), 4), 20000, (13000, 20000),
                             # 40k-token prompts hashed every 4 tokens: seconds a request on these cores, too
                             # slow for the soak's random streams; served by the fixed conditions only
                             soak_streams=0),
}


def speculation_of(case: Case):
    import kvhit.refimpl as R

    if case.mode == "none":
        return R.Speculation("none")
    return R.Speculation(case.mode, case.num_speculative_tokens, case.multi_module_mtp)


def max_model_len(case: Case) -> int:
    """Room for the case's longest prompt and its decode steps (and the drafts past them)."""
    return case.max_prompt + MAX_DECODE + 16


def build(case: Case, models_dir: str, budget: int, num_gpu_blocks: int | None = None,
          async_scheduling: bool = False):
    """The case's scheduler and block hasher, with token budget ``budget`` and a pool of ``num_gpu_blocks``
    (None: the default, room for four requests of the model length); an ``AsyncScheduler`` with
    ``async_scheduling``."""
    return scheduler_run.build_scheduler_for(dataclasses.replace(
        case.setup, max_num_batched_tokens=budget, max_model_len=max_model_len(case),
        num_gpu_blocks=num_gpu_blocks, async_scheduling=async_scheduling), models_dir)


def pool_blocks(case: Case, models_dir: str, budget: int, pool, arrivals: Sequence[Arrival] = (),
                async_scheduling: bool = False) -> int | None:
    """The pool size ``pool`` names: None (the default pool), a number (that many times the blocks one
    request of the model length needs, which vLLM's admission check asks for at least), or ``"preempt"``:
    one block fewer than ``arrivals`` use at their peak on the default pool, so that the scheduler cannot
    hold them all at once (at least one request's blocks). The peak is measured on stock vLLM (kvhit's mode
    is set aside for it), so that every mode gets the same pool."""
    if pool is None:
        return None
    kvhit = sys.modules.get("kvhit.adapters.vllm")
    mode = kvhit.current_mode() if kvhit is not None else "off"
    if mode != "off":
        kvhit.uninstall()
    try:
        scheduler, block_hasher = build(case, models_dir, budget, async_scheduling=async_scheduling)
        least = minimum_pool(scheduler)
        if pool == "preempt":
            stats: dict = {}
            serve_stream(scheduler, block_hasher, arrivals, stats=stats)
            return max(least, stats["peak_used_blocks"])  # peak in use, less one, and the null block
    finally:
        if mode != "off":
            kvhit.install(mode)
    return math.ceil(pool * (least - 1)) + 1


def minimum_pool(scheduler) -> int:
    """vLLM's smallest pool for the scheduler's model length: the blocks of one request of that length
    (:func:`one_request_blocks`) and the null block."""
    return one_request_blocks(scheduler) + 1


def one_request_blocks(scheduler) -> int:
    """Blocks of the shared pool one request of the model length can hold (vLLM's
    ``max_memory_usage_bytes`` over the page, summed over the groups)."""
    config = scheduler.vllm_config
    return sum(g.kv_cache_spec.max_memory_usage_bytes(config) // g.kv_cache_spec.page_size_bytes
               for g in scheduler.kv_cache_config.kv_cache_groups)


# --------------------------------------------------------------------------------------------------
# Observing every lookup
# --------------------------------------------------------------------------------------------------

def lookup_problems(coordinator, hash_block: int, block_hashes: Sequence, max_cache_hit_length: int,
                    blocks: Sequence[Sequence], hit: int) -> list[str]:
    """Why the blocks a ``find_longest_cache_hit`` returned cannot serve ``hit`` tokens (empty if they can).

    The hit is in ``[0, max_cache_hit_length]`` (``N - 1``) and within the hashes. In every KV-cache group
    (effective block ``b``), each non-null block at index ``i`` is a cached block that the pool reaches from
    the request's hash at the boundary ``x = min((i + 1) * b, hit)`` it must vouch for, or for attention at a
    later boundary within the block (block hashes chain, so a block holding the request's tokens up to there
    holds them up to ``x``: an EAGLE lookup finds the block past the hit, then drops); the key is its primary
    one or a partial entry inside the block (``BlockPool.cache_partial_block``). A Mamba block holds the
    state at ``x`` only when keyed there exactly. The groups' blocks serve the hit: full attention returns
    ``cdiv(hit, b)`` blocks, none null; a sliding window returns ``hit / b`` blocks whose last
    ``cdiv(W - 1, b)`` are not null; Mamba returns ``cdiv(hit, b)`` blocks whose last is not null (and so
    holds the state at ``hit`` exactly); chunked local attention (chunk ``C``) returns ``cdiv(hit, b)`` blocks,
    none null from the start of the hit's chunk, ``floor(hit / C) * C``, on (a request resuming at ``hit``
    attends to its own chunk only, so a hit on a chunk boundary needs no block); with a zero hit, no blocks.
    """
    from vllm.v1.core.kv_cache_utils import get_group_id, make_block_hash_with_group_id
    from vllm.v1.kv_cache_interface import ChunkedLocalAttentionSpec, MambaSpec, SlidingWindowSpec

    try:
        from vllm.v1.kv_cache_interface import SlidingWindowMLASpec
    except ImportError:  # pragma: no cover - vLLM 0.33 has it
        SlidingWindowMLASpec = SlidingWindowSpec

    problems = []
    if not 0 <= hit <= max_cache_hit_length:
        problems.append(f"hit {hit} outside [0, N - 1 = {max_cache_hit_length}]")
    if hit > len(block_hashes) * hash_block:
        problems.append(f"hit {hit} past the {len(block_hashes)} hashes of {hash_block} tokens")
    reaches = coordinator.block_pool.cached_block_hash_to_block.contain
    for g, (group_blocks, manager) in enumerate(zip(blocks, coordinator.single_type_managers)):
        b = manager.block_size
        spec = manager.kv_cache_spec
        covered = []  # per block: the boundary it vouches for, or None for a null block
        for i, block in enumerate(group_blocks):
            if block.is_null:
                covered.append(None)
                continue
            key = block.block_hash
            x = min((i + 1) * b, hit)
            if key is None or get_group_id(key) != g:
                problems.append(f"group {g}: block {block.block_id} at index {i} is not cached for this group")
            elif not (i * b < x and x % hash_block == 0 and any(
                    reaches(make_block_hash_with_group_id(block_hashes[y // hash_block - 1], g), block.block_id)
                    for y in range(x, x + 1 if isinstance(spec, MambaSpec) else (i + 1) * b + 1, hash_block)
                    if y // hash_block <= len(block_hashes))):
                problems.append(f"group {g}: block {block.block_id} at index {i} (covering {x}) does not carry "
                                f"the request's hash there")
            covered.append(x)
        need = -(-hit // b)
        if isinstance(spec, MambaSpec):
            if hit and (len(covered) != need or covered[-1] is None):
                problems.append(f"group {g}: Mamba has no state at {hit} "
                                f"({len(covered)} blocks, last covering {covered[-1] if covered else None})")
        elif isinstance(spec, (SlidingWindowSpec, SlidingWindowMLASpec)):
            window = -(-(spec.sliding_window - 1) // b)
            tail = range(max(0, hit // b - window), len(covered))
            if hit and (len(covered) != hit // b
                        or any(covered[i] is None for i in tail)):
                problems.append(f"group {g}: the sliding window before {hit} is not all cached "
                                f"({len(covered)} blocks, window tail {[covered[i] for i in tail]})")
        elif isinstance(spec, ChunkedLocalAttentionSpec):
            chunk_start = hit // spec.attention_chunk_size * spec.attention_chunk_size
            in_chunk = covered[chunk_start // b:]
            if len(covered) != need or None in in_chunk:
                problems.append(f"group {g}: chunked local attention returned {len(covered)} blocks covering "
                                f"{in_chunk[-3:]} of its chunk from {chunk_start} for hit {hit} (block {b})")
        elif len(covered) != need or None in covered:
            problems.append(f"group {g}: full attention returned {len(covered)} blocks covering "
                            f"{covered[-3:]} for hit {hit} (block {b})")
        if not hit and group_blocks:
            problems.append(f"group {g}: {len(group_blocks)} blocks for a zero hit")
    return problems


def pool_boundaries(scheduler, block_hashes: Sequence) -> list[list[int]]:
    """Per KV-cache group, the boundaries ``(j + 1) * h`` whose block hash the pool holds for that group."""
    pool = scheduler.kv_cache_manager.block_pool
    h = scheduler.hash_block_size
    return [[(j + 1) * h for j, block_hash in enumerate(block_hashes)
             if pool.get_cached_block(block_hash, [g]) is not None]
            for g in range(len(scheduler.kv_cache_config.kv_cache_groups))]


class Observer:
    """Checks every lookup the scheduler makes through its coordinator, and counts the pool's evictions.

    Installed over whatever ``find_longest_cache_hit`` the coordinator classes have (kvhit's seam under
    enforce), so the blocks checked are the ones the scheduler receives. One scheduler at a time.
    """

    def __init__(self, record_pool: bool = False) -> None:
        self.record_pool = record_pool
        self.scheduler = None
        self.lookups = 0
        self.unsound: list[str] = []
        self.evictions = 0
        self.evicted_at: dict[bytes, list[int]] = {}  # block hash -> the eviction counts it was evicted at
        self.request_lookups: dict[str, list[dict]] = {}
        # called as on_lookup(block_hashes, max_cache_hit_length, hit) after each checked lookup
        self.on_lookup: Callable | None = None
        self._request = None
        self._saved: list = []

    def __enter__(self) -> Observer:
        from vllm.v1.core.kv_cache_coordinator import HybridKVCacheCoordinator, UnitaryKVCacheCoordinator
        from vllm.v1.core.kv_cache_manager import KVCacheManager

        observer = self
        for owner in (UnitaryKVCacheCoordinator, HybridKVCacheCoordinator):
            inner = owner.__dict__["find_longest_cache_hit"]

            def find_longest_cache_hit(coordinator, block_hashes, max_cache_hit_length, _inner=inner):
                result = _inner(coordinator, block_hashes, max_cache_hit_length)
                observer._check(coordinator, block_hashes, max_cache_hit_length, result)
                return result

            self._saved.append((owner, "find_longest_cache_hit", inner))
            owner.find_longest_cache_hit = find_longest_cache_hit
        inner_gcb = KVCacheManager.__dict__["get_computed_blocks"]

        def get_computed_blocks(manager, request, *args, **kwargs):
            observer._request = request
            before = observer.lookups
            try:
                result = inner_gcb(manager, request, *args, **kwargs)
            finally:
                observer._request = None
            records = observer.request_lookups.get(request.request_id)
            if observer.lookups > before and records:  # the junction this lookup recorded
                records[-1]["shared_prefix_boundary"] = result[2]
            return result

        self._saved.append((KVCacheManager, "get_computed_blocks", inner_gcb))
        KVCacheManager.get_computed_blocks = get_computed_blocks
        return self

    def __exit__(self, *exc) -> None:
        for owner, name, original in reversed(self._saved):
            setattr(owner, name, original)
        self._saved.clear()

    def attach(self, scheduler) -> None:
        """Observe ``scheduler`` (its pool's evictions are counted from now on)."""
        self.scheduler = scheduler
        pool = scheduler.kv_cache_manager.block_pool
        evict = pool._maybe_evict_cached_block

        from vllm.v1.core.kv_cache_utils import get_block_hash

        def maybe_evict_cached_block(block):
            key = block.block_hash
            evicted = evict(block)
            if evicted:
                self.evictions += 1
                self.evicted_at.setdefault(bytes(get_block_hash(key)), []).append(self.evictions)
            return evicted

        pool._maybe_evict_cached_block = maybe_evict_cached_block

    def evicted_between(self, block_hashes: Sequence, after: int, upto: int) -> bool:
        """Whether a block carrying one of ``block_hashes`` was evicted after eviction ``after`` and up to
        eviction ``upto`` (counts as in :attr:`evictions`)."""
        return any(after < seq <= upto for h in block_hashes for seq in self.evicted_at.get(bytes(h), ()))

    def _check(self, coordinator, block_hashes, max_cache_hit_length, result) -> None:
        if self.scheduler is None or coordinator is not self.scheduler.kv_cache_manager.coordinator:
            return
        blocks, hit = result[0], result[1]
        self.lookups += 1
        problems = lookup_problems(coordinator, self.scheduler.hash_block_size, block_hashes,
                                   max_cache_hit_length, blocks, hit)
        request = self._request
        rid = request.request_id if request is not None else "?"
        if problems:
            self.unsound.append(f"{rid}: N-1={max_cache_hit_length} hit={hit}: " + "; ".join(problems))
        record = {"hit": hit, "max_cache_hit_length": max_cache_hit_length, "evictions": self.evictions,
                  "seq": self.lookups}
        if self.record_pool:
            record["pool"] = pool_boundaries(self.scheduler, block_hashes)
        self.request_lookups.setdefault(rid, []).append(record)
        if self.on_lookup is not None:
            self.on_lookup(block_hashes, max_cache_hit_length, hit)


# --------------------------------------------------------------------------------------------------
# Streams of requests
# --------------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Arrival:
    """A request of a stream: added once every request in ``after`` has finished and ``wait`` steps have
    passed since the previous arrival was added. Equal ``prompt`` keys are the same tokens."""

    request_id: str
    prompt: str
    tokens: tuple
    max_tokens: int = scheduler_run.DECODE_STEPS
    after: tuple = ()
    wait: int = 0


def serve_stream(scheduler, block_hasher, arrivals: Sequence[Arrival], observer: Observer | None = None,
                 trace: list | None = None, stats: dict | None = None, keep_hashes: dict | None = None,
                 max_steps: int = 20000) -> list[dict]:
    """Add ``arrivals`` as they become due and step the scheduler until every request finished; under async
    scheduling, with one step in flight as ``EngineCore`` keeps it.

    Returns per arrival: ``num_cached_tokens`` (``prefill_stats``), the steps it was added and finished at,
    its preemptions, the pool's eviction count and the observer's lookup count when it finished, and the
    observer's lookups of it (each numbered by ``seq`` in the order the scheduler made them, with the
    ``shared_prefix_boundary`` it recorded).
    ``stats`` (if given) gets ``steps``, ``peak_used_blocks`` (the most pool blocks in use after a
    ``schedule()``) and ``most_in_flight`` (the most steps scheduled at once whose output was not in);
    ``keep_hashes`` (if given) each request's block hashes.
    """
    pool = scheduler.kv_cache_manager.block_pool
    # Steps scheduled whose output is not in yet: at most one under async scheduling, whose next step is
    # scheduled before the last one's output is processed (EngineCore's batch queue of two); none otherwise.
    depth = 2 if scheduler.scheduler_config.async_scheduling else 1
    in_flight: collections.deque = collections.deque()
    most_in_flight = peak = 0
    pending = list(arrivals)
    requests, added, finished, cached = {}, {}, {}, {}
    evictions_at_finish, lookups_at_finish = {}, {}
    last_added = -10**9
    for now in range(max_steps):
        while pending and all(a in finished for a in pending[0].after) and now - last_added >= pending[0].wait:
            a = pending.pop(0)
            requests[a.request_id] = scheduler_run.new_request(a.request_id, list(a.tokens), block_hasher,
                                                               a.max_tokens)
            scheduler.add_request(requests[a.request_id])
            added[a.request_id], last_added = now, now
        if not pending and not scheduler.has_unfinished_requests() and not in_flight:
            break
        if scheduler.has_unfinished_requests():
            scheduler_output = scheduler.schedule()
            peak = max(peak, pool.num_gpu_blocks - 1 - pool.get_num_free_blocks())
            in_flight.appendleft((scheduler_output, scheduler_run.sampling(scheduler, scheduler_output)))
            most_in_flight = max(most_in_flight, len(in_flight))
            if len(in_flight) < depth and (scheduler_output.total_num_scheduled_tokens > 0
                                           or scheduler.has_requests()):
                continue  # EngineCore.step_with_batch_queue: fill the queue before taking an output
        if not in_flight:
            continue
        scheduler_output, samples = in_flight.pop()
        scheduler_output, engine_outputs = scheduler_run.step(scheduler, scheduler_output, samples)
        if trace is not None:
            trace.append(scheduler_run._step_record(scheduler_output, engine_outputs))
        for outputs in engine_outputs.values():
            for o in outputs.outputs:
                if o.prefill_stats is not None:
                    cached[o.request_id] = o.prefill_stats.num_cached_tokens
                if o.finish_reason is not None:
                    finished[o.request_id] = now
                    evictions_at_finish[o.request_id] = observer.evictions if observer else 0
                    lookups_at_finish[o.request_id] = observer.lookups if observer else 0
    else:
        raise RuntimeError(f"stream did not finish in {max_steps} steps")
    if stats is not None:
        stats.update(steps=now, peak_used_blocks=peak, most_in_flight=most_in_flight)
    lookups = observer.request_lookups if observer else {}
    if keep_hashes is not None:
        keep_hashes.update({rid: list(request.block_hashes) for rid, request in requests.items()})
    return [{"request_id": a.request_id, "prompt": a.prompt, "prompt_len": len(a.tokens),
             "max_tokens": a.max_tokens, "num_cached_tokens": cached.get(a.request_id), "added": added[a.request_id],
             "finished": finished[a.request_id], "preemptions": requests[a.request_id].num_preemptions,
             "evictions_at_finish": evictions_at_finish[a.request_id],
             "lookups_at_finish": lookups_at_finish[a.request_id],
             "lookups": lookups.get(a.request_id, [])} for a in arrivals]


def tokens(rng: random.Random, n: int) -> list[int]:
    """``n`` prompt tokens (ids 3..511: the stand-in model runner samples 0 and drafts 1)."""
    return [rng.randrange(3, 512) for _ in range(n)]


# --------------------------------------------------------------------------------------------------
# The fixed conditions of tests/adapter/test_serving_conditions.py
# --------------------------------------------------------------------------------------------------

def concurrent_stream(case: Case, seed: str) -> list[Arrival]:
    """A prompt ``a`` (system prompt and a suffix), a sibling ``b`` sharing the system prompt that arrives
    one step later while ``a`` is in prefill (when the budget cuts ``a``'s chunks), then, once both finished,
    ``a`` twice (its first and second repeat), a longer sibling of ``a`` (``a`` and ``LONGER_SIBLING``
    tokens), and ``b`` again."""
    rng = random.Random(seed)
    system = tokens(rng, case.system)
    a = system + tokens(rng, case.suffix[1])
    b = system + tokens(rng, case.suffix[0] + (case.suffix[1] - case.suffix[0]) // 2)
    longer = a + tokens(rng, LONGER_SIBLING)
    return [Arrival("a", "a", tuple(a)), Arrival("b", "b", tuple(b), wait=1),
            Arrival("a-1", "a", tuple(a), after=("a", "b")), Arrival("a-2", "a", tuple(a), after=("a-1",)),
            Arrival("longer", "longer", tuple(longer), after=("a-2",)),
            Arrival("b-1", "b", tuple(b), after=("longer",))]


def preempting_stream(case: Case, seed: str) -> list[Arrival]:
    """Two prompts sharing the system prompt, arriving together and decoding ``MAX_DECODE`` tokens past a
    block boundary of every group (they end 2 and 3 tokens before a multiple of the case's largest block),
    on a pool too small for both at their peak (the ``"preempt"`` pool: the scheduler preempts the later,
    which resumes when the first frees its blocks); then the later twice (its first and second repeat) and
    the first again."""
    rng = random.Random(seed)
    system = tokens(rng, case.system)
    unit = case.largest_block
    n = (case.system + case.suffix[1]) // unit * unit - 2
    a = system + tokens(rng, n - case.system)
    b = system + tokens(rng, n - 1 - case.system)
    return [Arrival("a", "a", tuple(a), MAX_DECODE), Arrival("b", "b", tuple(b), MAX_DECODE),
            Arrival("b-1", "b", tuple(b), after=("a", "b")), Arrival("b-2", "b", tuple(b), after=("b-1",)),
            Arrival("a-1", "a", tuple(a), after=("b-2",))]


# condition -> (stream, pool as a multiple of one request's blocks or "preempt"; None for the default pool;
# async scheduling). An "-async" condition serves its synchronous namesake's prompts with one step in flight,
# at the budget the report that served with --async-scheduling used (8192).
CONDITIONS = {"concurrent": (concurrent_stream, None, False), "preempting": (preempting_stream, "preempt", False),
              "concurrent-async": (concurrent_stream, None, True),
              "preempting-async": (preempting_stream, "preempt", True)}


def conditions_of(case_name: str) -> tuple[str, ...]:
    """The conditions case ``case_name`` is served under: every one, but the preempting streams where they
    cannot preempt (:attr:`Case.preempts`)."""
    return tuple(c for c in CONDITIONS if CASES[case_name].preempts or CONDITIONS[c][1] != "preempt")


def budgets(condition: str) -> tuple[int, ...]:
    """The token budgets ``condition`` is served with."""
    return (8192,) if CONDITIONS[condition][2] else BUDGETS


def run_condition(case_name: str, condition: str, budget: int, models_dir: str) -> dict:
    """One fixed stream (``CONDITIONS``) on case ``case_name`` with token budget ``budget``."""
    case = CASES[case_name]
    stream, pool, async_scheduling = CONDITIONS[condition]
    arrivals = stream(case, f"{case_name}/{condition.removesuffix('-async')}")
    num_gpu_blocks = pool_blocks(case, models_dir, budget, pool, arrivals, async_scheduling)
    with Observer(record_pool=True) as observer:
        scheduler, block_hasher = build(case, models_dir, budget, num_gpu_blocks, async_scheduling)
        observer.attach(scheduler)
        trace: list = []
        hashes: dict = {}
        stats: dict = {}
        served = serve_stream(scheduler, block_hasher, arrivals, observer, trace, stats, keep_hashes=hashes)
    first_serve: dict[str, dict] = {}
    for s in served:  # whether a block of the prompt was evicted since its first serve was looked up
        first = first_serve.setdefault(s["prompt"], s)
        s["evicted_since_first_serve"] = first is not s and observer.evicted_between(
            hashes[s["request_id"]], first["lookups"][0]["evictions"], s["lookups"][0]["evictions"])
    return {"kv_cache_groups": describe_groups(scheduler), "scheduler": {
                "block_size": scheduler.block_size, "hash_block_size": scheduler.hash_block_size,
                "num_blocks": scheduler.kv_cache_config.num_blocks,
                "dcp": scheduler.vllm_config.parallel_config.decode_context_parallel_size,
                "prefix_match_unit": scheduler.vllm_config.cache_config.prefix_match_unit,
                "retention": scheduler.vllm_config.cache_config.prefix_cache_retention_interval,
                "max_num_batched_tokens": scheduler.scheduler_config.max_num_batched_tokens,
                "class": type(scheduler).__name__, "most_in_flight": stats["most_in_flight"]},
            "served": served, "trace": trace, "lookups": observer.lookups, "unsound": observer.unsound,
            "evictions": observer.evictions}


def describe_groups(scheduler) -> list[dict]:
    """The planner's KV-cache groups in plain data (what ``planned_layout`` reads)."""
    from vllm.v1.kv_cache_interface import ChunkedLocalAttentionSpec, MambaSpec, SlidingWindowSpec

    try:
        from vllm.v1.kv_cache_interface import SlidingWindowMLASpec
    except ImportError:  # pragma: no cover
        SlidingWindowMLASpec = SlidingWindowSpec
    groups = []
    for g in scheduler.kv_cache_config.kv_cache_groups:
        spec = g.kv_cache_spec
        kind = ("mamba" if isinstance(spec, MambaSpec) else
                "swa" if isinstance(spec, (SlidingWindowSpec, SlidingWindowMLASpec)) else
                "chunked" if isinstance(spec, ChunkedLocalAttentionSpec) else "full")
        groups.append({"spec": type(spec).__name__, "kind": kind, "block_size": spec.block_size,
                       "window": getattr(spec, "sliding_window", None) if kind == "swa" else None,
                       "chunk": spec.attention_chunk_size if kind == "chunked" else None,
                       "dcp_sharded": spec.dcp_sharded, "eagle": g.is_eagle_group,
                       "tokens_per_state": int(getattr(spec, "tokens_per_state", 1) or 1)
                       if kind != "mamba" else 1, "num_layers": len(g.layer_names)})
    return groups


def planned_layout(run: dict):
    """The ``refimpl.Layout`` of the groups vLLM's planner made (``run["kv_cache_groups"]``)."""
    import kvhit.refimpl as R

    groups = tuple(R.Group(g["kind"], g["block_size"], window=g["window"], chunk=g.get("chunk"),
                           dcp_sharded=g["dcp_sharded"] if g["kind"] != "mamba" else None, eagle=g["eagle"],
                           tokens_per_state=g["tokens_per_state"]) for g in run["kv_cache_groups"])
    return R.Layout(groups, dcp=run["scheduler"]["dcp"], prefix_match_unit=run["scheduler"]["prefix_match_unit"])


def setup_environment() -> None:
    """vLLM's CPU platform and local model folders, as ``scheduler_run.main`` sets them; vLLM's logging."""
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    from vllm.config.logging import LoggingConfig
    from vllm.logger import configure_logging

    configure_logging(LoggingConfig())
    if os.environ.get("KVHIT_MODE"):
        import vllm.plugins

        vllm.plugins.load_general_plugins()


def kvhit_counters() -> dict:
    """kvhit's counters in this process, summed over their labels (empty when kvhit is not imported)."""
    if "kvhit.adapters.vllm" not in sys.modules:
        return {}
    from prometheus_client import REGISTRY

    return {name: sum(sample.value for metric in REGISTRY.collect() for sample in metric.samples
                      if sample.name == f"{name}_total")
            for name in ("kvhit_unmodelled_layouts", "vllm:kvhit_lookups", "kvhit_enforce_fallbacks")}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out")
    parser.add_argument("models_dir")
    parser.add_argument("--case", action="append", help="only these cases")
    parser.add_argument("--condition", action="append", help="only these conditions")
    parser.add_argument("--budget", action="append", type=int, help="only these token budgets")
    args = parser.parse_args(argv)
    setup_environment()
    scheduler_run.write_models(args.models_dir)
    result = {"runs": {}}
    for case_name in args.case or CASES:
        for condition in args.condition or conditions_of(case_name):
            for budget in args.budget or budgets(condition):
                result["runs"][f"{case_name}/{condition}/{budget}"] = run_condition(
                    case_name, condition, budget, args.models_dir)
    result["kvhit_mode"] = (sys.modules["kvhit.adapters.vllm"].current_mode()
                            if "kvhit.adapters.vllm" in sys.modules else None)
    result["kvhit_counters"] = kvhit_counters()
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
