"""A write-side configuration's lookups are its read-side twin's (``kvhit.proofs.runner.read_twin``): the
prefill lookahead ``Lp``, the one size in which they differ, is read by the write side only. The dominance
composition takes its read-side lemmas from the twin, so each policy's lookup must give the same hit, reach
and longest candidate under both on every cache."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvhit import refimpl
from kvhit.convert import to_refimpl
from kvhit.proofs import runner
from kvhit.proofs.domains import configs

CONFIGS = configs(extended=True)
# Every write-side configuration whose twin has another speculative setting (a twin with the same one is the
# configuration's own lookup), over every layout of the extended domain.
PAIRS = sorted({(c.layout.name, c.layout.dcp, c.speculation.describe()): (c, CONFIGS[t]) for c in CONFIGS
                if c.write_side and (t := runner.read_twin(c, CONFIGS)) is not None
                and CONFIGS[t].speculation != c.speculation}.items())
PAIRS = [pair for _, pair in PAIRS]


def test_every_default_write_configuration_has_a_read_twin():
    default = configs(extended=False)
    for c in default:
        if c.write_side:
            twin = runner.read_twin(c, default)
            assert twin is not None, c.label
            assert default[twin].layout == c.layout and not default[twin].write_side


def test_the_twin_of_mtp2_drop_is_drop_with_one_token():
    """The pair whose sizes differ: MTP 2 in drop mode (``Lp = 2``) reads as EAGLE drop (``Lp = 1``)."""
    labels = {(c.layout.name, c.layout.dcp, c.speculation.describe(), t.label) for c, t in PAIRS}
    assert ("qwen3next", 1, "drop Lp=2 mtp2", "qwen3next drop Lp=1") in labels


@pytest.mark.parametrize("pair", PAIRS, ids=lambda p: p[0].label)
@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_a_write_configuration_looks_up_as_its_read_twin(pair, data):
    write, read = pair
    sizes_w = refimpl.derive_sizes(to_refimpl(write.layout), to_refimpl(write.speculation))
    sizes_r = refimpl.derive_sizes(to_refimpl(read.layout), to_refimpl(read.speculation))
    h, s = sizes_w.hash_block, sizes_w.scheduler_block
    n = data.draw(st.integers(1, 6 * s))
    units = n // h + 2
    sets = [set(data.draw(st.lists(st.integers(1, units), max_size=40)))
            | set(range(1, data.draw(st.integers(0, units)) + 1)) for _ in sizes_w.groups]
    cache = refimpl.CacheState.from_sets([{u * h for u in g} for g in sets])
    for name in ("reference", "vllm_0_33", "vllm_0_33_repaired", "historical"):
        rules = refimpl.ALL_POLICIES[name]
        assert refimpl.hit_tokens(cache, sizes_w, n, rules) == refimpl.hit_tokens(cache, sizes_r, n, rules), name
