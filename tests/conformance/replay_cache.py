"""Replay read-side ``kvhit diff`` rows on a copy of vLLM 0.33.0's ``vllm/v1/core``, in a subprocess.

:func:`replay_rows` starts ``python -m tests.conformance.replay_cache CORE`` with the rows (``kvhit diff
--json``'s, read side) on stdin; the child makes ``vllm.v1.core`` the copy at ``CORE`` (stock, or with the
``docs/upstream`` patches applied: :func:`.patched.patch_core`), and for each row puts the row's cache state
into vLLM's block pool for the prompt's own block hashes (:func:`.differential.seed_cache`, as
:mod:`.test_counterexample_replays_on_vllm` does), looks the prompt up and prints what vLLM hits
(``IndexError`` when a lookup reads past the hashes).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from .patched import ROOT, check_loaded_from, use_core


def replay_rows(core_dir: Path, rows: list[dict], timeout: int = 300) -> list:
    """vLLM's hit for each row on the engine at ``core_dir``."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    out = subprocess.run([sys.executable, "-m", "tests.conformance.replay_cache", str(core_dir)], cwd=ROOT,
                         env=env, input=json.dumps(rows), capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, out.stderr[-4000:]
    line = [x for x in out.stdout.splitlines() if x.startswith("hits=")]
    assert line, out.stdout[-2000:]
    return json.loads(line[-1].removeprefix("hits="))


def _config(row: dict):
    from kvhit.proofs.diff import domain

    for config in domain([row["layout"]]):
        if (not config.write_side and config.layout.dcp == row["dcp"]
                and config.speculation.describe() == row["mode"]):
            return config
    raise LookupError(f"{row['layout']} dcp{row['dcp']} {row['mode']}: not a read-side configuration of kvhit diff")


def replay(row: dict):
    """vLLM's hit (or ``"IndexError"``) on the row's prompt with exactly the row's cache state."""
    from kvhit.refimpl.policy import num_hashes

    from .differential import seeded_harness

    n = row["N"]
    s = seeded_harness(_config(row), n, row["cache"])
    h = s.sizes.hash_block
    expected = [{x for x in range(h, num_hashes(s.sizes, n) * h + 1, h) if s.cache.has(g, x)}
                for g in range(len(s.sizes.groups))]
    assert s.seeded == expected, f"the pool holds {s.seeded}, the row's cache is {expected}"
    try:
        return s.harness.probe(s.tokens)["hit"]
    except IndexError:
        return "IndexError"


def main(argv) -> None:
    core_dir = Path(argv[0]).resolve()
    use_core(core_dir)  # before anything imports vllm.v1.core's submodules
    hits = [replay(row) for row in json.loads(sys.stdin.read())]
    check_loaded_from(core_dir)
    print("hits=" + json.dumps(hits))


if __name__ == "__main__":
    main(sys.argv[1:])
