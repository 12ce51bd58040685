"""A prompt served three times through vLLM's real ``Scheduler``, its serves decoding alike or not (a child
process of ``tests/adapter/test_soak.py``; prints nothing, writes JSON).

Run: ``KVHIT_MODE=enforce python -m tests.adapter.decode_repeats OUT.json``

``qwen3next_pmu160`` with two MTP modules in drop mode, token budget 2048, a prompt of 6560 tokens. A
request's decode steps cache more of its full-attention blocks, so the second repeat can find more than the
first when the first repeat decodes longer than the first serve: the soak counts such misses apart
(``soak.first_repeat_misses``). Streams: ``alike`` (every serve decodes one token) and ``longer`` (one,
then three, then one).
"""

from __future__ import annotations

import json
import random
import sys
import tempfile

from tests.adapter import scheduler_run, serving
from tests.adapter.serving import Arrival

CASE = "qwen3next_pmu160-mtp2-drop"
BUDGET = 2048
N = 6560
STREAMS = {"alike": (1, 1, 1), "longer": (1, 3, 1)}  # max_tokens of the three serves


def main(argv=None) -> None:
    out = (argv or sys.argv[1:])[0]
    serving.setup_environment()
    rng = random.Random(N)
    prompt = tuple(serving.tokens(rng, N))
    result = {}
    with tempfile.TemporaryDirectory() as models_dir:
        scheduler_run.write_models(models_dir)
        for name, decodes in STREAMS.items():
            arrivals = [Arrival(f"r{i}", "p", prompt, max_tokens, (f"r{i - 1}",) if i else ())
                        for i, max_tokens in enumerate(decodes)]
            scheduler, block_hasher = serving.build(serving.CASES[CASE], models_dir, BUDGET)
            result[name] = serving.serve_stream(scheduler, block_hasher, arrivals)
    with open(out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
