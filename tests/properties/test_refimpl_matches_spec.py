"""The generated refimpl computes what the spec says: same hits as the spec run as a concrete
interpreter, and the same as the spec's Z3 lowering, on random layouts, prompts and cache states."""

import pytest
import z3
from hypothesis import assume, event, given, settings
from hypothesis import strategies as st

from kvhit import refimpl
from kvhit.convert import to_spec
from kvhit.proofs.model import SPEC, cache_from_runs
from kvhit.spec import cache as spec_cache
from kvhit.spec.lower_z3 import SymbolicCache, fresh_int, lowering
from kvhit.spec.sizes import derive_sizes as spec_derive_sizes
from kvhit.spec.terms import _zv

from .strategies import caches, layouts, speculations


@settings(max_examples=300, deadline=None)
@given(data=st.data(), layout=layouts(), speculation=speculations, n=st.integers(1, 2500))
def test_refimpl_matches_the_spec_interpreter(data, layout, speculation, n):
    sizes = refimpl.derive_sizes(layout, speculation)
    sets = data.draw(caches(len(sizes.groups), n + 64))
    spec_layout, spec_speculation = to_spec(layout), to_spec(speculation)
    spec_sizes = spec_derive_sizes(spec_layout, spec_speculation)
    for name, rules in refimpl.ALL_POLICIES.items():
        sizes_r = refimpl.derive_sizes(layout, speculation, rules.scale_replicated)
        sizes_s = spec_derive_sizes(spec_layout, spec_speculation, rules.scale_replicated)
        if sizes_r.hash_lookahead and not rules.lookahead_hashes:  # vllm_0_32: no lookahead mode; both refuse
            for P, state, sz, r in ((refimpl, refimpl.CacheState, sizes_r, rules),
                                    (SPEC, spec_cache.CacheState, sizes_s, SPEC.ALL_POLICIES[name])):
                with pytest.raises(ValueError, match="no lookahead block hashes"):
                    P.hit_tokens(state.from_sets(sets), sz, n, r)
            continue
        got = refimpl.hit_tokens(refimpl.CacheState.from_sets(sets), sizes_r, n, rules)
        want = SPEC.hit_tokens(spec_cache.CacheState.from_sets(sets), sizes_s, n, SPEC.ALL_POLICIES[name])
        assert got == want, (name, layout, speculation, n)
    assert spec_sizes.alignment == sizes.alignment


@settings(max_examples=120, deadline=None)
@given(data=st.data(), layout=layouts(), speculation=speculations, n=st.integers(1, 3000),
       policy=st.sampled_from(sorted(refimpl.ALL_POLICIES)))
def test_z3_lowering_matches_refimpl(data, layout, speculation, n, policy):
    """Fix the symbolic prompt and cache to concrete values: Z3 must compute refimpl's hit."""
    spec_layout, spec_speculation = to_spec(layout), to_spec(speculation)
    rules = SPEC.ALL_POLICIES[policy]
    sizes = spec_derive_sizes(spec_layout, spec_speculation, rules.scale_replicated)
    assume(not (sizes.hash_lookahead and not rules.lookahead_hashes))  # refused: the test above checks it
    with lowering():
        cache = SymbolicCache(3)
        n_sym = fresh_int("N")
        hit, reach, longest, converged = SPEC.hit_tokens(cache, sizes, n_sym, rules)
    runs = {}
    solver = z3.Solver()
    solver.add(n_sym.z == n)
    for key, lst in cache.lists.items():
        spans, start = [], 0
        for s, e in lst:
            a = start + data.draw(st.integers(0 if not spans else 1, 40))
            b = a + data.draw(st.integers(0, 200))
            spans.append((a, b))
            start = b
            solver.add(s.z == a, e.z == b)
        runs[key] = spans
    assert solver.check() == z3.sat
    model = solver.model()
    got = tuple(model.eval(_zv(v), True).as_long() for v in (hit, reach, longest))
    got_converged = z3.is_true(model.eval(_zv(converged), True))
    concrete, _ = cache_from_runs(runs)
    # The spec run on the same integers with the passes the Z3 lowering unrolls: every output, converged or not.
    with lowering():
        unrolled = SPEC.hit_tokens(spec_cache.CacheState(concrete.has), sizes, n, rules)
    assert (*got, got_converged) == (*unrolled[:3], unrolled[3]), (policy, layout, speculation, n, runs)
    want = refimpl.hit_tokens(concrete, refimpl.derive_sizes(layout, speculation, rules.scale_replicated),
                              n, refimpl.ALL_POLICIES[policy])
    event(f"unrolled passes converged: {got_converged}")
    if got_converged:
        assert got == want[:3], (policy, layout, speculation, n, runs)
    else:
        # The unrolled passes are the first passes of refimpl's loop, which goes on: its candidate only falls,
        # its reach and longest only grow.
        assert want[0] <= got[0] and want[1] >= got[1] and want[2] >= got[2], (
            policy, layout, speculation, n, runs, got, want)
