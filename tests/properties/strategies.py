"""Hypothesis strategies: layouts the spec accepts, speculative settings, prompts and cache states."""

from hypothesis import strategies as st

from kvhit.refimpl import Group, Layout, Speculation, derive_sizes
from kvhit.spec.catalogue import CATALOGUE

CATALOGUE_NAMES = sorted(CATALOGUE)


@st.composite
def groups(draw):
    kind = draw(st.sampled_from(["full", "swa", "mamba"]))
    block = draw(st.sampled_from([16, 32, 64]))
    if kind == "swa":
        return Group(kind, block, window=draw(st.sampled_from([17, 48, 64, 100, 128])),
                     eagle=draw(st.booleans()))
    if kind == "mamba":
        return Group(kind, block * draw(st.sampled_from([1, 2, 4])))
    return Group(kind, block, eagle=draw(st.booleans()))


@st.composite
def layouts(draw):
    """A random layout the spec accepts (a draw the spec rejects is retried)."""
    gs = tuple(draw(st.lists(groups(), min_size=1, max_size=3)))
    dcp = 1
    if all(g.kind != "swa" for g in gs):
        dcp = draw(st.sampled_from([1, 1, 2, 4]))
    pmu = None
    if any(g.kind == "mamba" for g in gs) and len(gs) > 1:
        pmu = draw(st.sampled_from([None, None, 16, 32]))
    try:
        layout = Layout(gs, dcp=dcp, prefix_match_unit=pmu, name="random")
        derive_sizes(layout, Speculation("drop", 1))
    except ValueError:
        from hypothesis import assume

        assume(False)
    return layout


speculations = st.sampled_from([
    Speculation("none"), Speculation("lookahead", 1), Speculation("lookahead", 2, True),
    Speculation("lookahead", 4, True), Speculation("drop", 1)])


@st.composite
def caches(draw, n_groups, horizon):
    """One set of cached boundaries per spec group, at the hash-unit grid up to ``horizon`` tokens:
    dense prefixes, gaps, sparse states, like eviction leaves them."""
    out = []
    for _ in range(n_groups):
        style = draw(st.sampled_from(["dense", "prefix", "random", "empty"]))
        if style == "dense":
            out.append(set(range(1, horizon + 1)))
        elif style == "prefix":
            cut = draw(st.integers(0, horizon))
            out.append(set(range(1, cut + 1)))
        elif style == "empty":
            out.append(set())
        else:
            out.append(set(draw(st.lists(st.integers(1, horizon), max_size=60))) |
                       set(range(1, draw(st.integers(0, horizon)) + 1)))
    return out
