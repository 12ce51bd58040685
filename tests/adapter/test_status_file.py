"""KVHIT_STATUS_FILE: the layout the plugin saw, for tools outside the engine-core process (tests/e2e)."""

import json
import os

import kvhit.adapters.vllm as kvhit_vllm
import kvhit.refimpl as R
from kvhit.adapters.vllm import engine
from tests.adapter.layouts import harness_layout
from tests.conformance.vllm_harness import VllmHarness


def _read_back(status):
    layout = R.Layout(tuple(R.Group(**g) for g in status["layout"]["groups"]), status["layout"]["dcp"],
                      status["layout"]["prefix_match_unit"])
    return layout, R.Speculation(**status["speculation"])


def test_status_file_round_trips_the_modelled_layout(tmp_path, monkeypatch):
    path = tmp_path / "status.json"
    monkeypatch.setenv(engine.STATUS_FILE_ENV, str(path))
    assert kvhit_vllm.install("enforce")
    for name, dcp, mode in (("llama_eagle", 2, "drop"), ("qwen3next", 1, "lookahead")):
        harness = VllmHarness(harness_layout(name, dcp), mode, num_speculative_tokens=1, retention_interval=0,
                              max_model_len=20000)
        model = engine._models[harness.manager.coordinator]
        status = json.loads(path.read_text())
        assert (status["pid"], status["mode"], status["modelled"], status["label"]) == (
            os.getpid(), "enforce", True, model.label)
        layout, spec = _read_back(status)
        assert layout == R.Layout(model.layout.groups, model.layout.dcp, model.layout.prefix_match_unit)
        assert spec == model.speculation
        assert R.derive_sizes(layout, spec) == model.sizes


def test_no_status_file_without_the_variable(tmp_path, monkeypatch):
    monkeypatch.delenv(engine.STATUS_FILE_ENV, raising=False)
    monkeypatch.chdir(tmp_path)
    assert kvhit_vllm.install("enforce")
    VllmHarness(harness_layout("full16"), "drop", retention_interval=0, max_model_len=4096)
    assert list(tmp_path.iterdir()) == []
