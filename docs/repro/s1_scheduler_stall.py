"""S1: vLLM 0.33.0's Scheduler never finishes a prefill (0 tokens scheduled every step) with partial Mamba hits
and multi-module MTP. Stock vLLM only: no kvhit import, no GPU, no weights, no network.

Run from the repository root:  python docs/repro/s1_scheduler_stall.py

The Scheduler is built the way EngineCore builds it, from a VllmConfig (a local config.json of a tiny
Nemotron-H target with two MTP modules; vLLM's own KV-cache planner groups the layers into full attention
1600 + Mamba 1600), with prefix_match_unit=160 and 2 speculative tokens. The builder lives in
tests/adapter/scheduler_run.py (vLLM code plus stand-ins for the GPU worker's layer specs and outputs).
Prints, per prompt length, the tokens scheduled in each of the first steps and whether the request finished.
"""

import os
import sys
import tempfile

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")  # vLLM's CPU platform (the hybrid KV-cache manager needs one)
sys.path.insert(0, os.getcwd())

import tests.adapter.scheduler_run as runner  # noqa: E402  (vLLM only: see the module's docstring)

MAX_STEPS = 20


def run(mode: str, n: int, prefix_match_unit: int | None) -> tuple[list[int], bool, int]:
    """(tokens scheduled per step, finished, tokens computed) for one prompt of ``n`` tokens."""
    models = tempfile.mkdtemp()
    runner.write_models(models)
    scheduler, hasher = runner.build_scheduler(mode, models, prefix_match_unit)
    request = runner.new_request("r", runner._prompt(mode, n), hasher)
    scheduler.add_request(request)
    per_step = []
    while scheduler.has_unfinished_requests() and len(per_step) < MAX_STEPS:
        scheduler_output, _ = runner.step(scheduler)
        per_step.append(sum(scheduler_output.num_scheduled_tokens.values()))
    return per_step, not scheduler.has_unfinished_requests(), request.num_computed_tokens


def main() -> None:
    for mode in ("mtp2-lookahead", "mtp2-drop"):
        for pmu in (160, None):
            for n in (1601, 1602, 3201):
                per_step, finished, computed = run(mode, n, pmu)
                print(f"{mode:<15} prefix_match_unit={pmu!s:<5} N={n:<5} scheduled per step {per_step[:6]} "
                      f"{'finished' if finished else f'STALLED at {computed} of {n} after {MAX_STEPS} steps'}")


if __name__ == "__main__":
    main()
