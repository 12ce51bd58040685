"""vLLM's SimpleCPUOffloadConnector asked, at every local hit, how many tokens it loads (a child process of
``tests/adapter/test_connectors.py``; writes JSON).

Run: ``python -m tests.adapter.connector_probe OUT.json``

A stock ``Scheduler`` (kvhit not loaded) with the connector on the EAGLE layout in drop mode (block 16,
``scheduler_run``'s ``connector-cpu-eagle-drop``). No worker runs, so for each seed its CPU pool is made to
hold a random set of a random prompt's blocks (vLLM's ``BlockPool.cache_full_blocks`` with a block mask),
and ``get_num_new_matched_tokens`` is asked at every local hit from 0 to ``N - 1``, block by block.
"""

from __future__ import annotations

import json
import random
import sys
import tempfile

from tests.adapter import scheduler_run, serving

SEEDS = range(12)


def probe(scheduler, block_hasher, seed: int) -> dict:
    connector = scheduler.connector
    manager = connector.scheduler_manager
    pool, block = manager.cpu_block_pool, manager.block_size
    rng = random.Random(seed)
    n = rng.randrange(200, 1100)
    tokens = [rng.randrange(3, 512) for _ in range(n)]
    request = scheduler_run.new_request(f"probe-{seed}", tokens, block_hasher)
    full = len(request.block_hashes)
    held = [rng.random() < 0.7 for _ in range(full)]
    blocks = pool.get_new_blocks(full)
    pool.cache_full_blocks(request, blocks, 0, full, block, 0, block_mask=held)
    locals_, starts = list(range(0, n, block)), []
    for local in locals_:
        asked = scheduler_run.new_request(f"probe-{seed}-{local}", tokens, block_hasher)
        loaded, _ = connector.get_num_new_matched_tokens(asked, local)
        pending = manager._pending_cpu_hits.pop(asked.request_id, None)
        if pending is not None:  # the connector pins what it found until the scheduler allocates
            manager._free_pending_cpu_hit(pending)
        starts.append(local + loaded)
    pool.free_blocks(blocks)
    return {"seed": seed, "prompt_len": n, "held": held, "locals": locals_, "starts": starts}


def main(argv=None) -> None:
    out = (argv or sys.argv[1:])[0]
    serving.setup_environment()
    with tempfile.TemporaryDirectory() as models_dir:
        scheduler_run.write_models(models_dir)
        scheduler, block_hasher = scheduler_run.build_scheduler("connector-cpu-eagle-drop", models_dir)
        result = [probe(scheduler, block_hasher, seed) for seed in SEEDS]
    with open(out, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
