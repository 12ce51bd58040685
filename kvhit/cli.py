"""The ``kvhit`` command: ``prove``, ``gen``, ``diff``, and the operator tools ``explain``, ``plan`` and ``status``.

``prove``, ``gen`` and ``diff`` need z3 and the spec; ``explain`` and ``plan`` use only the generated refimpl (and
the catalogue's data), so they run where neither z3 nor vLLM is installed (``explain --compare`` evaluates
the claims of ``kvhit.proofs`` and so needs z3); ``status`` reads a running server's ``/metrics`` and the
plugin's status file with the standard library.
"""

import argparse
import json
import os
import sys

import kvhit

COMMANDS = ("prove", "gen", "diff", "explain", "plan", "status")
OPERATOR_COMMANDS = ("explain", "plan", "status")


def _int_or_none(text):
    if text.lower() == "none":
        return None
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer or 'none', got {text!r}") from None


def _pmu(text):
    value = _int_or_none(text)
    return "none" if value is None else value


def _ints(text):
    try:
        return [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def _add_setting_args(p):
    p.add_argument("layout", help="a catalogue name (kvhit/spec/catalogue.py) or a JSON layout file "
                   "(docs/layout-format.md)")
    p.add_argument("--speculative", choices=["none", "lookahead", "drop"], default="none",
                   help="EAGLE/MTP mode: none, lookahead (hashes wait L tokens) or drop (recompute one unit)")
    p.add_argument("--num-speculative-tokens", type=int, default=None, metavar="K",
                   help="draft tokens per step (default 1 when speculating)")
    p.add_argument("--multi-module-mtp", action="store_true",
                   help="MTP with one module per draft token: the prefill lookahead becomes K")
    p.add_argument("--dcp", type=int, default=None, help="decode context parallel size (default: the layout's)")


def _explain_parser(sub):
    p = sub.add_parser("explain", help="derive one request's hit step by step")
    _add_setting_args(p)
    p.add_argument("n_tokens", type=int, metavar="N", help="prompt length in tokens")
    p.add_argument("--prefix-match-unit", type=_pmu, default=None, metavar="U|none",
                   help="hash unit an operator asks for; 'none' for the GCD rule (default: the layout's)")
    p.add_argument("--retention-interval", type=_int_or_none, default=0, metavar="R|none",
                   help="vLLM's prefix_cache_retention_interval: 0 (default, as vLLM), none (dense) or a "
                        "multiple of the scheduler block S")
    p.add_argument("--cache", choices=["written", "dense"], default=None,
                   help="written (default): what the first request left under each policy's write side; "
                        "dense: every spec group holds every boundary up to --cached (the read side alone)")
    p.add_argument("--cached", type=_ints, default=None, metavar="C[,C...]",
                   help="dense cache only: cached-prefix length, one for every spec group or one per spec "
                        "group (default: N, the whole prompt)")
    p.add_argument("--sibling", type=int, default=None, metavar="N2",
                   help="written cache: the longer prompt sharing the N tokens (default N + S)")
    p.add_argument("--policy", choices=["reference", "vllm_0_33", "historical"], default="reference")
    p.add_argument("--compare", action="store_true",
                   help="all three policies side by side, naming the invariant a difference violates")
    p.add_argument("--json", action="store_true", help="print JSON (schema: docs/explain.schema.json)")


def _plan_parser(sub):
    p = sub.add_parser("plan", help="rank the settings an operator controls for a workload")
    _add_setting_args(p)
    w = p.add_mutually_exclusive_group(required=True)
    w.add_argument("--workload", metavar="FILE",
                   help="one request per line: 'N' (a repeat of a cached N-token prompt) or 'N P' "
                        "(N tokens of which the first P are cached); '#' starts a comment")
    w.add_argument("--shared-prefix", metavar="DIST",
                   help="synthetic workload: cached shared-prefix length ~ DIST (fixed:X, uniform:LO:HI, "
                        "normal:MEAN:SD, lognormal:MEDIAN:SIGMA, choice:A,B,...)")
    p.add_argument("--suffix", metavar="DIST", default="fixed:0",
                   help="synthetic workload: uncached tokens after the prefix ~ DIST (default fixed:0)")
    p.add_argument("--requests", type=int, default=1000, help="synthetic workload size (default 1000)")
    p.add_argument("--seed", type=int, default=0, help="synthetic workload seed (default 0)")
    p.add_argument("--block-sizes", type=_ints, default=None, metavar="B,...",
                   help="candidate --block-size values for the groups that follow it")
    p.add_argument("--operator-groups", type=_ints, default=None, metavar="I,...",
                   help="KV-cache groups that follow --block-size (default: those the layout file marks)")
    p.add_argument("--prefix-match-units", type=lambda t: [_pmu(x) for x in t.split(",")], default=None,
                   metavar="U,...", help="candidate prefix_match_unit values, 'none' for the GCD rule "
                   "(default: none and every multiple of 16 that divides the GCD of the effective blocks)")
    p.add_argument("--retention-intervals", metavar="R,...", default=None,
                   type=lambda t: [None if x.strip().lower() == "none" else _ints(x)[0] for x in t.split(",")],
                   help="retention intervals to try, in scheduler blocks S ('none' for dense retention; "
                        "default none,0,1,2,4); 0 (vLLM's default) is tried for every setting, the others for "
                        "the best --retention-top")
    p.add_argument("--retention-top", type=int, default=3, metavar="T",
                   help="settings tried at the other retention intervals (default 3)")
    p.add_argument("--cache", choices=["written", "dense"], default="written",
                   help="written (default): what the shared prefix left as a prompt of its own; dense: every "
                        "state of the shared prefix retained (no retention setting)")
    p.add_argument("--rank-by", choices=["reference", "vllm_0_33", "historical"], default="reference")
    p.add_argument("--top", type=int, default=10,
                   help="rows of the table (default 10); the policies other than --rank-by are evaluated for "
                        "these rows only")
    p.add_argument("--plot", metavar="PNG", help="write hit length vs prompt length for the best settings")
    p.add_argument("--plot-settings", type=int, default=3, help="settings in the plot (default 3)")
    p.add_argument("--json", action="store_true",
                   help="print the ranking as JSON (every setting under every policy: slower than the table)")
    p.add_argument("--jobs", type=int, default=None, metavar="J",
                   help="worker processes for large workloads (default: the CPUs available; 1: no workers)")


def _status_parser(sub):
    p = sub.add_parser("status", help="what the kvhit plugin did on a running vLLM server")
    p.add_argument("--url", metavar="URL",
                   help="the server's base URL (e.g. http://127.0.0.1:8000); kvhit's counters are read from "
                        "URL/metrics")
    p.add_argument("--status-file", metavar="FILE", default=None,
                   help="the JSON file the plugin writes (default: $KVHIT_STATUS_FILE)")
    p.add_argument("--json", action="store_true", help="print JSON (schema kvhit.status/1)")
    p.add_argument("--watch", type=float, nargs="?", const=2.0, default=None, metavar="SECONDS",
                   help="refresh every SECONDS (default 2) until interrupted")


def version():
    """``kvhit <version> (<folder kvhit is imported from>)``."""
    return f"kvhit {kvhit.__version__} ({os.path.dirname(os.path.abspath(kvhit.__file__))})"


class _VersionAction(argparse.Action):
    """``--version``: print version() as it is. argparse's own version action wraps its text at the terminal's
    width (80 columns without one), which split the line wherever kvhit is installed under a long path."""

    def __init__(self, option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS, help=None):
        super().__init__(option_strings, dest, nargs=0, default=default, help=help or "print kvhit's version and "
                         "the folder it is imported from, then exit")

    def __call__(self, parser, namespace, values, option_string=None):
        print(version())
        parser.exit()


def _fail(command, message):
    print(f"kvhit {command}: error: {message}", file=sys.stderr)
    return 2


def _explain(args):
    from kvhit import explain, layouts

    try:
        layout, _ = layouts.load(args.layout)
        layout = layouts.configure(layout, dcp=args.dcp, prefix_match_unit=args.prefix_match_unit)
        spec = explain.speculation(args.speculative, args.num_speculative_tokens, args.multi_module_mtp)
        policies = explain.POLICIES if args.compare else (args.policy,)
        report = explain.explain(layout, spec, args.n_tokens, policies, cached=args.cached,
                                 retention_interval=args.retention_interval, compare=args.compare,
                                 cache=args.cache, sibling=args.sibling)
    except ValueError as e:
        return _fail("explain", e)
    print(json.dumps(report, indent=2) if args.json else explain.render(report, layout))
    return 0


def _plan(args):
    import time

    from kvhit import explain, layouts, plan

    started = time.perf_counter()
    try:
        layout, marked = layouts.load(args.layout)
        operator_groups = tuple(args.operator_groups) if args.operator_groups is not None else marked
        spec = explain.speculation(args.speculative, args.num_speculative_tokens, args.multi_module_mtp)
        if args.workload:
            workload = plan.read_workload(args.workload)
        else:
            workload = plan.synthetic_workload(args.shared_prefix, args.suffix, args.requests, args.seed)
        candidates = plan.candidates(layout, spec, dcp=args.dcp, block_sizes=args.block_sizes,
                                     operator_groups=operator_groups,
                                     prefix_match_units=args.prefix_match_units, cache=args.cache,
                                     retention_intervals=args.retention_intervals)
        shown = None if args.json else args.top
        ranked = plan.plan_settings(candidates, workload, args.rank_by, args.retention_top,
                                    explicit=args.retention_intervals is not None, shown=shown, jobs=args.jobs)
    except ValueError as e:
        return _fail("plan", e)
    elapsed = time.perf_counter() - started
    if args.json:
        print(json.dumps(plan.to_json(ranked, workload, args.rank_by), indent=2), flush=True)
    else:
        print(plan.render(ranked, workload, args.rank_by, args.top), flush=True)
    if args.plot:
        plan.plot(ranked[0][:args.plot_settings], workload, args.plot, args.rank_by)
        print(f"plot: {args.plot}", file=sys.stderr)
    others = len(ranked[0]) if args.json else min(args.top, len(ranked[0]))
    print(f"plan: {len(workload)} requests x {len(candidates.settings)} settings under {args.rank_by}, "
          f"and the other two policies for the {others} {'settings' if args.json else 'shown'}, "
          f"in {elapsed:.2f} s", file=sys.stderr)
    return 0


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in OPERATOR_COMMANDS:
        parser = argparse.ArgumentParser(prog="kvhit", description="vLLM's prefix-cache hit length, checked")
        sub = parser.add_subparsers(dest="command", required=True)
        _explain_parser(sub)
        _plan_parser(sub)
        _status_parser(sub)
        args = parser.parse_args(argv)
        if args.command == "status":
            from kvhit import status

            return status.main(args.url, args.status_file, args.json, args.watch)
        return _explain(args) if args.command == "explain" else _plan(args)
    parser = argparse.ArgumentParser(prog="kvhit", description="vLLM's prefix-cache hit length, checked")
    parser.add_argument("--version", action=_VersionAction)
    parser.add_argument("command", choices=COMMANDS, help="prove: run every invariant; gen: regenerate "
                        "refimpl/ from the spec; diff: where two policies' hits differ; explain: derive one hit; plan: rank settings for a workload; "
                        "status: what the vLLM plugin did on a running server")
    args, _ = parser.parse_known_args(argv[:1])
    if args.command == "prove":
        from kvhit.proofs.runner import main as prove

        return prove(argv[1:])
    if args.command == "diff":
        from kvhit.proofs.diff import main as diff

        return diff(argv[1:])
    from kvhit.spec.codegen import main as gen

    return gen(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
