"""The cache state a lookup reads, as an oracle over token boundaries.

A spec group ``k`` "has" boundary ``x`` when the block hash ending at token ``x`` is cached for every
KV-cache group of the spec group (vLLM: ``BlockPool.get_cached_block``). A block of ``u`` tokens with index
``j`` is cached when boundary ``(j + 1) * u`` is. The Z3 lowering gives the same two queries a symbolic
meaning (:class:`kvhit.spec.lower_z3.SymbolicCache`); here they are plain loops over the oracle.
"""


class CacheState:
    """Which boundaries each spec group can serve.

    Args:
        has: ``has(k, x)`` is True when spec group ``k`` holds the hash of the block ending at token ``x``.
    """

    def __init__(self, has):
        self.has = has
        self.max_query = 0

    def _has(self, k, x):
        if x > self.max_query:
            self.max_query = x
        return self.has(k, x)

    def window(self, k, x, unit, before, after):
        """Whether blocks ``[max(0, x // unit - before), x // unit + after)`` of ``unit`` tokens are all
        cached in spec group ``k``: the context a window ending at ``x`` needs, plus ``after`` blocks past
        it (the EAGLE peek)."""
        i = x // unit
        for j in range(max(0, i - before), i + after):
            if not self._has(k, (j + 1) * unit):
                return False
        return True

    def run_from(self, k, start, unit, limit):
        """How many consecutive ``unit`` blocks from block ``start`` are cached, stopping at block
        ``limit``."""
        n = 0
        while start + n < limit and self._has(k, (start + n + 1) * unit):
            n += 1
        return n

    @classmethod
    def from_sets(cls, boundaries):
        """A cache from one set of cached boundaries per spec group."""
        sets = [frozenset(s) for s in boundaries]
        return cls(lambda k, x: x in sets[k])

    @classmethod
    def up_to(cls, extents):
        """A dense cache: spec group ``k`` holds every boundary up to ``extents[k]`` tokens."""
        ext = list(extents)
        return cls(lambda k, x: 0 < x <= ext[k])
