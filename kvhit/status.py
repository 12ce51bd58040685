"""``kvhit status``: what the kvhit plugin did on a running vLLM server, as a person reads it (or JSON).

Two sources, both left by the plugin (docs/adapter.md):

* the status file (``KVHIT_STATUS_FILE``), written by the engine-core process when the scheduler's KV cache
  manager is built: vLLM's and kvhit's versions, the mode, the layout the engine built and its sizes, whose
  write side it has, or why it is not modelled;
* the server's ``/metrics`` since it started: lookups, divergences from vLLM 0.33's hit and their tokens
  (``vllm:kvhit_*``, by mode), enforce fallbacks and unmodelled layouts (``kvhit_*``), and vLLM's own
  prefix-cache counters. The engine core's counters reach ``/metrics`` only when ``vllm serve`` runs with
  ``PROMETHEUS_MULTIPROC_DIR``.

Standard library and the generated refimpl only (the margins are ``refimpl.derive_sizes`` of the layout the
file names); the prometheus text format is parsed here, so prometheus_client is not needed.
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
import urllib.error
import urllib.request

from kvhit import refimpl
from kvhit.layouts import describe_group

SCHEMA_ID = "kvhit.status/1"
STATUS_FILE_ENV = "KVHIT_STATUS_FILE"  # the plugin's name for it (kvhit.adapters.vllm.engine.STATUS_FILE_ENV)
STATUS_KEYS = ("pid", "vllm", "mode", "modelled")
DIRECTIONS = ("reference_longer", "reference_shorter")

# The plugin's counters (kvhit.adapters.vllm.engine) and vLLM's, as /metrics names their samples.
LOOKUPS = "vllm:kvhit_lookups_total"
DIVERGENCES = "vllm:kvhit_hit_divergences_total"
DIVERGENCE_TOKENS = "vllm:kvhit_hit_divergence_tokens_total"
FALLBACKS = "kvhit_enforce_fallbacks_total"
UNMODELLED = "kvhit_unmodelled_layouts_total"
PREFIX_QUERIES = "vllm:prefix_cache_queries_total"
PREFIX_HITS = "vllm:prefix_cache_hits_total"

MODE_MEANING = {
    "off": "nothing is patched: vLLM runs stock",
    "shadow": "vLLM's hits are served; kvhit computes the reference hit beside each lookup and counts where "
              "they differ",
    "enforce": "the scheduler's prefix-cache hit length is kvhit's reference hit; vLLM provides the blocks",
}
ALWAYS_STOCK = ("any layout kvhit cannot enforce whole (a write side the spec does not model, a KV connector "
                "unchecked or beside a sliding window, chunked local attention or Mamba, auxiliary outputs that "
                "cap at another kind's blocks): wholly, reported as not modelled")
NOT_COUNTED = "not counted (start vllm serve with KVHIT_COUNT_GAINS=1 to count them in enforce)"
NO_COUNTERS = ("no kvhit counters on /metrics: kvhit is off there, or vllm serve was started without "
               "PROMETHEUS_MULTIPROC_DIR (the counters live in the engine-core process)")


def _kind_prose(kind: str) -> str:
    """A spec group's kind as the status file writes it (``"swa"``), as prose names it (``sliding window``); a
    kind this kvhit does not know, as written."""
    try:
        return refimpl.Kind(kind).prose
    except ValueError:
        return kind


class StatusError(Exception):
    """A source that cannot be read; the message is one line naming it and the problem."""


# --------------------------------------------------------------------------------------------------
# Sources
# --------------------------------------------------------------------------------------------------

def read_status_file(path: str) -> dict:
    """The plugin's status file at ``path``."""
    try:
        with open(path) as f:
            text = f.read()
    except FileNotFoundError:
        raise StatusError(f"status file {path} does not exist (the plugin writes it when the engine core "
                          f"builds its KV cache manager, with {STATUS_FILE_ENV} set)") from None
    except OSError as e:
        raise StatusError(f"cannot read status file {path}: {e.strerror or e}") from None
    try:
        status = json.loads(text)
    except json.JSONDecodeError as e:
        raise StatusError(f"status file {path} is not JSON: {e}") from None
    missing = [key for key in STATUS_KEYS if not isinstance(status, dict) or key not in status]
    if missing:
        raise StatusError(f"{path} is not a kvhit status file: no {', '.join(repr(k) for k in missing)}")
    return status


def metrics_url(url: str) -> str:
    """``<url>/metrics`` of a server's base URL (a URL already ending in ``/metrics`` is kept)."""
    url = url.rstrip("/")
    if "://" not in url:
        url = "http://" + url
    return url if url.endswith("/metrics") else url + "/metrics"


def fetch_metrics(url: str, timeout: float = 5.0) -> str:
    """The text of ``url`` (a ``/metrics`` URL)."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.read().decode("utf-8", errors="replace")
    except urllib.error.HTTPError as e:
        raise StatusError(f"cannot read {url}: HTTP {e.code} {e.reason}") from None
    except (urllib.error.URLError, OSError) as e:
        reason = getattr(e, "reason", e)
        raise StatusError(f"cannot read {url}: {reason}") from None


_SAMPLE = re.compile(r"([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?[ \t]+(\S+)(?:[ \t]+-?\d+)?[ \t]*")
_LABEL = re.compile(r'[ \t]*([a-zA-Z_][a-zA-Z0-9_]*)[ \t]*=[ \t]*"((?:[^"\\]|\\.)*)"[ \t]*(?:,|$)')
_ESCAPES = {"\\\\": "\\", '\\"': '"', "\\n": "\n"}


def _malformed(number: int, line: str) -> StatusError:
    return StatusError(f"line {number} of the metrics is not in the prometheus text format: {line[:80]}")


def _labels(body: str, number: int, line: str) -> dict[str, str]:
    labels, pos = {}, 0
    while pos < len(body):
        m = _LABEL.match(body, pos)
        if m is None:
            raise _malformed(number, line)
        labels[m.group(1)] = re.sub(r'\\[\\"n]', lambda e: _ESCAPES[e.group()], m.group(2))
        pos = m.end()
    return labels


def parse_metrics(text: str) -> list[tuple[str, dict[str, str], float]]:
    """The samples of a prometheus text-format exposition: ``(name, labels, value)``, comments skipped."""
    samples = []
    for number, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE.fullmatch(line)
        if m is None:
            raise _malformed(number, line)
        try:
            value = float(m.group(3))
        except ValueError:
            raise _malformed(number, line) from None
        samples.append((m.group(1), _labels(m.group(2) or "", number, line), value))
    return samples


# --------------------------------------------------------------------------------------------------
# The report
# --------------------------------------------------------------------------------------------------

def _total(samples, name: str, **labels: str) -> float:
    return sum(value for n, ls, value in samples
               if n == name and all(ls.get(k) == v for k, v in labels.items()))


def counters(samples) -> dict | None:
    """kvhit's counters since the server started (None when /metrics shows none of them)."""
    names = {LOOKUPS, DIVERGENCES, DIVERGENCE_TOKENS, FALLBACKS, UNMODELLED}
    ours = [(n, ls) for n, ls, _ in samples if n in names]
    if not ours:
        return None
    divergences = {d: int(_total(samples, DIVERGENCES, direction=d)) for d in DIRECTIONS}
    tokens = {d: int(_total(samples, DIVERGENCE_TOKENS, direction=d)) for d in DIRECTIONS}
    out = {
        "modes": sorted({ls["mode"] for n, ls in ours if "mode" in ls}),
        "layouts": sorted({ls["layout"] for n, ls in ours if "layout" in ls}),
        "lookups": int(_total(samples, LOOKUPS)),
        "divergences": divergences,
        "divergence_tokens": tokens,
        "tokens_gained": tokens["reference_longer"] - tokens["reference_shorter"],
        "enforce_fallbacks": int(_total(samples, FALLBACKS)),
        "unmodelled_layouts": int(_total(samples, UNMODELLED)),
    }
    if any(n == PREFIX_QUERIES for n, _, _ in samples):
        out["vllm_prefix_cache"] = {"queried_tokens": int(_total(samples, PREFIX_QUERIES)),
                                    "hit_tokens": int(_total(samples, PREFIX_HITS))}
    return out


def layout_report(status: dict) -> dict:
    """The layout the status file names, with the spec's derived sizes (``refimpl.derive_sizes``)."""
    layout = status["layout"]
    out = {"label": status.get("label"), "groups": layout["groups"], "dcp": layout["dcp"],
           "prefix_match_unit": layout["prefix_match_unit"], "aux_cap_group": layout.get("aux_cap_group"),
           "speculation": status["speculation"],
           "sizes": dict(status["sizes"])}
    try:
        groups = tuple(refimpl.Group(**g) for g in layout["groups"])
        sizes = refimpl.derive_sizes(refimpl.Layout(groups, layout["dcp"], layout["prefix_match_unit"],
                                                    aux_cap_group=layout.get("aux_cap_group")),
                                     refimpl.Speculation(**status["speculation"]))
    except (TypeError, ValueError) as e:
        out["derive_error"] = f"{type(e).__name__}: {e}"
        return out
    out["sizes"].update(hash_lookahead=sizes.hash_lookahead, prefill_lookahead=sizes.prefill_lookahead,
                        eagle_unit=sizes.eagle_unit)
    out["spec_groups"] = [{"kind": g.kind.value, "block": g.block, "window": g.window, "chunk": g.chunk,
                           "members": list(g.members), "drops": g.drops, "margin": g.margin, "fine": g.fine}
                          for g in sizes.groups]
    out["described_groups"] = [describe_group(g) for g in groups]
    return out


def stock_paths(status: dict | None, mode: str | None, found: dict | None) -> list[str]:
    """What vLLM still answers itself, and why."""
    if mode == "off":
        return ["everything: KVHIT_MODE is off"]
    out = []
    if status is not None and not status["modelled"]:
        out.append(f"every lookup and write on this layout: not modelled ({status.get('unmodelled')})")
    elif mode == "shadow":
        out.append("every hit and every write (shadow changes nothing)")
    elif status is not None and status.get("write_side", "reference") != "reference":
        # a status file of a kvhit that enforced a read side on vLLM's write side (this one leaves such a
        # layout wholly to vLLM, as not modelled)
        out.append(f"write side: {status['write_side']}")
    if found and found["enforce_fallbacks"]:
        out.append(f"{found['enforce_fallbacks']} enforced lookups answered by vLLM after a kvhit failure "
                   "(see the engine-core log)")
    return out + [ALWAYS_STOCK]


def report(status: dict | None, samples: list | None, url: str | None = None,
           status_file: str | None = None) -> dict:
    """What ``kvhit status --json`` prints: the status file's facts, the counters, and what is left stock."""
    found = counters(samples) if samples is not None else None
    mode = status["mode"] if status is not None else (
        found["modes"][0] if found and len(found["modes"]) == 1 else None)
    notes = []
    if samples is not None and found is None and mode != "off":
        notes.append(NO_COUNTERS)
    if status is not None and found and status.get("label") and found["layouts"] and (
            found["layouts"] != [status["label"]]):
        notes.append(f"the counters are of layouts {', '.join(found['layouts'])}, the status file's is "
                     f"{status['label']}: are they from the same server?")
    out = {"schema": SCHEMA_ID, "url": url, "status_file": status_file, "mode": mode,
           "vllm": None, "kvhit": None, "kvhit_path": None, "pid": None, "modelled": None, "unmodelled": None,
           "write_side": None, "layout": None}
    if status is not None:
        out.update({k: status.get(k) for k in ("vllm", "kvhit", "kvhit_path", "pid", "modelled", "unmodelled",
                                               "write_side")})
        if status["modelled"]:
            out["layout"] = layout_report(status)
    # Enforce compares its hits with vLLM's only when asked (the plugin's KVHIT_COUNT_GAINS); shadow always.
    gains_counted = mode != "enforce" or status is None or status.get("count_gains", True)
    out.update(stock=stock_paths(status, mode, found), counters=found, gains_counted=gains_counted, notes=notes)
    return out


def render(rep: dict) -> str:
    """The report as a person reads it."""
    lines = []
    add = lines.append
    sources = [s for s in (rep["url"] and f"server {rep['url']}",
                           rep["status_file"] and f"status file {rep['status_file']}") if s]
    add("kvhit status: " + ", ".join(sources))
    if rep["vllm"] is not None:
        add(f"  vLLM {rep['vllm']}, kvhit {rep['kvhit'] or '?'}"
            + (f" ({rep['kvhit_path']})" if rep["kvhit_path"] else "") + f"; engine core pid {rep['pid']}")
    mode = rep["mode"]
    add(f"  mode: {mode or 'unknown (no status file)'}" + (f": {MODE_MEANING[mode]}" if mode in MODE_MEANING
                                                            else ""))
    layout = rep["layout"]
    if rep["modelled"] is False:
        add(f"  layout: not modelled, left to vLLM: {rep['unmodelled']}")
    elif layout is not None:
        s = layout["sizes"]
        add(f"  layout: {layout['label']} (modelled)")
        add(f"    S={s['scheduler_block']} h={s['hash_block']} A={s['alignment']}"
            + (f"; hash lookahead L={s['hash_lookahead']}, prefill lookahead Lp={s['prefill_lookahead']}, "
               f"EAGLE drop unit {s['eagle_unit']}" if "eagle_unit" in s else ""))
        if "spec_groups" in layout:
            add(f"    KV-cache groups: {'; '.join(layout['described_groups'])}; DCP {layout['dcp']}")
            for k, g in enumerate(layout["spec_groups"]):
                members = ", ".join(map(str, g["members"]))
                window = f", window {g['window']}" if g["window"] is not None else ""
                drop = f", drops (margin {g['margin']})" if g["drops"] else ""
                add(f"    spec group {k}: {_kind_prose(g['kind'])}, block {g['block']}{window} "
                    f"(KV-cache groups {members}){drop}")
        else:
            add(f"    ({layout['derive_error']}: the margins are not shown)")
        if layout.get("aux_cap_group") is not None:
            add(f"    every lookup capped at KV-cache group {layout['aux_cap_group']}'s leading whole blocks "
                "(auxiliary outputs)")
        add(f"  write side{' under enforce' if mode == 'shadow' else ''}: {rep['write_side'] or '?'}")
    add("  left to vLLM:")
    lines += [f"    - {line}" for line in rep["stock"]]
    c = rep["counters"]
    if c is not None:
        d, t = c["divergences"], c["divergence_tokens"]
        gained = "prompt tokens enforce would gain" if mode == "shadow" else "prompt tokens gained over stock"
        diverged = d["reference_longer"] + d["reference_shorter"]
        parts = [f"{d[k]} {word} by {t[k]} tokens" for k, word in (("reference_longer", "longer"),
                                                                    ("reference_shorter", "shorter")) if d[k]]
        unlike = f"{diverged} ({', '.join(parts)})" if parts else "0"
        counted = rep["gains_counted"]
        rows = [("lookups kvhit computed", c["lookups"]),
                ("hits unlike vLLM 0.33's", unlike if counted else NOT_COUNTED),
                (gained, c["tokens_gained"] if counted else NOT_COUNTED),
                ("enforce fallbacks", c["enforce_fallbacks"]),
                ("unmodelled layouts", c["unmodelled_layouts"])]
        if "vllm_prefix_cache" in c:
            p = c["vllm_prefix_cache"]
            rows.append(("vLLM prefix cache", f"{p['hit_tokens']} of {p['queried_tokens']} queried tokens hit"))
        width = max(len(label) for label, _ in rows) + 2
        add("  since the server started (/metrics):")
        lines += [f"    {label:<{width}}{value}" for label, value in rows]
    lines += [f"  note: {note}" for note in rep["notes"]]
    return "\n".join(lines)


def collect(url: str | None, status_file: str | None) -> dict:
    """Read the sources and build the report; :class:`StatusError` names the first that fails."""
    if url is None and status_file is None:
        raise StatusError(f"nothing to read: give --url, --status-file, or set {STATUS_FILE_ENV}")
    status = read_status_file(status_file) if status_file is not None else None
    samples = parse_metrics(fetch_metrics(metrics_url(url))) if url is not None else None
    return report(status, samples, url, status_file)


def main(url: str | None, status_file: str | None, as_json: bool, watch: float | None,
         out=None, sleep=time.sleep) -> int:
    """``kvhit status``: 0, or 2 with one line on stderr when a source cannot be read. With ``watch`` it
    refreshes every ``watch`` seconds until interrupted (a source that fails is shown and retried)."""
    out = out if out is not None else sys.stdout
    status_file = status_file if status_file is not None else os.environ.get(STATUS_FILE_ENV) or None
    if watch is None:
        try:
            rep = collect(url, status_file)
        except StatusError as e:
            print(f"kvhit status: error: {e}", file=sys.stderr)
            return 2
        print(json.dumps(rep, indent=2) if as_json else render(rep), file=out)
        return 0
    clear = "\x1b[H\x1b[2J" if not as_json and getattr(out, "isatty", lambda: False)() else ""
    try:
        while True:
            try:
                rep = collect(url, status_file)
                text = json.dumps(rep) if as_json else render(rep)
            except StatusError as e:
                text = json.dumps({"schema": SCHEMA_ID, "error": str(e)}) if as_json else f"error: {e}"
            stamp = "" if as_json else f"\n(every {watch:g} s, {time.strftime('%H:%M:%S')}; Ctrl-C stops)"
            print(clear + text + stamp, file=out, flush=True)
            sleep(watch)
    except KeyboardInterrupt:
        return 0
