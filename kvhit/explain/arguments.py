"""``kvhit explain``'s arguments: the policies it traces, the speculative setting and the dense cache's extents,
from the values the command line gives."""

from kvhit.refimpl import Speculation

POLICIES = ("reference", "vllm_0_33", "historical")
CACHES = ("written", "dense")


def speculation(mode="none", num_speculative_tokens=None, multi_module_mtp=False):
    """A refimpl ``Speculation`` from CLI values (``num_speculative_tokens`` defaults to 1 when speculating)."""
    if mode == "none":
        return Speculation("none", num_speculative_tokens or 0, multi_module_mtp)
    return Speculation(mode, 1 if num_speculative_tokens is None else num_speculative_tokens, multi_module_mtp)


def cache_extents(cached, n_tokens, num_groups):
    """Per spec group, the extent of the dense cache: ``cached`` is None (the whole prompt), one int for
    every group, or one int per spec group."""
    if cached is None:
        return (n_tokens,) * num_groups
    if isinstance(cached, int):
        cached = (cached,)
    cached = tuple(cached)
    for c in cached:
        if isinstance(c, bool) or not isinstance(c, int) or c < 0:
            raise ValueError(f"a cached length must be a non-negative integer, got {c!r}")
    if len(cached) == 1:
        return cached * num_groups
    if len(cached) != num_groups:
        raise ValueError(f"--cached gives {len(cached)} lengths; the layout has {num_groups} spec groups "
                         f"(give one length for all, or one per spec group)")
    return cached
