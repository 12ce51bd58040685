"""What an engine or a tool calls: sizes and hits by policy name."""

from .cache import CacheState
from .domain import Layout, Speculation
from .policy import ALL_POLICIES, hit_tokens
from .sizes import Sizes, derive_sizes


def policy_rules(policy):
    """The rules of a policy given by name (``reference``, ``vllm_0_33``, ``historical``, ...)."""
    if policy not in ALL_POLICIES:
        raise ValueError(f"unknown policy {policy!r}; known: {', '.join(sorted(ALL_POLICIES))}")
    return ALL_POLICIES[policy]


def sizes_for(layout: Layout, speculation: Speculation, policy="reference") -> Sizes:
    """Derived sizes of a layout under a policy."""
    return derive_sizes(layout, speculation, policy_rules(policy).scale_replicated)


def as_cache(cache):
    """A :class:`CacheState` from a cache state, a list of boundary sets, or a list of extents."""
    if isinstance(cache, CacheState):
        return cache
    cache = list(cache)
    if all(isinstance(c, int) for c in cache):
        return CacheState.up_to(cache)
    return CacheState.from_sets(cache)


def hit(layout: Layout, speculation: Speculation, n_tokens: int, cache, policy="reference") -> int:
    """The hit in tokens of a request of ``n_tokens`` prompt tokens.

    Args:
        cache: per spec group, either a :class:`CacheState` oracle, a set of cached boundaries, or an
            extent (every boundary up to it cached).
    """
    if n_tokens < 1:
        raise ValueError(f"a request needs at least one prompt token, got {n_tokens}")
    rules = policy_rules(policy)
    sizes = derive_sizes(layout, speculation, rules.scale_replicated)
    return hit_tokens(as_cache(cache), sizes, n_tokens, rules)[0]
