"""A dense cache state that answers the refimpl's two queries in constant time.

``refimpl.CacheState.up_to(extents)`` answers ``run_from`` and ``window`` by asking ``has`` once per block,
which costs a loop over the prompt's blocks (11,560 blocks of 4 tokens for DeepSeek-V4's compressor state at
46,240 tokens). :class:`DenseCache` is the same state (spec group ``k`` holds every boundary up to
``extents[k]``) with both queries in closed form, and it reports the same ``max_query`` (the highest boundary
the loop would have asked about), so ``reach`` accounting is unchanged. It is a cache state, not policy: the
hit is still computed by the refimpl's own functions. ``tests/tools/test_dense_cache.py`` checks it against
``CacheState.up_to`` query by query and hit by hit.
"""

from kvhit.refimpl import CacheState


class DenseCache(CacheState):
    """Spec group ``k`` holds every block boundary ``x`` with ``0 < x <= extents[k]``."""

    def __init__(self, extents):
        self.extents = tuple(extents)
        ext = self.extents
        super().__init__(lambda k, x: 0 < x <= ext[k])

    def _seen(self, x):
        if x > self.max_query:
            self.max_query = x

    def window(self, k, x, unit, before, after):
        lo, hi = max(0, x // unit - before), x // unit + after
        if lo >= hi:
            return True
        cached = self.extents[k] // unit  # blocks 0 .. cached - 1 are held
        if hi <= cached:
            self._seen(hi * unit)
            return True
        self._seen((max(lo, cached) + 1) * unit)
        return False

    def run_from(self, k, start, unit, limit):
        if start >= limit:
            return 0
        n = max(0, min(limit, self.extents[k] // unit) - start)
        self._seen((start + n + 1) * unit if start + n < limit else (start + n) * unit)
        return n
