"""Hypothesis strategies for conformance scenarios: request streams over a layout.

Prompt lengths are drawn around the sizes that matter to the policy (hash unit, alignment, scheduler block,
each group's block and window, each +- a few tokens) and uniformly; streams mix first requests, repeats,
longer siblings, diverging prompts that share a prefix, truncations, next chat turns, probes and evictions.
"""

from hypothesis import strategies as st

from kvhit.refimpl import Group, Layout, Speculation, derive_sizes

from .differential import Op, Scenario
from .vllm_harness import MODES

SPECULATIONS = [Speculation("none")] + [
    Speculation(mode, k, multi) for mode in ("lookahead", "drop") if mode in MODES for k in (1, 2, 3)
    for multi in (False, True) if not (multi and k == 1)]
"""none; lookahead (where the installed vLLM has it) and drop with 1..3 speculative tokens, single- and
multi-module MTP (Lp = k)."""

MAX_PROMPT = 24_000
"""Prompts stay below this many tokens (DeepSeek-V4-report layouts, S = 16384, get their own cap)."""


def _units(layout: Layout, speculation: Speculation):
    sizes = derive_sizes(layout, speculation)
    units = {sizes.hash_block, sizes.alignment, sizes.scheduler_block, *sizes.effective_blocks}
    units |= {g.window for g in layout.groups if g.window} | {g.chunk for g in layout.groups if g.chunk}
    return sorted(units), sizes


def max_prompt(layout: Layout, speculation: Speculation) -> int:
    units, sizes = _units(layout, speculation)
    return min(max(4 * sizes.scheduler_block, 3 * max(units)) + 8, max(MAX_PROMPT, 2 * sizes.scheduler_block + 64))


@st.composite
def lengths(draw, units, top):
    if draw(st.booleans()):
        unit = draw(st.sampled_from(units))
        k = draw(st.integers(1, max(1, top // unit)))
        n = k * unit + draw(st.integers(-2, 2))
    else:
        n = draw(st.integers(1, top))
    return max(1, min(n, top))


@st.composite
def streams(draw, layout: Layout, speculation: Speculation):
    units, sizes = _units(layout, speculation)
    top = max_prompt(layout, speculation)
    ops = [Op("serve", "new", n=draw(lengths(units, top)))]
    prompts = 1
    for _ in range(draw(st.integers(1, 5))):
        kind = draw(st.sampled_from(["serve", "serve", "serve", "probe", "probe", "evict"]))
        if kind == "evict":
            ops.append(Op("evict", n=draw(st.integers(1, 48))))
            continue
        source = draw(st.sampled_from(["repeat", "repeat", "extend", "diverge", "truncate", "continue", "new"]))
        of = draw(st.integers(0, prompts - 1))
        n = draw(lengths(units, top)) if source in ("new", "extend", "diverge", "continue") else 0
        if source in ("extend", "continue"):
            n = draw(st.sampled_from([n, min(n, sizes.hash_block + 1), draw(st.integers(1, 3))]))
        cut = draw(lengths(units, top)) if source in ("diverge", "truncate") else 0
        ops.append(Op(kind, source, of, n, cut))
        prompts += 1
    return tuple(ops)


def retention_intervals(layout: Layout, sizes):
    """None (dense), 0 (vLLM's default) and, when the layout has a sliding-window or Mamba group, positive
    multiples of the scheduler block (vLLM rejects anything else)."""
    options = [st.just(None), st.just(0)]
    if any(g.kind.value in ("swa", "mamba") for g in layout.groups):
        options.append(st.integers(1, 4).map(lambda k: k * sizes.scheduler_block))
    return st.one_of(options)


def configurable(layout: Layout, speculation: Speculation) -> bool:
    """Whether vLLM's config can put ``speculation`` in front of ``layout``'s managers: with EAGLE or MTP it
    turns its hybrid KV-cache manager off for chunked local attention, so no coordinator of a chunked-local
    group beside others ever sees those (the spec refuses them, and vLLM's classes, which never assert it,
    are not asked)."""
    hybrid_chunked = len(layout.groups) > 1 and any(g.kind == "chunked" for g in layout.groups)
    return not (hybrid_chunked and speculation.mode.value != "none")


def has_mode(layout: Layout, mode: str) -> bool:
    """Whether the spec accepts some speculative setting of ``mode`` on ``layout`` (chunked local
    attention has no drop mode: vLLM asserts it away; beside other groups it has only ``none``)."""
    for speculation in SPECULATIONS:
        if speculation.mode.value == mode and configurable(layout, speculation):
            try:
                derive_sizes(layout, speculation)
                return True
            except ValueError:
                pass
    return False


@st.composite
def scenarios(draw, layout: Layout, speculations=SPECULATIONS):
    """A scenario over ``layout``: a speculative setting vLLM's config can build (:func:`configurable`),
    a retention interval, a pool size and a request stream."""
    speculation = draw(st.sampled_from([s for s in speculations if configurable(layout, s)]))
    try:
        sizes = derive_sizes(layout, speculation)
    except ValueError:
        # The spec rejects it: the scenario only checks that vLLM rejects it too.
        return Scenario(layout, speculation, 0, False, (Op("serve", "new", n=1),))
    return Scenario(layout, speculation, draw(retention_intervals(layout, sizes)), draw(st.booleans()),
                    draw(streams(layout, speculation)), seed=draw(st.integers(0, 2**32 - 1)))


@st.composite
def random_layouts(draw):
    """A random layout the spec accepts: one to three groups of full attention, sliding window and Mamba
    (and a chunked-local group, alone or beside full attention), block sizes 16..256, EAGLE flags,
    replicated groups, DCP 1/2/4 and ``prefix_match_unit``. Layouts the spec rejects are drawn too (a tenth
    of the time): vLLM must reject them as well."""
    if draw(st.integers(0, 9)) == 0:
        block = draw(st.sampled_from([16, 32]))
        chunked = Group("chunked", block, chunk=block * draw(st.sampled_from([1, 2, 4])))
        if draw(st.booleans()):
            return Layout((chunked,), name="random")
        # beside full attention (Llama 4), of the same block or one dividing it
        full = [Group("full", draw(st.sampled_from([block, block // 2]))) for _ in range(draw(st.integers(1, 2)))]
        return Layout(tuple(full) + (chunked,), name="random")
    groups = []
    for _ in range(draw(st.integers(1, 3))):
        kind = draw(st.sampled_from(["full", "full", "swa", "mamba"]))
        block = draw(st.sampled_from([16, 32, 64]))
        if kind == "swa":
            groups.append(Group(kind, block, window=draw(st.sampled_from([17, 32, 48, 64, 100, 128, 512])),
                                eagle=draw(st.booleans()), dcp_sharded=draw(st.booleans())))
        elif kind == "mamba":
            groups.append(Group(kind, block * draw(st.sampled_from([1, 2, 4]))))
        else:
            groups.append(Group(kind, block, eagle=draw(st.booleans()), dcp_sharded=draw(st.booleans())))
    dcp = draw(st.sampled_from([1, 1, 2, 4]))
    pmu = draw(st.sampled_from([None, None, None, 16, 32]))
    try:
        return Layout(tuple(groups), dcp=dcp, prefix_match_unit=pmu, name="random")
    except ValueError:
        return Layout(tuple(groups), prefix_match_unit=pmu, name="random")


@st.composite
def write_scenarios(draw, layout: Layout, speculations=SPECULATIONS):
    """A write-side scenario over ``layout`` (:class:`.write_side.WriteScenario`): a first request of a
    length drawn around the policy's sizes, then one to four resends and longer siblings (one token longer,
    a few tokens, a block or two, or a far sibling), and a third of the time a prompt diverging from it and
    one sharing the junction that records. Only settings whose write side the spec models."""
    from hypothesis import assume

    from .write_side import WriteScenario, in_scope

    speculation = draw(st.sampled_from([s for s in speculations if configurable(layout, s)]))
    try:
        units, sizes = _units(layout, speculation)
    except ValueError:
        assume(False)
    retention = draw(retention_intervals(layout, sizes))
    assume(in_scope(layout, speculation, retention))
    top = max_prompt(layout, speculation)
    n = draw(lengths(units, top))
    S = sizes.scheduler_block
    ops = []
    for _ in range(draw(st.integers(1, 4))):
        if draw(st.booleans()):
            ops.append(("resend",))
        else:
            unit = draw(st.sampled_from(units))
            extra = draw(st.sampled_from([1, 2, 3, unit, unit + 1, S, 2 * S + sizes.hash_lookahead + 1]))
            ops.append(("sibling", extra))
    if draw(st.integers(0, 2)) == 0:
        # a prompt diverging from this one, then one sharing the junction it records (D3)
        cut = draw(st.sampled_from([n - 1, n // 2, draw(lengths(units, max(1, n - 1)))]))
        ops.append(("diverge", cut, draw(lengths(units, top)), draw(st.sampled_from([1, 2, S, 300]))))
    return WriteScenario(layout, speculation, retention, n, tuple(ops), seed=draw(st.integers(0, 2**32 - 1)))
