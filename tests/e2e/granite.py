"""The Granite hybrid's servers: a tiny GraniteMoeHybridForCausalLM (Mamba-2 + attention, make_models.py)
on vLLM 0.32.0's CPU build, with prefix caching in Mamba ``align`` mode, queried like the EAGLE servers.

vLLM 0.32.0 serves it on the CPU only if no Mamba-2 mid-prefill checkpoint is ever taken (the CPU scan
returns one state per sequence and the checkpoint store is a Triton kernel: plugins/granite_nockpt.py says
where it fails). Two ways, and each is a setting here:

* ``nockpt-*``: the test's plugin ``plugins/granite_nockpt.py`` (put on PYTHONPATH, loaded by vLLM's plugin
  loader beside kvhit's) sets the Mamba spec's checkpoint blocks to 0; the scheduler then stops prefills at
  the Mamba block boundaries itself, a layout kvhit models (write side included). At retention 0 and dense.
* ``budget128``: vLLM as it ships, with a token budget of one block (``--max-num-batched-tokens 128``), so
  that no chunk is long enough to take a checkpoint. The Mamba spec still declares checkpoint blocks; kvhit
  enforces the layout (it keeps a backend checkpoint only where it is the prompt's resume point, and ends a
  chunk at every other state the reference keeps).
"""

from __future__ import annotations

import os
import random

import server

BLOCK = 128   # the block size vLLM 0.32.0 chooses for this model (both groups; the tests check it)
PLUGINS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "plugins")
# name -> (the test's checkpoint plugin loaded, prefix_cache_retention_interval, extra server arguments)
SETTINGS = {
    "nockpt-r0": (True, 0, []),
    "nockpt-dense": (True, None, ["--prefix-cache-retention-interval", "None"]),
    "budget128": (False, 0, ["--max-num-batched-tokens", str(BLOCK), "--max-num-seqs", "16"]),
}
# Each sent twice: one block, a block and a half, two, three, three and a few tokens
LENGTHS = [BLOCK, BLOCK * 3 // 2, 2 * BLOCK, 3 * BLOCK, 3 * BLOCK + 5]


def stream() -> list[tuple[str, list[int]]]:
    """A prompt P of 3 blocks + 5, then prompts that share its first 1, 2 or 3 blocks and diverge, P extended,
    and one of the siblings again: ``(name, token ids)`` in the order they are sent."""
    rng = random.Random(7)
    p = [rng.randrange(server.VOCAB_LOW, server.VOCAB_HIGH) for _ in range(3 * BLOCK + 5)]

    def tail(n, seed):
        r = random.Random(seed)
        return [r.randrange(server.VOCAB_LOW, server.VOCAB_HIGH) for _ in range(n)]

    return [("P", p), ("P again", p), ("shares 1 block", p[:BLOCK] + tail(BLOCK + 7, 1)),
            ("shares 2 blocks", p[:2 * BLOCK] + tail(BLOCK + 7, 2)),
            ("shares 3 blocks", p[:3 * BLOCK] + tail(BLOCK // 2, 3)), ("P + 100", p + tail(100, 4)),
            ("shares 2 blocks again", p[:2 * BLOCK] + tail(BLOCK + 7, 2))]


def command(model: str, setting: str, port: int) -> list[str]:
    _, _, extra = SETTINGS[setting]
    return [*server.server_command(model), "--served-model-name", "granite", "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32",
            "--max-model-len", "1024", "--enforce-eager", "--enable-prefix-caching", "--mamba-cache-mode",
            "align", "--enable-prompt-tokens-details", "--seed", "0", *extra]


def serve(model: str, setting: str, kvhit_mode: str, out_dir: str, health_timeout: float) -> server.Run:
    plugin, _, _ = SETTINGS[setting]
    extra_env = {"PYTHONPATH": PLUGINS} if plugin else {}

    def query(client, run):
        for n in LENGTHS:
            ids = server.prompt_ids(n)
            for seen in (run.first, run.repeat):
                seen[n] = server.complete(client, "granite", ids)
        run.stream = [(name, server.complete(client, "granite", ids)) for name, ids in stream()]

    return server.run_server(f"granite-{setting}", kvhit_mode, lambda port: command(model, setting, port), query,
                             out_dir, health_timeout, extra_env)
