"""S2 (docs/findings.md): a resend with a partial Mamba hit needs more pool blocks than vLLM's
``max_memory_usage_bytes`` says one request of the model length needs, and on a pool between the two it is
never admitted.

Through vLLM 0.33's real ``Scheduler`` (``tests/adapter/serving.py``): ``qwen3next_pmu160`` (full attention 1600
holding the MTP layer, Mamba 1600, read at 160), one MTP module in drop mode, a prompt of 11272 tokens served
and then sent again, alone, on pools of vLLM's minimum (one request of the model length and the null block,
12 blocks here), one more and two more. On the minimum the prompt's states are evicted and the resend hits 0;
with two more it hits 11040; with one more it would hit 11040 too, needs 13 blocks where 12 are free, and waits
forever: nothing else runs, and no step schedules a token. Enforce changes nothing of that (it keeps vLLM's
admission). Each mode runs in a process of its own (stock: kvhit never imported).

``python -m tests.adapter.test_admission_stall OUT.json MODELS_DIR`` runs it under the mode ``KVHIT_MODE``
names.
"""

from __future__ import annotations

import json
import random
import sys

import pytest

from tests.adapter import child_runs, scheduler_run, serving
from tests.adapter.serving import Arrival

CASE = "qwen3next_pmu160-mtp1-drop"
N = 11272


def _serve_twice(models_dir: str, extra_blocks: int):
    """The prompt, then its resend once it finished, on vLLM's minimum pool plus ``extra_blocks``: the
    hits, or ``["stalled", the resend's hit, blocks it needs, blocks free]``."""
    case = serving.CASES[CASE]
    scheduler, _ = serving.build(case, models_dir, 8192)
    least = serving.minimum_pool(scheduler)
    scheduler, block_hasher = serving.build(case, models_dir, 8192, least + extra_blocks)
    prompt = tuple(serving.tokens(random.Random(N), N))
    try:
        served = serving.serve_stream(scheduler, block_hasher,
                                      [Arrival("p", "p", prompt), Arrival("p-1", "p", prompt, after=("p",))],
                                      max_steps=300)
    except RuntimeError:
        waiting = list(scheduler.waiting)
        assert [r.request_id for r in waiting] == ["p-1"] and not scheduler.running, waiting
        manager = scheduler.kv_cache_manager
        blocks, hit = manager.get_computed_blocks(waiting[0])[:2]
        need = manager.coordinator.get_num_blocks_to_allocate(
            request_id="p-1", num_tokens=N, new_computed_blocks=blocks.blocks, num_encoder_tokens=0,
            total_computed_tokens=hit, num_local_computed_tokens=hit, num_tokens_main_model=N,
            prefill_end=N)
        assert scheduler.schedule().total_num_scheduled_tokens == 0
        return least, ["stalled", hit, need, manager.block_pool.get_num_free_blocks()]
    return least, [s["num_cached_tokens"] for s in served]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    work = tmp_path_factory.mktemp("admission_stall")
    scheduler_run.write_models(str(work / "models"))
    started = {mode: (work / f"{mode}.json", child_runs.start(
        "tests.adapter.test_admission_stall", [work / f"{mode}.json", work / "models"],
        child_runs.env(None if mode == "stock" else "enforce"))) for mode in ("stock", "enforce")}
    return {mode: result for mode, (result, _) in child_runs.collect(started, timeout=600).items()}


@pytest.mark.parametrize("mode", ["stock", "enforce"])
def test_s2_a_partial_mamba_hit_is_never_admitted_on_a_pool_one_block_over_vllms_minimum(runs, mode):
    result = runs[mode]
    assert result["kvhit_mode"] == (None if mode == "stock" else "enforce"), result
    assert result["least"] == 12, result  # 8 full-attention blocks, 3 Mamba blocks, the null block
    assert result["by_extra_blocks"] == {"0": [0, 0], "1": ["stalled", 11040, 13, 12], "2": [0, 11040]}, result


def main(argv=None) -> None:
    out, models_dir = argv if argv is not None else sys.argv[1:]
    serving.setup_environment()
    results = {extra: _serve_twice(models_dir, extra) for extra in (0, 1, 2)}
    result = {"least": results[0][0], "by_extra_blocks": {extra: r for extra, (_, r) in results.items()},
              "kvhit_mode": (sys.modules["kvhit.adapters.vllm"].current_mode()
                             if "kvhit.adapters.vllm" in sys.modules else None)}
    with open(out, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
