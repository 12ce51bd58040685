"""KVHIT_MODE=enforce on a real ``Scheduler``: the reference write side never ends a prefill chunk within the
prefill lookahead of the prompt end, so a request it serves never stalls there.

The setting of the model's former divergence ``mamba_state_within_prefill_lookahead``
(``tests/conformance/patched.py``): the Nemotron-H of ``tests/adapter/scheduler_run.py`` with three MTP
modules (full attention 1600 holding the MTP layers, Mamba 1600), MTP 3 in drop mode, retention interval 1600,
a prompt of 3202 tokens, then two resends. The reference once kept a Mamba state at 3200 (a multiple of the
interval), which lies within ``Lp = 3`` of the prompt end; the adapter ended a chunk there
(``WriteModel.next_mamba_stop``), ``_reserve_prefill_lookahead`` cut the chunk after it to 0 tokens and the
first request never finished. ``refimpl.group_extent`` now bounds a Mamba group's states by ``N - Lp``.

The scheduler runs in a process of its own (``python -m tests.adapter.test_enforce_stall OUT MODELS_DIR``:
kvhit is loaded by vLLM's plugin loader, as ``EngineCore`` does), with a step limit so that a stall ends it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
N = 3202
RETENTION = 1600
SCENARIO = "mtp3-drop-r1600"
MAX_STEPS = 40  # a request of N tokens needs a handful; a stalled one schedules 0 tokens forever


def _serve_with_step_limit(scheduler, block_hasher, request_id, tokens):
    """Serve one request (``scheduler_run.serve``) for at most ``MAX_STEPS`` steps."""
    from tests.adapter import scheduler_run

    request = scheduler_run.new_request(request_id, tokens, block_hasher)
    retained = scheduler_run._retained(scheduler, request)
    scheduler.add_request(request)
    scheduled, cached = [], None
    for _ in range(MAX_STEPS):
        if not scheduler.has_unfinished_requests():
            break
        scheduler_output, engine_outputs = scheduler_run.step(scheduler)
        scheduled.append(scheduler_output.num_scheduled_tokens.get(request_id, 0))
        for o in scheduler_run._step_record(scheduler_output, engine_outputs)["outputs"]:
            if o["req_id"] == request_id and o["prefill_stats"] is not None:
                cached = o["prefill_stats"]["num_cached_tokens"]
    return {"scheduled": scheduled, "num_cached_tokens": cached, "retained": retained,
            "stalled": scheduler.has_unfinished_requests()}


def child(out: str, models_dir: str) -> None:
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    import vllm.plugins
    from vllm.config.logging import LoggingConfig
    from vllm.logger import configure_logging

    configure_logging(LoggingConfig())  # as vLLM's entry points do, so kvhit's INFO lines show

    vllm.plugins.load_general_plugins()
    from tests.adapter import scheduler_run as run

    run.MODELS["nemotron_h_mtp3"] = {**run.MODELS["nemotron_h_mtp"], "num_nextn_predict_layers": 3}
    run.write_models(models_dir)
    run.SCENARIOS[SCENARIO] = ("nemotron_h_mtp3", {"method": "mtp", "num_speculative_tokens": 3,
                                                   "disable_lookahead_block_hashes": True},
                               run.nemotron_h_mtp_layers, 1600, (N,) * 3)
    run.RETENTION[SCENARIO] = RETENTION
    scheduler, block_hasher = run.build_scheduler(SCENARIO, models_dir)
    tokens = run._prompt(SCENARIO, N)
    served = []
    for i in range(3):
        served.append(_serve_with_step_limit(scheduler, block_hasher, f"r{i}", tokens))
        if served[-1]["stalled"]:
            break
    import kvhit.adapters.vllm as kvhit_vllm

    with open(out, "w") as f:
        json.dump({"kvhit_mode": kvhit_vllm.current_mode(), "num_prefill_lookahead": scheduler.num_prefill_lookahead,
                   "served": served}, f)


def test_enforce_never_stalls_a_prefill_within_the_prefill_lookahead(tmp_path):
    import kvhit.refimpl as R

    env = {k: v for k, v in os.environ.items() if not k.startswith(("KVHIT_", "VLLM_", "PROMETHEUS_"))}
    env.update(VLLM_PLUGINS="kvhit", VLLM_TARGET_DEVICE="cpu", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               KVHIT_MODE="enforce")
    out = tmp_path / "served.json"
    proc = subprocess.run([sys.executable, "-m", "tests.adapter.test_enforce_stall", str(out),
                           str(tmp_path / "models")], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "is modelled; mode enforce; write side: reference" in proc.stdout + proc.stderr
    result = json.loads(out.read_text())
    assert result["kvhit_mode"] == "enforce" and result["num_prefill_lookahead"] == 3
    served = result["served"]
    assert [s["stalled"] for s in served] == [False] * 3, served
    # No chunk ends within Lp of the prompt end (_reserve_prefill_lookahead would cut the next one to 0).
    for s in served:
        ends = [sum(s["scheduled"][:i + 1]) for i, t in enumerate(s["scheduled"]) if t]
        assert not any(N - 3 < e < N for e in ends), s

    layout = R.Layout((R.Group("full", 1600, eagle=True), R.Group("mamba", 1600)))
    speculation = R.Speculation("drop", 3, True)
    sizes = R.derive_sizes(layout, speculation)
    # The first request leaves the reference's cache: every spec group's boundaries up to N - L.
    cache = R.written_cache(R.request_writes(sizes, N, RETENTION, R.REFERENCE))
    want = [[x for x in range(sizes.hash_block, N - sizes.hash_lookahead + 1, sizes.hash_block) if cache.has(k, x)]
            for k in range(len(sizes.groups))]
    have = [sorted(set.intersection(*(set(served[1]["retained"][m]) for m in sg.members)))
            for sg in sizes.groups]
    assert have == want == [[1600, 3200], [1600]], (have, want)
    # The first repeat hits what the second does, and what refimpl's reference says.
    expected = R.repeat_hits(sizes, N, RETENTION, R.REFERENCE, 2)
    assert [s["num_cached_tokens"] for s in served] == [0, *expected] and expected[0] == expected[1] == 1600


if __name__ == "__main__":
    child(*sys.argv[1:])
