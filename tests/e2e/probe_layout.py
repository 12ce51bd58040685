"""Show where a running vLLM 0.33 server exposes its KV cache layout (block size, groups).

Usage: venv/bin/python probe_layout.py [--mode lookahead|drop]
Starts the same server as serve_and_query.py plus --kv-events-config (ZMQ PUB connecting to a
ipc:// socket under logs/ that the engine binds) and VLLM_LOGGING_LEVEL=DEBUG, sends one 100-token
prompt twice, then prints: (1) layout-related server log lines, (2) vllm:cache_config_info from
/metrics, (3) /kv_event_sources, (4) the decoded BlockStored events (block_size, group_idx,
kv_cache_spec_kind, lookahead_token_ids). Always kills the server's process group.
"""
import argparse, json, os, re, subprocess, time, urllib.request
import msgspec, zmq
import serve_and_query as sq
from vllm.distributed.kv_events import KVEventBatch

ap = argparse.ArgumentParser(); ap.add_argument("--mode", default="lookahead"); a = ap.parse_args()
models = os.path.join(sq.HERE, "models")
port, zport = sq.free_port(), sq.free_port()
ctx = zmq.Context(); sub = ctx.socket(zmq.SUB); sub.setsockopt(zmq.SUBSCRIBE, b"")
ipc = f"ipc://{sq.HERE}/logs/kv-events-{os.getpid()}.sock"
kv_events = {"enable_kv_cache_events": True, "publisher": "zmq",
             "endpoint": ipc, "topic": "kv"}
cmd = sq.serve_cmd(os.path.join(models, "target"), os.path.join(models, "draft"), port, a.mode)
cmd += ["--kv-events-config", json.dumps(kv_events)]
env = sq.server_env(); env["VLLM_LOGGING_LEVEL"] = "DEBUG"
os.makedirs(os.path.join(sq.HERE, "logs"), exist_ok=True)
log_path = os.path.join(sq.HERE, "logs", f"probe-{a.mode}.log")
with open(log_path, "w") as log:
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                            start_new_session=True, stdin=subprocess.DEVNULL)
    try:
        print("healthy after", round(sq.wait_health(proc, port, 600), 1), "s")
        sub.connect(ipc)      # the engine binds ipc:// endpoints; we connect
        time.sleep(1)         # ZMQ slow joiner: let the subscription reach the publisher
        from openai import OpenAI
        c = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="EMPTY", max_retries=0)
        ids = sq.prompt_ids(100)
        for _ in range(2):
            r = c.completions.create(model="tiny", prompt=ids, max_tokens=2, temperature=0)
            print("cached_tokens", r.usage.prompt_tokens_details.cached_tokens)
        metrics = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics").read().decode()
        srcs = urllib.request.urlopen(f"http://127.0.0.1:{port}/kv_event_sources").read().decode()
        dec = msgspec.msgpack.Decoder(KVEventBatch)
        events, t_end = [], time.monotonic() + 5
        while time.monotonic() < t_end:
            if sub.poll(200):
                topic, seq, payload = sub.recv_multipart()
                events.extend(dec.decode(payload).events)
    finally:
        sq.stop(proc)
        sub.close(0); ctx.term()
        if os.path.exists(ipc[len("ipc://"):]):
            os.remove(ipc[len("ipc://"):])
print("== (1) server log lines about the KV cache layout ==")
pat = re.compile(r"kv cache|KV cache|block.size|kv_cache_groups|group sizes|lcm block|num_gpu_blocks|hash", re.I)
for line in open(log_path):
    if pat.search(line):
        print("  ", line.rstrip()[:300])
print("== (2) vllm:cache_config_info ==")
for line in metrics.splitlines():
    if line.startswith("vllm:cache_config_info"):
        labels = dict(re.findall(r'(\w+)="([^"]*)"', line))
        keep = ("block_size", "num_gpu_blocks", "enable_prefix_caching", "prefix_caching_hash_algo",
                "prefix_match_unit", "kv_cache_size_tokens", "mamba_block_size",
                "effective_attention_block_size", "cache_dtype")
        print("  ", {k: labels.get(k) for k in keep})
print("== (3) /kv_event_sources ==\n  ", srcs)
print(f"== (4) {len(events)} KV events ==")
for ev in events:
    d = {f: getattr(ev, f, None) for f in ("block_size", "group_idx", "kv_cache_spec_kind",
                                          "kv_cache_spec_sliding_window")}
    hs = getattr(ev, "block_hashes", [])
    la = getattr(ev, "lookahead_token_ids", None)
    print("  ", type(ev).__name__, d, "n_blocks", len(hs),
          "lookahead", None if la is None else [len(x) for x in la])
