"""Domain types: what a KV-cache layout and a speculative-decoding setting are.

Layout values are always concrete; only request state (prompt length, cache contents) is symbolic.
Every constructor validates its input and raises ``ValueError`` naming the problem.
"""

from dataclasses import dataclass, field
from enum import Enum


class Kind(str, Enum):
    """The kind of a KV-cache group, i.e. which vLLM manager looks it up.

    vLLM: ``FullAttentionManager`` (also MLA), ``SlidingWindowManager`` (also SWA-MLA),
    ``MambaManager`` (``mamba_cache_mode="align"``), ``ChunkedLocalAttentionManager``.
    """

    FULL = "full"
    SWA = "swa"
    MAMBA = "mamba"
    CHUNKED = "chunked"

    @property
    def prose(self) -> str:
        """The kind as reports and log lines name it: "full attention", "sliding window", "Mamba", "chunked
        local"."""
        return {"full": "full attention", "swa": "sliding window", "mamba": "Mamba",
                "chunked": "chunked local"}[self.value]


class Mode(str, Enum):
    """How EAGLE/MTP speculative decoding protects the last cached block.

    * ``none``: no EAGLE-family drafter.
    * ``lookahead``: each block hash also covers the next ``L`` tokens, so a block is only findable once
      the tokens the draft needs after it exist (vLLM 0.33's default for eagle/mtp without a KV connector).
    * ``drop``: the EAGLE groups recompute one drop unit past the hit (the "eagle drop"; vLLM with a KV
      connector or ``disable_lookahead_block_hashes=True``).
    """

    NONE = "none"
    LOOKAHEAD = "lookahead"
    DROP = "drop"


def _positive_int(value, what):
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{what} must be an integer, got {value!r}")
    if value <= 0:
        raise ValueError(f"{what} must be positive, got {value}")
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
        object.__setattr__(self, "kind", Kind(self.kind))
        _positive_int(self.block_size, f"{self.kind.value} group block_size")
        _positive_int(self.tokens_per_state, "tokens_per_state")
        if self.dcp_sharded is None:
            object.__setattr__(self, "dcp_sharded", self.kind is not Kind.MAMBA)
        if self.kind is Kind.SWA:
            if self.window is None:
                raise ValueError("a sliding-window group needs a window")
            _positive_int(self.window, "sliding window")
            if self.window < 2:
                raise ValueError(f"sliding window {self.window} keeps no context; the spec needs >= 2")
        elif self.window is not None:
            raise ValueError(f"window is only for sliding-window groups, not {self.kind.value}")
        if self.kind is Kind.CHUNKED:
            if self.chunk is None:
                raise ValueError("a chunked-local group needs a chunk size")
            _positive_int(self.chunk, "attention chunk size")
            if self.eagle:
                raise ValueError("an EAGLE group in chunked local attention is not supported "
                                 "(vLLM asserts drop_eagle_block is False for chunked local attention)")
        elif self.chunk is not None:
            raise ValueError(f"chunk is only for chunked-local groups, not {self.kind.value}")
        if self.kind is Kind.MAMBA and self.dcp_sharded:
            raise ValueError("a Mamba group cannot be DCP-sharded (vLLM never shards Mamba state)")


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
    name: str = ""
    aux_cap_group: int | None = None

    def __post_init__(self):
        groups = tuple(g if isinstance(g, Group) else Group(**g) for g in self.groups)
        object.__setattr__(self, "groups", groups)
        if not groups:
            raise ValueError("a layout needs at least one KV-cache group")
        _positive_int(self.dcp, "DCP world size")
        if self.prefix_match_unit is not None:
            _positive_int(self.prefix_match_unit, "prefix_match_unit")
        if self.aux_cap_group is not None:
            g = self.aux_cap_group
            if not isinstance(g, int) or isinstance(g, bool) or not 0 <= g < len(groups):
                raise ValueError(f"aux_cap_group {g!r} is not a KV-cache group of this layout (0..{len(groups) - 1})")
            if groups[g].kind is not Kind.FULL:
                raise ValueError(f"aux_cap_group {g}: a cap by the leading blocks of a {groups[g].kind.value} group "
                                 "is not modelled by the spec (it models the cap of a full-attention group)")
        hybrid = len(groups) > 1
        for i, g in enumerate(groups):
            sharded = g.dcp_sharded and self.dcp > 1
            if sharded and g.kind in (Kind.SWA, Kind.CHUNKED):
                raise ValueError(
                    f"group {i}: DCP {self.dcp} with a sharded {g.kind.value} group is not supported "
                    "(vLLM asserts DCP == 1 in its sliding-window and chunked-local lookups); "
                    "mark the group replicated (dcp_sharded=False) or use DCP 1")
        if hybrid and any(g.kind is Kind.CHUNKED for g in groups):
            # Llama 4's layout: full attention beside chunked local attention (one spec of it: derive_sizes)
            others = sorted({g.kind.value for g in groups if g.kind not in (Kind.FULL, Kind.CHUNKED)})
            if others:
                raise ValueError(f"chunked local attention beside groups of kind {' and '.join(others)} is not "
                                 "modelled by the spec (it models chunked local attention alone or beside "
                                 "full-attention groups)")


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
    label: str = field(default="", compare=False)

    def __post_init__(self):
        object.__setattr__(self, "mode", Mode(self.mode))
        if self.mode is Mode.NONE:
            if self.num_speculative_tokens or self.multi_module_mtp:
                raise ValueError("num_speculative_tokens / multi_module_mtp need an EAGLE-family mode")
        else:
            _positive_int(self.num_speculative_tokens, "num_speculative_tokens")

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
            return "none"
        mtp = f" mtp{self.num_speculative_tokens}" if self.multi_module_mtp else ""
        return f"{self.mode.value} Lp={self.prefill_lookahead}{mtp}"


NO_SPECULATION = Speculation()
