# SPDX-License-Identifier: Apache-2.0
"""Drive vLLM's real prefix-cache classes on the CPU, one request at a time.

This is kvhit's conformance harness for vLLM 0.33.0 and 0.32.0 (what differs
between the two is in one place, ``VersionSeams`` below). It builds a real
``KVCacheManager`` (coordinator, single-type managers, block pool, request
block hasher) from a small *layout* description and serves requests through
it the way ``Scheduler.schedule`` / ``Scheduler.update_from_output`` do, so a
model of the hit-length policy can be compared against vLLM's own answer.

Only vLLM and the standard library are imported (torch comes with vLLM; it is
needed for the ``dtype`` field of the spec dataclasses). No ``VllmConfig``,
model, device or worker is built: the few config fields that the engine-side
helpers read are passed as ``types.SimpleNamespace`` stand-ins.

Layout format (a plain ``dict``; the top-level keys are exactly these)::

    LAYOUT = {
        "name": "qwen3next",
        "dcp": 1,                    # decode context parallel size
        "prefix_match_unit": None,   # CacheConfig.prefix_match_unit
        "groups": [                  # one entry per KV-cache group, in order
            {"kind": "full", "block_size": 1600, "dcp_sharded": True,
             "eagle": False},
            {"kind": "mamba", "block_size": 1600, "eagle": False},
        ],
    }

Group keys:

* ``kind``: ``"full"`` (``FullAttentionSpec``), ``"swa"``
  (``SlidingWindowSpec``, needs ``window``), ``"mamba"`` (``MambaSpec`` in
  ``"align"`` cache mode) or ``"chunked"`` (``ChunkedLocalAttentionSpec``,
  needs ``chunk``).
* ``block_size``: the spec's per-rank block size in tokens.
* ``eagle`` (default False): the group holds a draft layer, i.e.
  ``KVCacheGroupSpec(is_eagle_group=True)`` and (vLLM 0.33) ``is_draft=True``
  on the spec.
  Like vLLM's planner (``get_global_kv_cache_groups``), the flag is only set
  when a drafter is configured (modes ``lookahead`` and ``drop``); in mode
  ``none`` it would have no effect on hits either way.
* ``dcp_sharded`` (default: vLLM's, True for attention, False for Mamba).
* ``mla`` (default False): ``MLAAttentionSpec`` / ``SlidingWindowMLASpec``
  (DeepSeek-V4 style) instead of ``FullAttentionSpec`` / ``SlidingWindowSpec``.
* ``tokens_per_state`` (optional, attention kinds): e.g. 4 or 128 for
  DeepSeek-V4's compressed MLA groups.
* ``head_size`` (optional): only makes otherwise equal specs unequal. vLLM
  merges groups with equal specs into one spec group (coordinator
  ``verify_and_split_kv_cache_groups``), exactly as for a real model.
* ``prefill_checkpoint`` (default False, ``mamba`` only): the spec declares a
  backend-internal prefill checkpoint, as every Mamba-2 layer does
  (:data:`MAMBA2_PREFILL_CHECKPOINT`).

Token diagram of one ``serve`` (``N`` prompt tokens, ``hit`` from the lookup)::

    | <- hit (reused) -> | chunk | chunk | ... | last chunk | d1 | d2 |
    0                   hit                              N   +1   +1
                                 sample at N -^  decode steps -^----^

What is simulated rather than vLLM code: one request at a time, synchronous
steps (no async scheduling, pipeline parallelism, KV connector, preemption or
encoder inputs), decode steps without draft tokens (the sampled token is a
fixed id), no cudagraph padding of one-token prefills to ``1 + k`` rows, and
no ``max_model_len`` clipping of chunks (prompts are assumed to fit).

Construction cost is dominated by the block pool (one Python object per
block); for fast small-layout tests pass a small ``max_model_len`` (or
``num_gpu_blocks``), and reuse a harness across scenarios where the test
allows it.
"""

from __future__ import annotations

import itertools
import types
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import vllm

from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_coordinator import (
    HybridKVCacheCoordinator,
    UnitaryKVCacheCoordinator,
)
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.core.kv_cache_utils import (
    get_request_block_hasher,
    init_none_hash,
    resolve_cache_hit_alignment_tokens,
    resolve_kv_cache_block_sizes,
)
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheSpec,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowMLASpec,
    SlidingWindowSpec,
)
from vllm.v1.request import Request, RequestStatus

# ---------------------------------------------------------------------------------------------------- #
# vLLM version seams: everything the harness (and the differential suites on it) does differently per
# vLLM release lives here, keyed by vllm.__version__ (docs/notes/vllm-0.32-policy.md, section 3.3).
# ---------------------------------------------------------------------------------------------------- #


@dataclass(frozen=True)
class VersionSeams:
    """What differs between the vLLM releases the harness drives.

    Attributes:
        version: ``vllm.__version__``.
        policy: the kvhit policy whose hits and write side this release's classes are compared with.
        modes: the harness modes the release has. vLLM 0.32 has no lookahead block hashes (D1): every
            EAGLE-family drafter with prefix caching drops, so ``lookahead`` is not one of its modes.
        is_draft: the KV-cache specs have ``is_draft`` (vLLM 0.33 ``AttentionSpec.is_draft``, read by its
            planner, D4); 0.32 flags draft groups only through ``KVCacheGroupSpec.is_eagle_group``.
        hash_lookahead: ``KVCacheManager`` and ``get_request_block_hasher`` take
            ``num_hash_lookahead_tokens`` (vLLM 0.33; 0.32 ``get_request_block_hasher(hash_block_size,
            caching_hash_fn)`` and no such manager parameter, D1).
        drop_set: the coordinator attribute holding the EAGLE groups that drop: vLLM 0.33
            ``drop_eagle_group_ids`` (empty under lookahead hashes), 0.32 ``eagle_group_ids`` (D2).

    The 0.32 ``get_mamba_prefill_checkpoint_position`` takes 3 parameters, 0.33's 4: the harness never calls
    it, only the scheduler's own ``_mamba_block_aligned_split`` (run unbound on a stand-in) does, each
    release's with its own; the stand-in's ``num_hash_lookahead_tokens`` is read by 0.33 only.
    """

    version: str
    policy: str
    modes: tuple
    is_draft: bool
    hash_lookahead: bool
    drop_set: str


SUPPORTED = {
    "0.33.0": VersionSeams("0.33.0", policy="vllm_0_33", modes=("none", "lookahead", "drop"), is_draft=True,
                           hash_lookahead=True, drop_set="drop_eagle_group_ids"),
    "0.32.0": VersionSeams("0.32.0", policy="vllm_0_32", modes=("none", "drop"), is_draft=False,
                           hash_lookahead=False, drop_set="eagle_group_ids"),
}
if vllm.__version__ not in SUPPORTED:
    raise ImportError(f"the conformance harness drives vLLM {' or '.join(SUPPORTED)}, not {vllm.__version__}")
SEAMS = SUPPORTED[vllm.__version__]
"""The seams of the installed vLLM."""
VLLM_VERSION = SEAMS.version


def spec_draft_kwargs(group: dict) -> dict[str, Any]:
    """The spec keyword marking a draft layer's group, where the release has it."""
    return {"is_draft": bool(group.get("eagle", False))} if SEAMS.is_draft else {}


def manager_lookahead_kwargs(num_hash_lookahead_tokens: int) -> dict[str, Any]:
    """``KVCacheManager``'s lookahead-hash keyword, where the release has it."""
    if SEAMS.hash_lookahead:
        return {"num_hash_lookahead_tokens": num_hash_lookahead_tokens}
    assert num_hash_lookahead_tokens == 0, f"vLLM {VLLM_VERSION} has no lookahead block hashes"
    return {}


def request_block_hasher(hash_block_size: int, num_hash_lookahead_tokens: int):
    """vLLM ``get_request_block_hasher`` with sha256, and the lookahead where the release has it."""
    if SEAMS.hash_lookahead:
        return get_request_block_hasher(hash_block_size, sha256, num_hash_lookahead_tokens)
    assert num_hash_lookahead_tokens == 0, f"vLLM {VLLM_VERSION} has no lookahead block hashes"
    return get_request_block_hasher(hash_block_size, sha256)


def drop_eagle_group_ids(coordinator) -> set[int]:
    """The KV-cache group ids whose EAGLE block the coordinator drops."""
    return set(getattr(coordinator, SEAMS.drop_set))


# ---------------------------------------------------------------------------------------------------- #
# End of the version seams.
# ---------------------------------------------------------------------------------------------------- #

MODES = SEAMS.modes
"""Speculative-decoding manager modes of the installed vLLM (policy doc section 1.5)."""

LAYOUT_KEYS = frozenset({"name", "dcp", "prefix_match_unit", "groups"})
GROUP_KINDS = ("full", "swa", "mamba", "chunked")
_GROUP_KEYS = frozenset(
    {
        "kind",
        "block_size",
        "dcp_sharded",
        "eagle",
        "window",
        "chunk",
        "mla",
        "tokens_per_state",
        "head_size",
        "prefill_checkpoint",
    }
)
MAMBA2_PREFILL_CHECKPOINT = {"num_prefill_checkpoint_blocks": 1, "prefill_checkpoint_alignment": 1}
"""What vLLM's ``MambaMixer2.get_kv_cache_spec`` sets on every Mamba-2 layer's ``MambaSpec``: one
backend-internal prefill checkpoint block, at any offset (a Mamba group's ``"prefill_checkpoint": True``)."""


def with_prefill_checkpoints(layout: dict) -> dict:
    """``layout`` with every Mamba group declaring a backend-internal prefill checkpoint, as vLLM's Mamba-2
    layers do."""
    return {**layout, "groups": [{**g, "prefill_checkpoint": True} if g["kind"] == "mamba" else g
                                 for g in layout["groups"]]}

# Token id appended by every simulated sampling step. Prompts used with the
# harness should avoid it if decode blocks must never match a prompt.
DECODE_TOKEN_ID = 0

class SchedulingStalled(RuntimeError):
    """The scheduler's own chunk clipping left a running request 0 tokens to schedule.

    The real ``Scheduler._mamba_block_aligned_split`` and ``_reserve_prefill_lookahead`` disagree: the
    first ends the chunk at a Mamba checkpoint, the second keeps ``num_prefill_lookahead`` tokens away
    from the prompt's end, and nothing else can run. The harness frees the request (as a client abort
    would) before raising, so the block pool stays consistent and a stream can go on.

    Attributes:
        hit, spb: the admission lookup's result (already made when the stall happens).
        chunks: the token counts scheduled before the stall.
        num_computed_tokens: where the request stopped.
    """

    def __init__(self, message, hit, spb, chunks, num_computed_tokens):
        super().__init__(message)
        self.hit = hit
        self.spb = spb
        self.chunks = chunks
        self.num_computed_tokens = num_computed_tokens


_DEFAULT_MAX_MODEL_LEN = 1 << 17
_DEFAULT_MAX_NUM_BATCHED_TOKENS = 8192


def resolve_manager_mode(
    mode: str, num_speculative_tokens: int = 1, multi_module_mtp: bool = False
) -> tuple[bool, int, int]:
    """Map a harness mode to the installed vLLM's ``KVCacheManager`` arguments.

    Mirrors ``VllmConfig.num_prefill_lookahead_tokens``,
    ``VllmConfig.num_hash_lookahead_tokens`` and the scheduler's
    ``use_eagle_block_drop`` (forced False when lookahead hashes are on):

    * ``none``: no eagle-family drafter.
    * ``lookahead``: eagle/MTP with prefix caching and no KV connector
      (vLLM's default): lookahead block hashes, no drop.
    * ``drop``: the same drafters with a KV connector or
      ``disable_lookahead_block_hashes``: the EAGLE last-block drop.

    Args:
        mode: One of ``MODES``.
        num_speculative_tokens: ``SpeculativeConfig.num_speculative_tokens``.
        multi_module_mtp: Whether the drafter is multi-module MTP.

    Returns:
        ``(use_eagle, num_hash_lookahead_tokens, num_prefill_lookahead)``.
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES} on vLLM {VLLM_VERSION}, got {mode!r}")
    if mode == "none":
        return False, 0, 0
    multi = multi_module_mtp and num_speculative_tokens > 1
    lp = num_speculative_tokens if multi else 1
    if mode == "lookahead":
        return False, lp, lp
    return True, 0, lp


def _validate_layout(layout: dict) -> None:
    if not LAYOUT_KEYS <= set(layout) <= LAYOUT_KEYS | {"aux_cap_group"}:
        raise ValueError(
            f"layout keys must be {sorted(LAYOUT_KEYS)} (and 'aux_cap_group'), got {sorted(layout)}"
        )
    if not layout["groups"]:
        raise ValueError("layout has no groups")
    for i, group in enumerate(layout["groups"]):
        unknown = set(group) - _GROUP_KEYS
        if unknown:
            raise ValueError(f"group {i}: unknown keys {sorted(unknown)}")
        kind = group.get("kind")
        if kind not in GROUP_KINDS:
            raise ValueError(f"group {i}: kind must be one of {GROUP_KINDS}")
        if kind == "swa" and "window" not in group:
            raise ValueError(f"group {i}: kind 'swa' needs 'window'")
        if kind == "chunked" and "chunk" not in group:
            raise ValueError(f"group {i}: kind 'chunked' needs 'chunk'")
        if group.get("mla") and kind not in ("full", "swa"):
            raise ValueError(f"group {i}: 'mla' applies to 'full' and 'swa' only")
        if group.get("prefill_checkpoint") and kind != "mamba":
            raise ValueError(f"group {i}: 'prefill_checkpoint' applies to 'mamba' only")


def build_kv_cache_spec(
    group: dict, *, extra_retained_tokens: int = 0, num_speculative_blocks: int = 0
) -> KVCacheSpec:
    """Build the vLLM spec for one layout group.

    Args:
        group: One entry of ``layout["groups"]``.
        extra_retained_tokens: ``SlidingWindowSpec.extra_retained_tokens``;
            the planner sets ``max(0, num_prefill_lookahead - 1)``
            (``get_global_kv_cache_groups``).
        num_speculative_blocks: ``MambaSpec.num_speculative_blocks``; the
            Mamba layer sets ``num_speculative_tokens``
            (``MambaBase.get_kv_cache_spec``).

    Returns:
        The spec (a frozen dataclass).
    """
    kind = group["kind"]
    block_size = group["block_size"]
    kw: dict[str, Any] = spec_draft_kwargs(group)
    if "dcp_sharded" in group:
        kw["dcp_sharded"] = bool(group["dcp_sharded"])
    if kind == "mamba":
        return MambaSpec(
            block_size,
            ((4,),),
            (torch.float32,),
            mamba_cache_mode="align",
            num_speculative_blocks=num_speculative_blocks,
            **(MAMBA2_PREFILL_CHECKPOINT if group.get("prefill_checkpoint") else {}),
            **kw,
        )
    kw.update(
        block_size=block_size,
        num_kv_heads=1,
        head_size=group.get("head_size", 8),
        dtype=torch.float16,
    )
    if "tokens_per_state" in group:
        kw["tokens_per_state"] = group["tokens_per_state"]
    if kind == "full":
        if group.get("mla"):
            return MLAAttentionSpec(max_tp_shards=1, model_version="deepseek_v4", **kw)
        return FullAttentionSpec(**kw)
    if kind == "swa":
        kw.update(
            sliding_window=group["window"], extra_retained_tokens=extra_retained_tokens
        )
        if group.get("mla"):
            return SlidingWindowMLASpec(max_tp_shards=1, **kw)
        return SlidingWindowSpec(**kw)
    return ChunkedLocalAttentionSpec(attention_chunk_size=group["chunk"], **kw)


def _stand_in_vllm_config(
    kv_cache_config: KVCacheConfig, dcp: int, prefix_match_unit: int | None
) -> types.SimpleNamespace:
    """The fields of ``VllmConfig`` that the engine-side size helpers read.

    ``cache_config.block_size`` is what ``EngineCore._initialize_kv_caches``
    sets: the minimum spec block size over prefix-cacheable groups.
    """
    groups = kv_cache_config.kv_cache_groups
    participating = [
        g.kv_cache_spec.block_size for g in groups if g.kv_cache_spec.prefix_cacheable
    ] or [g.kv_cache_spec.block_size for g in groups]
    return types.SimpleNamespace(
        cache_config=types.SimpleNamespace(
            block_size=min(participating),
            prefix_match_unit=prefix_match_unit,
            enable_prefix_caching=True,
            mamba_cache_mode="align" if kv_cache_config.has_mamba_layers else "none",
        ),
        parallel_config=types.SimpleNamespace(decode_context_parallel_size=dcp),
        kv_transfer_config=None,
    )


class VllmHarness:
    """A real vLLM ``KVCacheManager`` plus the scheduler's chunking rules.

    Args:
        layout: Layout description (see the module docstring).
        mode: ``"none"``, ``"lookahead"`` or ``"drop"``
            (see ``resolve_manager_mode``).
        num_speculative_tokens: Draft tokens per step (``k``). Sizes the
            decode lookahead slots and Mamba speculative blocks; with
            ``multi_module_mtp`` it is also the prefill lookahead.
        multi_module_mtp: Whether the drafter is multi-module MTP.
        retention_interval: ``KVCacheConfig.prefix_cache_retention_interval``
            (vLLM's default is 0; None means dense).
        num_gpu_blocks: Block-pool size including the null block. Default:
            room for two requests of ``max_model_len`` tokens in every group.
        max_model_len: The model length the manager is built with.
        max_num_batched_tokens: The scheduler's per-step token budget.

    Raises:
        ValueError: The layout or mode is malformed, or vLLM rejects the
            configuration while building specs, resolving sizes or
            constructing the manager (e.g. the Hybrid DCP ``AssertionError``);
            the message is vLLM's and the original exception is chained as
            ``__cause__``.
    """

    def __init__(
        self,
        layout: dict,
        mode: str,
        num_speculative_tokens: int = 1,
        multi_module_mtp: bool = False,
        retention_interval: int | None = 0,
        num_gpu_blocks: int | None = None,
        *,
        max_model_len: int = _DEFAULT_MAX_MODEL_LEN,
        max_num_batched_tokens: int = _DEFAULT_MAX_NUM_BATCHED_TOKENS,
    ) -> None:
        _validate_layout(layout)
        self.layout = layout
        self.mode = mode
        self.use_eagle, self.num_hash_lookahead_tokens, self.num_prefill_lookahead = (
            resolve_manager_mode(mode, num_speculative_tokens, multi_module_mtp)
        )
        # VllmConfig.num_speculative_tokens / num_lookahead_tokens: 0 without
        # a drafter, else k.
        self.num_spec_tokens = 0 if mode == "none" else num_speculative_tokens
        self.max_model_len = max_model_len
        dcp = layout["dcp"]
        groups = layout["groups"]
        if num_gpu_blocks is None:
            num_gpu_blocks = 64 + 2 * sum(
                -(-max_model_len // g["block_size"]) for g in groups
            )

        init_none_hash(sha256)
        try:
            specs = [
                build_kv_cache_spec(
                    g,
                    extra_retained_tokens=max(0, self.num_prefill_lookahead - 1),
                    num_speculative_blocks=self.num_spec_tokens,
                )
                for g in groups
            ]
            self.kv_cache_config = KVCacheConfig(
                num_blocks=num_gpu_blocks,
                kv_cache_tensors=[],
                kv_cache_groups=[
                    KVCacheGroupSpec(
                        layer_names=[f"layer.{i}"],
                        kv_cache_spec=spec,
                        # The planner flags draft groups only when a drafter
                        # is configured (use_eagle_block_drop()).
                        is_eagle_group=bool(g.get("eagle")) and mode != "none",
                    )
                    for i, (g, spec) in enumerate(zip(groups, specs))
                ],
                prefix_cache_retention_interval=retention_interval,
            )
            vcfg = _stand_in_vllm_config(
                self.kv_cache_config, dcp, layout["prefix_match_unit"]
            )
            self.cache_config = vcfg.cache_config
            S, h = resolve_kv_cache_block_sizes(self.kv_cache_config, vcfg)
            a_resolved = resolve_cache_hit_alignment_tokens(
                self.kv_cache_config, vcfg, S, h
            )
            self.manager = KVCacheManager(
                kv_cache_config=self.kv_cache_config,
                max_model_len=max_model_len,
                scheduler_block_size=S,
                hash_block_size=h,
                enable_caching=True,
                use_eagle=self.use_eagle,
                num_prefill_lookahead=self.num_prefill_lookahead,
                dcp_world_size=dcp,
                pcp_world_size=1,
                **manager_lookahead_kwargs(self.num_hash_lookahead_tokens),
            )
        except Exception as e:
            # Every rejection (vLLM asserts, raises ValueError) becomes a
            # ValueError carrying vLLM's message; the original is __cause__.
            raise ValueError(str(e) or repr(e)) from e

        coordinator = self.manager.coordinator
        # Auxiliary outputs (layout["aux_cap_group"], vLLM 0.33): vLLM's own scheduler-side connector caps
        # every lookup (max_cache_hit). It is never told a request finished, so its store holds nothing and
        # its cap counts the pool's blocks alone, as the spec's does (Layout.aux_cap_group).
        self.aux = None
        if layout.get("aux_cap_group") is not None:
            from vllm.distributed.aux_output_connector.connector import AuxOutputSchedulerConnector

            self.aux = AuxOutputSchedulerConnector(self.manager)
            if self.aux._group_id != layout["aux_cap_group"]:
                raise ValueError(f"vLLM's auxiliary outputs cap at KV-cache group {self.aux._group_id}, the "
                                 f"layout says {layout['aux_cap_group']}")
        if isinstance(coordinator, HybridKVCacheCoordinator):
            a_used = coordinator._cache_hit_alignment_tokens
        elif isinstance(coordinator, UnitaryKVCacheCoordinator):
            a_used = coordinator.single_type_managers[0].block_size
        else:  # pragma: no cover - caching is always enabled here
            a_used = S
        self._sizes = {
            "S": S,
            "h": h,
            "A": a_used,
            "A_resolved": a_resolved,
            "fine": bool(coordinator.enable_partial_hash_hits),
            "coordinator": type(coordinator).__name__,
            "effective_blocks": [
                m.block_size for m in coordinator.single_type_managers
            ],
        }
        self.block_hasher = request_block_hasher(h, self.num_hash_lookahead_tokens)
        self._sched = self._make_scheduler_stand_in(S, h, max_num_batched_tokens)
        self._request_ids = itertools.count()
        self._last_served: Request | None = None

    # ------------------------------------------------------------------ #
    # Introspection
    # ------------------------------------------------------------------ #

    @property
    def sizes(self) -> dict:
        """Block sizes and alignment as vLLM resolved them.

        Keys: ``S`` (scheduler_block_size), ``h`` (hash_block_size), ``A``
        (the alignment the coordinator uses: Hybrid
        ``_cache_hit_alignment_tokens``, Unitary ``manager.block_size``),
        ``A_resolved`` (``resolve_cache_hit_alignment_tokens``, what the
        engine stores in ``KVCacheConfig``), ``fine``
        (``coordinator.enable_partial_hash_hits``), ``coordinator`` (class
        name) and ``effective_blocks`` (per group ``manager.block_size``,
        DCP-scaled when sharded).
        """
        return dict(self._sizes)

    # ------------------------------------------------------------------ #
    # Requests
    # ------------------------------------------------------------------ #

    def _new_request(self, tokens: Sequence[int], max_tokens: int = 1) -> Request:
        return Request(
            f"req-{next(self._request_ids)}",
            list(tokens),
            SamplingParams(max_tokens=max_tokens),
            None,
            block_hasher=self.block_hasher,
        )

    def probe(self, tokens: Sequence[int]) -> dict:
        """Look a prompt up without admitting it.

        Calls ``KVCacheManager.get_computed_blocks`` only; no block is
        touched, allocated or freed. Exceptions from vLLM propagate.

        Args:
            tokens: Prompt token ids.

        Returns:
            ``{"hit": num_new_computed_tokens, "spb": shared_prefix_boundary}``.
        """
        _, hit, spb = self._computed_blocks(self._new_request(tokens))
        return {"hit": hit, "spb": spb}

    def _computed_blocks(self, req: Request):
        """``KVCacheManager.get_computed_blocks``, capped by the auxiliary outputs' connector if any (as
        the scheduler does)."""
        if self.aux is None:
            return self.manager.get_computed_blocks(req)
        return self.manager.get_computed_blocks(req, self.aux.max_cache_hit(req))

    def serve(self, tokens: Sequence[int], decode_steps: int = 2) -> dict:
        """Run one request through admission, chunked prefill, decode and free.

        Admission follows the scheduler's waiting-queue path:
        ``get_computed_blocks``, ``shared_prefix_boundary``, the chunk clipped
        by ``Scheduler._mamba_block_aligned_split`` (layouts with Mamba) and
        ``Scheduler._reserve_prefill_lookahead`` (both the real functions,
        unbound, on a stand-in ``self``), then ``allocate_slots`` (which
        caches at schedule time). Later chunks follow the running-queue path.
        Each step that completes the known tokens samples ``DECODE_TOKEN_ID``;
        with a drafter the step then calls ``cache_blocks`` as
        ``update_from_output`` does. After ``decode_steps`` one-token decode
        steps the request is freed.

        Args:
            tokens: Prompt token ids.
            decode_steps: One-token decode steps after the prefill's sample.

        Returns:
            ``{"hit", "spb", "chunks"}``: the admission hit, the shared-prefix
            boundary set on the request, and the scheduled token counts per
            step (prefill chunks, then decode steps).

        Raises:
            SchedulingStalled: The scheduler's chunk clipping left a running
                request 0 tokens (the request is freed first).
            RuntimeError: A step could not be scheduled (pool too small, or
                an admission chunk clipped to 0 tokens).
        """
        mgr = self.manager
        req = self._new_request(tokens, max_tokens=decode_steps + 1)
        chunks: list[int] = []

        # Admission step (scheduler.py, waiting queue).
        mgr.new_step_starts()
        blocks, hit, spb = self._computed_blocks(req)
        req.shared_prefix_boundary = spb
        num_new = min(req.num_tokens - hit, self._sched.max_num_scheduled_tokens)
        if self._sched.need_mamba_block_aligned_split:
            num_new = Scheduler._mamba_block_aligned_split(
                self._sched, req, num_new, hit, 0
            )
        num_new = Scheduler._reserve_prefill_lookahead(self._sched, req, hit, num_new)
        if num_new == 0:
            raise RuntimeError(f"admission of {req.request_id} scheduled 0 tokens")
        out = mgr.allocate_slots(
            req,
            num_new,
            num_new_computed_tokens=hit,
            new_computed_blocks=blocks,
            num_lookahead_tokens=self.num_spec_tokens,
            has_scheduled_reqs=False,
        )
        if out is None:
            raise RuntimeError(f"allocate_slots refused admission of {req.request_id}")
        req.status = RequestStatus.RUNNING
        req.num_computed_tokens = hit + num_new
        chunks.append(num_new)
        sampled = self._finish_step(req)

        # Running steps: the rest of the prefill, then decode.
        while sampled <= decode_steps:
            mgr.new_step_starts()
            num_new = req.num_tokens - req.num_computed_tokens
            num_new = min(num_new, self._sched.max_num_scheduled_tokens)
            if self._sched.need_mamba_block_aligned_split:
                num_new = Scheduler._mamba_block_aligned_split(
                    self._sched, req, num_new
                )
            num_new = Scheduler._reserve_prefill_lookahead(
                self._sched, req, req.num_computed_tokens, num_new
            )
            if num_new == 0:
                mgr.free(req)
                mgr.new_step_starts()
                raise SchedulingStalled(
                    f"{req.request_id} scheduled 0 tokens at {req.num_computed_tokens} of "
                    f"{req.num_tokens}",
                    hit,
                    spb,
                    chunks,
                    req.num_computed_tokens,
                )
            out = mgr.allocate_slots(
                req, num_new, num_lookahead_tokens=self.num_spec_tokens
            )
            if out is None:
                raise RuntimeError(f"allocate_slots refused {req.request_id}")
            req.num_computed_tokens += num_new
            chunks.append(num_new)
            sampled += self._finish_step(req)

        mgr.free(req)
        mgr.new_step_starts()
        self._last_served = req
        return {"hit": hit, "spb": spb, "chunks": chunks}

    def _finish_step(self, req: Request) -> int:
        """``update_from_output`` for one executed step; returns tokens sampled."""
        if req.num_computed_tokens < req.num_tokens:
            return 0  # A partial prefill chunk samples nothing.
        req.append_output_token_ids(DECODE_TOKEN_ID)
        if self.num_spec_tokens > 0:
            # Spec decode re-caches the verified tokens (scheduler.py:2404-2415).
            self.manager.cache_blocks(req, req.num_computed_tokens)
        return 1

    # ------------------------------------------------------------------ #
    # Cache state
    # ------------------------------------------------------------------ #

    def retained(self, tokens: Sequence[int] | None = None) -> list[list[int]]:
        """Which hash boundaries of a token sequence are in the block pool.

        Args:
            tokens: The sequence whose block hashes are checked. Default: all
                tokens (prompt and sampled) of the last served request.

        Returns:
            Per KV-cache group (layout order), the sorted token boundaries
            ``x = (j + 1) * h`` such that the hash ``block_hashes[j]`` tagged
            with that group id is in the pool (full or partial entry), i.e.
            what a later lookup can find for that group.
        """
        groups = range(len(self.layout["groups"]))
        if tokens is None:
            if self._last_served is None:
                return [[] for _ in groups]
            hashes = self._last_served.block_hashes
        else:
            hashes = self._new_request(tokens).block_hashes
        h = self._sizes["h"]
        pool = self.manager.block_pool
        return [
            [
                (j + 1) * h
                for j, block_hash in enumerate(hashes)
                if pool.get_cached_block(block_hash, [g]) is not None
            ]
            for g in groups
        ]

    def evict(self, n_blocks: int) -> None:
        """Evict the ``n_blocks`` least recently used cached free blocks.

        Uses the pool's allocation path: takes blocks from the head of the
        free queue with ``BlockPool.get_new_blocks`` (which drops their
        hashes) up to and including the ``n_blocks``-th cached one, then
        returns them with ``free_blocks``, as an unrelated request that
        allocated and freed that many blocks would. Fewer are evicted if
        fewer cached free blocks exist.

        Args:
            n_blocks: How many cached blocks to evict.
        """
        if n_blocks <= 0:
            return
        pool = self.manager.block_pool
        queue = pool.free_block_queue
        tail = queue.fake_free_list_tail
        block = queue.fake_free_list_head.next_free_block
        depth = found = 0
        while block is not None and block is not tail and found < n_blocks:
            depth += 1
            if (
                block.block_hash is not None
                or block.block_id in pool.cached_block_hashes_by_block
            ):
                found += 1
            block = block.next_free_block
        if found == 0:
            return
        pool.free_blocks(pool.get_new_blocks(depth))

    def _make_scheduler_stand_in(
        self, S: int, h: int, max_num_batched_tokens: int
    ) -> types.SimpleNamespace:
        """The ``Scheduler`` attributes its chunk-clipping methods read.

        Mirrors ``Scheduler.__init__`` (scheduler.py:295-464).
        """
        coordinator = self.manager.coordinator
        mamba_specs = [
            g.kv_cache_spec
            for g in self.kv_cache_config.kv_cache_groups
            if isinstance(g.kv_cache_spec, MambaSpec)
        ]
        need_split = bool(mamba_specs) and self.cache_config.mamba_cache_mode == "align"
        partial = need_split and h < S and coordinator.enable_partial_hash_hits
        return types.SimpleNamespace(
            cache_config=self.cache_config,
            kv_cache_manager=self.manager,
            block_size=S,
            hash_block_size=h,
            use_eagle_block_drop=self.use_eagle,
            num_hash_lookahead_tokens=self.num_hash_lookahead_tokens,
            num_prefill_lookahead=self.num_prefill_lookahead,
            need_mamba_block_aligned_split=need_split,
            mamba_prefill_checkpoint_alignment=(
                mamba_specs[0].prefill_checkpoint_alignment if mamba_specs else None
            ),
            mamba_has_prefill_checkpoint_blocks=bool(mamba_specs)
            and all(s.num_prefill_checkpoint_blocks > 0 for s in mamba_specs),
            mamba_partial_cache_hit=partial,
            mamba_shared_prefix_checkpoint=partial
            and self.manager.mamba_shared_prefix_checkpoint,
            max_num_scheduled_tokens=max_num_batched_tokens,
            # Single request: the scheduler zeroes the threshold (one eligible
            # request has nobody to starve).
            scheduler_config=types.SimpleNamespace(long_prefill_token_threshold=0),
        )
