"""`kvhit prove` spends the same Z3 resource units on a check whatever ran before it (proofs/runner.py,
chunks; proofs/model.py, isolated_map): one table per commit, on any number of workers and any subset of
invariants. Before, a check's units depended on what its worker had checked first (14 M in one run, over
400 M in another)."""

from kvhit.proofs import runner
from kvhit.proofs.model import isolated_map


def _units(chunks, jobs):
    return {task: (verdict, spent) for done in isolated_map(runner._run_chunk, chunks, jobs)
            for task, verdict, _, _, spent in done}


def test_a_rows_chunks_do_not_depend_on_the_other_rows():
    every = runner.chunks(runner.tasks())
    one = runner.chunks([t for t in runner.tasks() if t[0] == "hit_is_the_longest_valid"])
    assert one and set(one) <= set(every)
    assert all(len(c) <= runner.CHUNK and len({t[:2] for t in c}) == 1 for c in every)


def test_resource_units_are_the_same_on_one_worker_or_two_and_beside_other_chunks():
    every = runner.chunks(runner.tasks())
    row = [c for c in every if c[0][:2] == ("hit_is_the_longest_valid", "vllm_0_33")][:2]
    others = [c for c in every if c[0][:2] == ("lookup_stays_within_hashes", "reference")][:2]
    alone = _units(row, 1)
    beside = _units(others + row + others[::-1], 2)  # other checks before and after, on two workers
    assert len(alone) == sum(map(len, row)) and any(spent > 0 for _, spent in alone.values())
    assert {task: beside[task] for task in alone} == alone
