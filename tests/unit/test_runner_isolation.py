"""`kvhit prove` spends the same Z3 resource units on a check whatever ran before it (proofs/runner.py,
chunks; proofs/model.py, isolated_map): one table per commit, on any number of workers and any subset of
invariants. Before, a check's units depended on what its worker had checked first (14 M in one run, over
400 M in another)."""

from kvhit.proofs import runner


def _rows(jobs, only):
    runner.ONLY.clear()
    runner.ONLY.update(only)
    try:
        return {(v.invariant, v.policy): (v.verdict, v.rlimit, v.max_rlimit) for v in runner.run(jobs)}
    finally:
        runner.ONLY.clear()


def test_a_rows_chunks_do_not_depend_on_the_other_rows():
    every = runner.chunks(runner.tasks())
    one = runner.chunks([t for t in runner.tasks() if t[0] == "hit_is_the_longest_valid"])
    assert one and set(one) <= set(every)
    assert all(len(c) <= runner.CHUNK and len({t[:2] for t in c}) == 1 for c in every)


def test_resource_units_are_the_same_on_one_worker_or_two_and_beside_other_invariants():
    alone = _rows(1, {"lookup_stays_within_hashes"})
    together = _rows(2, {"lookup_stays_within_hashes", "hit_is_aligned_and_capped"})
    assert alone and all(together[key] == value for key, value in alone.items())
    assert any(v[1] > 0 for v in alone.values())
