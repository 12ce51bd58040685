"""``kvhit status`` against a fake server (http.server on 127.0.0.1 serving a /metrics text) and fake status
files: every number it reports is the fixtures' own, and every unreadable source is one line and exit 2."""

from __future__ import annotations

import contextlib
import http.server
import json
import os
import threading

import pytest

from kvhit import cli, status
from tests.dist.check_dist import project

LABEL = "full32+full32e drop Lp=1"
STATUS = {
    "pid": 4242, "vllm": "0.33.0", "kvhit": "0.1.0", "kvhit_path": "/venv/lib/python3.11/site-packages/kvhit",
    "mode": "enforce", "modelled": True, "prometheus_multiproc_dir": True, "count_gains": True, "label": LABEL,
    "layout": {"groups": [
        {"kind": "full", "block_size": 32, "window": None, "chunk": None, "dcp_sharded": True, "eagle": False,
         "tokens_per_state": 1},
        {"kind": "full", "block_size": 32, "window": None, "chunk": None, "dcp_sharded": True, "eagle": True,
         "tokens_per_state": 1}], "dcp": 1, "prefix_match_unit": None},
    "speculation": {"mode": "drop", "num_speculative_tokens": 1, "multi_module_mtp": False},
    "sizes": {"scheduler_block": 32, "hash_block": 32, "alignment": 32},
    "write_side": "reference",
}
UNMODELLED = {"pid": 7, "vllm": "0.33.0", "kvhit": "0.1.0", "kvhit_path": "/k", "mode": "shadow",
              "modelled": False, "unmodelled": "the spec rejects the layout: RSWASpec"}

# What the fake server's /metrics says: 12 lookups, 3 longer by 96 tokens, 1 shorter by 32, in enforce.
METRICS = f"""# HELP vllm:kvhit_lookups_total Multiprocess metric
# TYPE vllm:kvhit_lookups_total counter
vllm:kvhit_lookups_total{{layout="{LABEL}",mode="enforce"}} 12.0
# TYPE vllm:kvhit_hit_divergences_total counter
vllm:kvhit_hit_divergences_total{{direction="reference_longer",layout="{LABEL}",mode="enforce"}} 3.0
vllm:kvhit_hit_divergences_total{{direction="reference_shorter",layout="{LABEL}",mode="enforce"}} 1.0
vllm:kvhit_hit_divergence_tokens_total{{direction="reference_longer",layout="{LABEL}",mode="enforce"}} 96.0
vllm:kvhit_hit_divergence_tokens_total{{direction="reference_shorter",layout="{LABEL}",mode="enforce"}} 32.0
kvhit_enforce_fallbacks_total{{layout="{LABEL}"}} 0.0
kvhit_unmodelled_layouts_total 0.0
vllm:prefix_cache_queries_total{{engine="0",model_name="tiny"}} 2618.0
vllm:prefix_cache_hits_total{{engine="0",model_name="tiny"}} 1280.0
vllm:cache_config_info{{block_size="32",note="a \\"quoted\\", {{braced}} value"}} 1.0 1700000000000
vllm:time_to_first_token_seconds_bucket{{le="+Inf",engine="0"}} 12.0
"""
SHADOW_METRICS = METRICS.replace('mode="enforce"', 'mode="shadow"')
STOCK_METRICS = ('vllm:prefix_cache_queries_total{engine="0"} 10.0\n'
                 'vllm:prefix_cache_hits_total{engine="0"} 0.0\n')


@contextlib.contextmanager
def fake_server(text: str):
    """A server on a free 127.0.0.1 port answering /metrics with ``text``, anything else 404; its base URL."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - http.server's name
            if self.path != "/metrics":
                self.send_error(404)
                return
            body = text.encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def _file(tmp_path, content, name="status.json"):
    path = tmp_path / name
    path.write_text(content if isinstance(content, str) else json.dumps(content))
    return str(path)


def _value(out: str, label: str) -> str:
    """What the report's line starting with ``label`` says after it."""
    [line] = [line.strip() for line in out.splitlines() if line.strip().startswith(label)]
    return line[len(label):].strip()


def _run(capsys, *argv):
    code = cli.main(["status", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_metrics_parser_reads_labels_escapes_timestamps_and_infinities():
    samples = status.parse_metrics(METRICS)
    assert len(samples) == 11
    assert ("vllm:kvhit_lookups_total", {"layout": LABEL, "mode": "enforce"}, 12.0) in samples
    assert ("kvhit_unmodelled_layouts_total", {}, 0.0) in samples
    assert ("vllm:cache_config_info", {"block_size": "32", "note": 'a "quoted", {braced} value'}, 1.0) in samples
    assert samples[-1] == ("vllm:time_to_first_token_seconds_bucket", {"le": "+Inf", "engine": "0"}, 12.0)


@pytest.mark.parametrize("line", ['vllm:x{layout="a} 1', "vllm:x{a=1} 2", "vllm:x one", 'x{a="1"b="2"} 1'])
def test_a_malformed_metrics_line_is_named_with_its_number(line):
    with pytest.raises(status.StatusError, match=r"^line 2 of the metrics is not in the prometheus text format"):
        status.parse_metrics("ok 1\n" + line)


def test_enforce_report_shows_the_layout_and_the_counters_of_the_server(tmp_path, capsys):
    path = _file(tmp_path, STATUS)
    with fake_server(METRICS) as url:
        code, out, err = _run(capsys, "--url", url, "--status-file", path)
    assert (code, err) == (0, "")
    assert f"server {url}, status file {path}" in out
    assert "vLLM 0.33.0, kvhit 0.1.0 (/venv/lib/python3.11/site-packages/kvhit); engine core pid 4242" in out
    assert "mode: enforce: the scheduler's prefix-cache hit length is kvhit's reference hit" in out
    assert f"layout: {LABEL} (modelled)" in out
    assert "S=32 h=32 A=32" in out
    assert "drops (margin 32)" in out          # an EAGLE group in drop mode recomputes one 32-token block
    assert "write side: reference" in out
    assert _value(out, "lookups kvhit computed") == "12"
    assert _value(out, "hits unlike vLLM 0.33's") == "4 (3 longer by 96 tokens, 1 shorter by 32 tokens)"
    assert _value(out, "prompt tokens gained over stock") == str(96 - 32)
    assert _value(out, "enforce fallbacks") == "0"
    assert _value(out, "vLLM prefix cache") == "1280 of 2618 queried tokens hit"
    assert "note:" not in out


def test_json_report_carries_the_same_numbers(tmp_path, capsys):
    with fake_server(METRICS) as url:
        code, out, _ = _run(capsys, "--url", url, "--status-file", _file(tmp_path, STATUS), "--json")
    rep = json.loads(out)
    assert code == 0 and rep["schema"] == "kvhit.status/1"
    assert (rep["vllm"], rep["kvhit"], rep["mode"], rep["pid"], rep["modelled"]) == (
        "0.33.0", "0.1.0", "enforce", 4242, True)
    assert rep["layout"]["label"] == LABEL
    sizes = rep["layout"]["sizes"]
    assert (sizes["scheduler_block"], sizes["hash_block"], sizes["alignment"]) == (32, 32, 32)
    c = rep["counters"]
    assert (c["lookups"], c["divergences"], c["divergence_tokens"], c["tokens_gained"]) == (
        12, {"reference_longer": 3, "reference_shorter": 1}, {"reference_longer": 96, "reference_shorter": 32},
        96 - 32)
    assert (c["enforce_fallbacks"], c["unmodelled_layouts"], c["modes"], c["layouts"]) == (0, 0, ["enforce"],
                                                                                             [LABEL])
    assert c["vllm_prefix_cache"] == {"queried_tokens": 2618, "hit_tokens": 1280}


def test_shadow_reports_what_enforce_would_gain(tmp_path, capsys):
    with fake_server(SHADOW_METRICS) as url:
        code, out, _ = _run(capsys, "--url", url, "--status-file", _file(tmp_path, dict(STATUS, mode="shadow")))
    assert code == 0
    assert _value(out, "prompt tokens enforce would gain") == str(96 - 32)
    assert "- every hit and every write (shadow changes nothing)" in out
    assert "write side under enforce: reference" in out


def test_enforce_without_counted_gains_says_so(tmp_path, capsys):
    with fake_server(METRICS.replace("reference_", "none_")) as url:
        path = _file(tmp_path, dict(STATUS, count_gains=False))
        code, out, _ = _run(capsys, "--url", url, "--status-file", path)
    assert code == 0 and _value(out, "lookups kvhit computed") == "12"
    assert _value(out, "prompt tokens gained over stock") == _value(out, "hits unlike vLLM 0.33's") == (
        "not counted (start vllm serve with KVHIT_COUNT_GAINS=1 to count them in enforce)")


def test_the_status_file_is_read_from_the_environment(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("KVHIT_STATUS_FILE", _file(tmp_path, STATUS))
    code, out, _ = _run(capsys)
    assert code == 0 and f"layout: {LABEL} (modelled)" in out and "since the server started" not in out


def test_an_unmodelled_layout_says_why_it_is_stock(tmp_path, capsys):
    code, out, _ = _run(capsys, "--status-file", _file(tmp_path, UNMODELLED))
    assert code == 0
    assert "layout: not modelled, left to vLLM: the spec rejects the layout: RSWASpec" in out
    assert "every lookup and write on this layout: not modelled (the spec rejects the layout: RSWASpec)" in out


def test_a_layout_whose_write_side_is_not_modelled_is_shown_wholly_stock(tmp_path, capsys):
    """What the plugin writes for qwen3next_pmu160 (tests/adapter/test_whole_layout_stock.py)."""
    why = ("full1600e+mamba1600 pmu160 drop Lp=2 mtp2: the spec does not model its write side (a Mamba group "
           "read at hash granularity, in EAGLE drop mode with multi-module MTP: ...); kvhit does not enforce a "
           "read side without its write side")
    code, out, _ = _run(capsys, "--status-file", _file(tmp_path, dict(UNMODELLED, mode="enforce", unmodelled=why)))
    assert code == 0 and f"layout: not modelled, left to vLLM: {why}" in out
    assert f"every lookup and write on this layout: not modelled ({why})" in out and "write side:" not in out


def test_a_write_side_left_to_vllm_is_listed_as_stock(tmp_path, capsys):
    """A status file of a kvhit that enforced a read side on vLLM's write side still reads."""
    code, out, _ = _run(capsys, "--status-file",
                        _file(tmp_path, dict(STATUS, write_side="vLLM's (Mamba read at hash granularity)")))
    assert code == 0 and "- write side: vLLM's (Mamba read at hash granularity)" in out


def test_a_server_without_kvhit_counters_gets_a_note(tmp_path, capsys):
    with fake_server(STOCK_METRICS) as url:
        code, out, _ = _run(capsys, "--url", url, "--status-file", _file(tmp_path, STATUS), "--json")
    rep = json.loads(out)
    assert code == 0 and rep["counters"] is None
    assert rep["notes"] == [status.NO_COUNTERS]


def test_counters_of_another_layout_get_a_note(tmp_path, capsys):
    with fake_server(METRICS) as url:
        code, out, _ = _run(capsys, "--url", url, "--status-file", _file(tmp_path, dict(STATUS, label="other")),
                            "--json")
    assert code == 0 and json.loads(out)["notes"] == [
        f"the counters are of layouts {LABEL}, the status file's is other: are they from the same server?"]


@pytest.mark.parametrize("content, message", [
    (None, "status file {path} does not exist"),
    ("{not json", "status file {path} is not JSON: "),
    ('["a list"]', "{path} is not a kvhit status file: no 'pid', 'vllm', 'mode', 'modelled'"),
    ('{"pid": 1, "vllm": "0.33.0", "modelled": true}', "{path} is not a kvhit status file: no 'mode'"),
])
def test_a_missing_or_invalid_status_file_is_one_line_and_exit_2(tmp_path, capsys, content, message):
    path = str(tmp_path / "status.json") if content is None else _file(tmp_path, content)
    code, out, err = _run(capsys, "--status-file", path)
    assert (code, out) == (2, "")
    assert err.startswith("kvhit status: error: " + message.format(path=path)) and err.count("\n") == 1


def test_an_unreachable_server_is_one_line_and_exit_2(tmp_path, capsys):
    with fake_server(METRICS) as url:
        pass   # shut down: nothing listens on its port any more
    code, out, err = _run(capsys, "--url", url)
    assert (code, out) == (2, "")
    assert err.startswith(f"kvhit status: error: cannot read {url}/metrics: ") and err.count("\n") == 1


def test_a_url_without_metrics_is_one_line_and_exit_2(capsys):
    with fake_server(METRICS) as url:
        code, _, err = _run(capsys, "--url", url + "/v1")
    assert (code, err) == (2, f"kvhit status: error: cannot read {url}/v1/metrics: HTTP 404 Not Found\n")


def test_nothing_to_read_is_exit_2(capsys, monkeypatch):
    monkeypatch.delenv("KVHIT_STATUS_FILE", raising=False)
    assert _run(capsys)[0] == 2


def test_watch_refreshes_until_interrupted_and_shows_failures(tmp_path):
    path = tmp_path / "status.json"
    naps = []

    def sleep(seconds):
        naps.append(seconds)
        if len(naps) == 1:
            path.write_text(json.dumps(STATUS))   # the engine core writes its file between two refreshes
        if len(naps) == 3:
            raise KeyboardInterrupt

    class Out(list):
        def write(self, text):
            self.append(text)

        def flush(self):
            pass

    out = Out()
    assert status.main(None, str(path), False, 0.5, out=out, sleep=sleep) == 0
    screens = "".join(out).split("(every 0.5 s, ")
    assert naps == [0.5, 0.5, 0.5] and len(screens) == 4
    assert screens[0].startswith(f"error: status file {path} does not exist")
    assert all(f"layout: {LABEL} (modelled)" in screen for screen in screens[1:3])


def test_version_is_the_pyproject_version(capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["--version"])
    out = capsys.readouterr().out
    assert exit_.value.code == 0
    assert out.startswith(f"kvhit {project()['project']['version']} (") and out.rstrip().endswith("kvhit)")


def test_version_is_one_line_whatever_the_path_and_terminal(capsys, monkeypatch):
    # CI installs kvhit under a path longer than 80 columns, where argparse's version action wrapped the line.
    long_init = "/" + "/".join(["a-rather-long-folder-name"] * 6) + "/kvhit/__init__.py"
    monkeypatch.setattr(cli.kvhit, "__file__", long_init)
    monkeypatch.setenv("COLUMNS", "40")
    with pytest.raises(SystemExit) as exit_:
        cli.main(["--version"])
    assert exit_.value.code == 0
    version = project()["project"]["version"]
    assert capsys.readouterr().out == f"kvhit {version} ({os.path.dirname(long_init)})\n"
