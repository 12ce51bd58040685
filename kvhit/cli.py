"""The ``kvhit`` command: ``kvhit prove`` (more subcommands to come: explain, plan)."""

import argparse
import sys


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="kvhit", description="vLLM's prefix-cache hit length, checked")
    parser.add_argument("command", choices=["prove", "gen"], help="prove: run every invariant; "
                        "gen: regenerate refimpl/ from the spec")
    args, rest = parser.parse_known_args(argv[:1])
    if args.command == "prove":
        from kvhit.proofs.runner import main as prove

        return prove(argv[1:])
    from kvhit.spec.codegen import main as gen

    return gen(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
