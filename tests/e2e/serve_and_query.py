"""Start `vllm serve` (vLLM 0.33.0, CPU) with prefix caching + EAGLE and record cached_tokens.

Usage: venv/bin/python serve_and_query.py [--mode lookahead|drop|both] [--models DIR]
       [--lengths 100,128,250,256,511] [--health-timeout 600] [--keep-log]
For each mode: pick a free 127.0.0.1 port, start the server in its own process group, wait for
/health, send each prompt (token-id list, max_tokens 2, temperature 0) twice, record
usage.prompt_tokens_details.cached_tokens, then always kill the process group. The server log
is kept under logs/ on failure (and with --keep-log). Results go to results-<mode>.json.
"""
import argparse
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
VENV_BIN = os.path.join(HERE, "venv", "bin")


def free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_env():
    env = dict(os.environ)
    env.update(VLLM_TARGET_DEVICE="cpu", VLLM_CPU_KVCACHE_SPACE="1", HF_HUB_OFFLINE="1",
               TRANSFORMERS_OFFLINE="1", VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1",
               PYTHONUNBUFFERED="1")
    env.update({k: v for k, v in (e.split("=", 1) for e in os.environ.get("E2E_EXTRA_ENV", "").split()) if k})
    return env


def serve_cmd(target, draft, port, mode):
    spec = {"method": "eagle", "model": draft, "num_speculative_tokens": 1}
    if mode == "drop":
        spec["disable_lookahead_block_hashes"] = True
    return [os.path.join(VENV_BIN, "vllm"), "serve", target, "--served-model-name", "tiny",
            "--host", "127.0.0.1", "--port", str(port),
            "--enable-prefix-caching", "--enable-prompt-tokens-details", "--block-size", "32",
            "--enforce-eager", "--max-model-len", "2048", "--dtype", "float32",
            "--speculative-config", json.dumps(spec)]


def wait_health(proc, port, timeout):
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited early with code {proc.returncode}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if r.status == 200:
                    return time.monotonic() - t0
        except Exception:
            pass
        time.sleep(1)
    raise TimeoutError(f"/health not ready after {timeout} s")


def stop(proc):
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
        except ProcessLookupError:
            pass
    # children that outlived the leader (engine core) share the group: make sure they are gone
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def prompt_ids(n):
    rng = random.Random(1000 + n)          # a different prompt per length: no cross-length sharing
    return [rng.randrange(4, 512) for _ in range(n)]


def spec_metrics(port):
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
            text = r.read().decode()
    except Exception as e:  # metrics are informative only
        return {"error": str(e)}
    out = {}
    for line in text.splitlines():
        if line.startswith(("vllm:spec_decode_num_draft", "vllm:spec_decode_num_accepted",
                            "vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total")):
            name, val = line.rsplit(" ", 1)
            if name.split("{")[0].endswith("_created"):
                continue
            out[name.split("{")[0]] = float(val)
    return out


def run_mode(mode, target, draft, lengths, health_timeout, keep_log):
    from openai import OpenAI
    os.makedirs(os.path.join(HERE, "logs"), exist_ok=True)
    port = free_port()
    log_path = os.path.join(HERE, "logs", f"server-{mode}-{time.strftime('%Y%m%d-%H%M%S')}.log")
    cmd = serve_cmd(target, draft, port, mode)
    print(f"[{mode}] port {port}; log {log_path}\n[{mode}] " + " ".join(
        f"'{c}'" if c.startswith("{") else c for c in cmd), flush=True)
    ok = False
    result = {"mode": mode, "port": port, "rows": [], "timings": {}}
    with open(log_path, "w") as log:
        t0 = time.monotonic()
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=server_env(),
                                start_new_session=True, stdin=subprocess.DEVNULL)
        try:
            result["timings"]["server_start_s"] = round(wait_health(proc, port, health_timeout), 1)
            print(f"[{mode}] healthy after {result['timings']['server_start_s']} s", flush=True)
            client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="EMPTY",
                            timeout=300, max_retries=0)
            tq = time.monotonic()
            for n in lengths:
                ids = prompt_ids(n)
                row = {"len": n}
                for tag in ("first", "repeat"):
                    ts = time.monotonic()
                    r = client.completions.create(model="tiny", prompt=ids, max_tokens=2,
                                                  temperature=0)
                    det = r.usage.prompt_tokens_details
                    assert r.usage.prompt_tokens == n, (r.usage.prompt_tokens, n)
                    row[tag] = det.cached_tokens if det is not None else None
                    row[tag + "_s"] = round(time.monotonic() - ts, 2)
                result["rows"].append(row)
            result["timings"]["queries_s"] = round(time.monotonic() - tq, 1)
            result["metrics"] = spec_metrics(port)
            ok = True
        except BaseException:
            print(f"[{mode}] server log kept: {log_path}", flush=True)
            raise
        finally:
            stop(proc)
            result["timings"]["total_s"] = round(time.monotonic() - t0, 1)
    if ok and not keep_log:
        os.remove(log_path)
    else:
        result["log"] = log_path
        print(f"[{mode}] server log kept: {log_path}", flush=True)
    return result, ok


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", default="both", choices=["lookahead", "drop", "both"])
    ap.add_argument("--models", default=os.path.join(HERE, "models"))
    ap.add_argument("--lengths", default="100,128,250,256,511")
    ap.add_argument("--health-timeout", type=float, default=600)
    ap.add_argument("--keep-log", action="store_true")
    a = ap.parse_args()
    target, draft = os.path.join(a.models, "target"), os.path.join(a.models, "draft")
    lengths = [int(x) for x in a.lengths.split(",")]
    modes = ["lookahead", "drop"] if a.mode == "both" else [a.mode]
    results, all_ok = [], True
    for mode in modes:
        try:
            res, ok = run_mode(mode, target, draft, lengths, a.health_timeout, a.keep_log)
        except Exception as e:
            print(f"[{mode}] FAILED: {type(e).__name__}: {e}", flush=True)
            all_ok = False
            continue
        results.append(res)
        with open(os.path.join(HERE, f"results-{mode}.json"), "w") as f:
            json.dump(res, f, indent=1)
    print("\nmode       len  cached(first)  cached(repeat)")
    for res in results:
        for row in res["rows"]:
            print(f"{res['mode']:<10} {row['len']:>4}  {row['first']!s:>13}  {row['repeat']!s:>14}")
    for res in results:
        print(f"{res['mode']}: timings {res['timings']} metrics {res.get('metrics')}")
    sys.exit(0 if all_ok else 1)


if __name__ == "__main__":
    main()
